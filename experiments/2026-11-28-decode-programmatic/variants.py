"""Where the programmatic combine launch loses (2026-11-28, sixth session; issue #18).

The first run (`benchmarks/results/2026-11-28-h200-decode-programmatic.json`) had the
programmatic combine 1.01-1.05x its "stream" twin on 16-row points but 0.76-0.97x on 32-row
ones at q_len 4. Variants of each kernel-combine point, timed in one process, interleaved:

- stream: as before;
- pdl-start: the tree's "programmatic" (the main kernel lets its dependents launch at entry);
- pdl-start-solo: the same, the combine given more than half an SM's shared memory, so that at
  most one of its blocks sits on an SM (none piled on the SMs the main kernel leaves free);
- pdl-exit: no explicit trigger (the dependents launch as the main kernel's blocks exit);
- pdl-end: the trigger after the block's part is written.

Usage: python experiments/2026-11-28-decode-programmatic/variants.py --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TRIGGER = "  if constexpr (COMBINE_PDL) let_dependents_launch();\n"
END = "  if constexpr (COMBINE_FUSED) combine_if_last();\n}"
SOLO_SMEM = 116 * 1024  # > half of sm_90's 228 KB an SM, with 1 KB a block kept by the runtime

POINTS = [dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, STAGES=3, CLUSTER=2),
          dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, STAGES=2, CLUSTER=1),
          dict(BLOCK_N=64, BLOCK_M=32, NUM_WARPS=4, STAGES=3, CLUSTER=1),
          dict(BLOCK_N=128, BLOCK_M=16, NUM_WARPS=4, STAGES=3, CLUSTER=1)]
BASE = dict(VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
            COMBINE="kernel", COMBINE_ITEMS=1, PAGE_STAGING="regs")
WORKLOADS = ["decode-b1-q4-h64-kv8-d128-c4096-paged64-bf16",
             "decode-b1-q4-h64-kv8-d128-c32768-paged64-bf16",
             "decode-b1-q1-h64-kv8-d128-c4096-paged64-bf16",
             "decode-b8-q4-h64-kv8-d128-c4096-paged64-bf16"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    from evoengine import measure, paths, provenance
    from evoengine.compile import compile_source
    from evoengine.decode import DecodeKernel
    from evoengine.problems import workload_from_key
    from evoengine.problems.decode import Decode
    from evoengine.render import make_candidate, render
    from evoengine.runtime import gpu_arch
    from evoengine.space import SearchSpace

    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()
    problem = Decode()
    variants = ("stream", "pdl-start", "pdl-start-solo", "pdl-exit", "pdl-end")
    problem_ = workload_from_key(WORKLOADS[0]).problem()  # every workload's: paged bf16 d128
    jobs = []
    for p in POINTS:
        name = "n{BLOCK_N} m{BLOCK_M} w{NUM_WARPS} s{STAGES} c{CLUSTER}".format(**p)
        for variant in variants:
            launch = "stream" if variant == "stream" else "programmatic"
            cand = make_candidate(space, space.complete(dict(BASE, **p, COMBINE_LAUNCH=launch)),
                                  problem_, arch)
            src = render(cand)
            if variant in ("pdl-exit", "pdl-end"):
                assert src.count(TRIGGER) == 1 and src.count(END) == 1
                src = src.replace(TRIGGER, "")
                if variant == "pdl-end":
                    src = src.replace(END, "  let_dependents_launch();\n" + END)
            jobs.append((name, variant, cand, src))

    def build(job: tuple) -> DecodeKernel:
        name, variant, cand, src = job
        compiled = compile_source(src, arch, cand.defines(arch),
                                  identity=f"{cand.identity}@{variant}",
                                  smem_bytes=cand.smem_bytes)
        assert compiled.ok, compiled.error
        k = DecodeKernel(cand, compiled)
        if variant == "pdl-start-solo":
            k.combine.smem_bytes = SOLO_SMEM
        return k
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(build, jobs))
    all_kernels = {(j[0], j[1]): k for j, k in zip(jobs, built, strict=True)}
    rows = []
    for key in WORKLOADS:
        w = workload_from_key(key)
        kernels = {}
        for nv, k in all_kernels.items():
            verdict = problem.check(k, w)
            assert verdict.ok, (nv, key, verdict.reason)
            kernels[nv] = k
        sets = problem.inputs(w)
        times: dict[tuple[str, str], list[float]] = {nv: [] for nv in kernels}
        for _ in range(args.rounds):
            for nv, k in kernels.items():
                times[nv].append(measure.time_calls(problem.timed_call(k, w, sets), len(sets),
                                                    graph=True).median_us)
        del sets
        torch.cuda.empty_cache()
        med = {f"{n} | {v}": statistics.median(t) for (n, v), t in times.items()}
        rows.append(dict(workload=key, points_us=med))
        print(key)
        for p in POINTS:
            name = "n{BLOCK_N} m{BLOCK_M} w{NUM_WARPS} s{STAGES} c{CLUSTER}".format(**p)
            base = med[f"{name} | stream"]
            print(f"  {name:22s} stream {base:7.2f} " + " ".join(
                f"{v} {base / med[f'{name} | {v}']:.3f}"
                for v in ("pdl-start", "pdl-start-solo", "pdl-exit", "pdl-end")))
    doc = dict(provenance.header(**provenance.local_device(), method=(
        f"{measure.TIMING}, graph replay of {measure.GRAPH_CALLS} calls; {args.rounds} rounds "
        "interleaved over the variants, the median of the rounds'; every kernel through the "
        "criterion first")), rows=rows)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
