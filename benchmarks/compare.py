"""Time candidates side by side with SDPA's flash and cuDNN backends, in one process.

    python benchmarks/compare.py --family mma --sweep 40 --json out.json
    python benchmarks/compare.py --family mma --params '{"BLOCK_M": 64, ...}'

For each workload: compile the candidates (in parallel), validate each with the project's
criterion, time the valid ones and both SDPA backends with evoengine.measure, and print a
table. Rows carry the best candidate per workload; --all-rows keeps every candidate.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from evoengine import measure, paths, validate  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import Kernel, gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

DEFAULT_WORKLOADS = [
    "16,16,2048,64", "16,16,2048,64,causal", "8,16,4096,128", "8,16,4096,128,causal",
    "1,8,512,64",
]
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def time_kernel(kernel: Kernel, w: Workload, sets: list) -> measure.Timing:
    return measure.time_calls(measure.kernel_call(kernel, sets, w.head_dim ** -0.5), len(sets),
                              graph=measure.graph_for(w))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="mma")
    ap.add_argument("--workloads", nargs="*", default=DEFAULT_WORKLOADS)
    ap.add_argument("--dtype", default="fp16", choices=sorted(TORCH_DTYPE))
    ap.add_argument("--params", action="append", default=[], help="JSON of one parameter set")
    ap.add_argument("--points", type=Path,
                    help='JSON {"workloads": {"B,H,S,D[,causal]": [params, ...]}}: per workload')
    ap.add_argument("--sweep", type=int, default=0, help="also time N random admitted points")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all-rows", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / f"{args.family}.toml")
    rng = random.Random(args.seed)
    rows = []
    for text in args.workloads:
        w = Workload.parse_spec(text, dtype=args.dtype)
        problem = w.problem()
        points = [json.loads(p) for p in args.params]
        if args.points:
            points += json.loads(args.points.read_text())["workloads"].get(text, [])
        points = [p for p in points if not space.violations(p, problem, arch)]
        admitted = space.admitted(problem, arch)
        points += rng.sample(admitted, min(args.sweep, len(admitted)))
        cands = [make_candidate(space, p, problem, arch) for p in points]
        sets = measure.workload_inputs(w)
        graph = measure.graph_for(w)
        flash = measure.time_sdpa(w, sets, "flash", graph=graph)
        cudnn = measure.time_sdpa(w, sets, "cudnn", graph=graph)
        print(f"{w.key()}: flash {flash and round(flash.median_us, 1)} us, "
              f"cudnn {cudnn and round(cudnn.median_us, 1)} us, {len(cands)} candidates")
        results = []
        for cand, compiled in zip(cands, compile_many(cands, arch), strict=True):
            if not compiled.ok:
                print(f"  compile error {cand.identity}: {compiled.error}")
                continue
            kernel = Kernel(cand, compiled)
            verdict = validate.check(kernel, batch=1, heads=4, kv_heads=4 * w.kv_heads // w.heads,
                                     seq_q=333, seq_k=333 + w.seq_k - w.seq_q, head_dim=w.head_dim,
                                     causal=w.causal, dtype=TORCH_DTYPE[w.dtype])
            if not verdict.ok:
                print(f"  INVALID {cand.identity}: {verdict.reason}")
                continue
            t = time_kernel(kernel, w, sets)
            results.append((t, cand, compiled))
        results.sort(key=lambda r: r[0].median_us)
        for t, cand, compiled in results if args.all_rows else results[:1]:
            rows.append({
                "family": cand.family, "shape": [w.batch, w.heads, w.seq_q, w.head_dim],
                "kv_heads": w.kv_heads, "seq_k": w.seq_k, "causal": w.causal, "dtype": w.dtype,
                "ours_us": t.median_us, "ours_spread_us": t.spread_us, "graph": t.graph,
                "sdpa_flash_us": flash.median_us if flash else None,
                "sdpa_cudnn_us": cudnn.median_us if cudnn else None,
                "tflops": w.flops() / t.median_us / 1e6, "params": cand.params,
                "registers": compiled.registers, "spill_bytes": compiled.spill_bytes,
            })
        for t, cand, compiled in results[:5]:
            print(f"  {t.median_us:9.1f} us  {w.flops() / t.median_us / 1e6:6.1f} TFLOPS  "
                  f"x{(flash.median_us / t.median_us) if flash else float('nan'):.2f} flash  "
                  f"regs {compiled.registers} spill {compiled.spill_bytes}  {cand.params}")
    doc = header(**local_device(), method=f"each candidate: the criterion at 1x4x333, then "
                 f"{measure.METHOD}; SDPA flash and cuDNN timed the same way in the same process",
                 rows=rows)
    print(f"\n{'workload':42} {'ours us':>9} {'flash us':>9} {'cudnn us':>9} {'TFLOPS':>7} "
          f"{'vs flash':>8} {'vs cudnn':>8}")
    for r in rows:
        key = f"{r['shape']} kv{r['kv_heads']} sk{r['seq_k']} {'causal' if r['causal'] else 'full'}"
        fl, cu = r["sdpa_flash_us"], r["sdpa_cudnn_us"]
        print(f"{key:42} {r['ours_us']:9.1f} {fl or 0:9.1f} {cu or 0:9.1f} {r['tflops']:7.1f} "
              f"{(fl or 0) / r['ours_us']:8.2f} {(cu or 0) / r['ours_us']:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
