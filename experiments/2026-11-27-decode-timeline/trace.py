"""Where a decode launch's time goes: one traced launch per point, block by block.

The decode template is rendered as it is, then marks are written into the source text (not
the template) at five places of every block: entry (0), its first tile landed (1), the key
loop done (2), its part or output written (3), the fused combine done or skipped (4). Thread
0 of each block stores %globaltimer (ns, comparable across SMs) and its SM's id in a
__device__ array that this script reads back after the launch.

    python experiments/2026-11-27-decode-timeline/trace.py --out $OUT/timeline.json \
        decode-b1-q4-h64-kv8-d128-c32768-contig-bf16 ... --points points.json

Prints per point: the launch's span, when blocks start, the first tile's latency, when
the key loops end (first, median, last), the merge and write-out, and the combine's tail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MARKS = 5
SLOTS = 8  # per block: globaltimer at MARKS marks, smid, the fused combine's "last" flag
MAX_BLOCKS = 8192

PRELUDE = f"""
__device__ unsigned long long evo_trace[{MAX_BLOCKS * SLOTS}];
__device__ __forceinline__ unsigned long long evo_now() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
__device__ __forceinline__ void evo_mark(int i) {{
  if (threadIdx.x != 0) return;
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (b >= {MAX_BLOCKS}) return;
  evo_trace[b * {SLOTS} + i] = evo_now();
  if (i == 0) {{
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    evo_trace[b * {SLOTS} + {MARKS}] = s;
  }}
}}
"""

# (anchor in the rendered source, text put after it)
PATCHES = [
    ("const int cache_len = seqlens[batch];\n", "  evo_mark(0);\n"),
    ("__syncthreads();              // every warp is done with tile t - 1, whose slot is "
     "refilled\n", "    if (t == 0) evo_mark(1);\n"),
    ("__syncthreads();  // the ring is free: the merge takes it\n", "  evo_mark(2);\n"),
]
# Before the slices merge's combine call (the searched merge), and after it.
COMBINE_CALL = ("    if constexpr (COMBINE_COOP) combine_together();\n"
                "    if constexpr (COMBINE_FUSED) combine_if_last();\n    return;\n  }\n")
COMBINE_TRACED = ("    evo_mark(3);\n    if constexpr (COMBINE_COOP) combine_together();\n"
                  "    if constexpr (COMBINE_FUSED) combine_if_last();\n"
                  "    evo_mark(4);\n    return;\n  }\n")


def traced_source(source: str) -> str:
    for anchor, text in PATCHES:
        if source.count(anchor) != 1:
            raise SystemExit(f"trace: the template changed: {anchor.strip()!r} is not there once")
        source = source.replace(anchor, anchor + text)
    if source.count(COMBINE_CALL) != 1:
        raise SystemExit("trace: the template changed: the slices merge's combine call")
    source = source.replace(COMBINE_CALL, COMBINE_TRACED)
    first = source.index('extern "C"')  # after the includes and cfg, before the kernels
    return source[:first] + PRELUDE + source[first:]


def summarise(trace: list[list[int]]) -> dict[str, Any]:
    t0 = min(b[0] for b in trace)
    us = lambda ns: ns / 1e3  # noqa: E731
    starts = [us(b[0] - t0) for b in trace]
    first = [us(b[1] - b[0]) for b in trace if b[1]]
    loop = [us(b[2] - t0) for b in trace]
    merge = [us(b[3] - b[2]) for b in trace]
    combine = sorted(us(b[4] - b[3]) for b in trace)
    end = [us(b[4] - t0) for b in trace]
    return dict(
        blocks=len(trace), sms=len({b[MARKS] for b in trace}),
        span_us=max(end), start_last_us=max(starts),
        first_tile_us=[min(first), statistics.median(first), max(first)],
        loop_end_us=[min(loop), statistics.median(loop), max(loop)],
        merge_write_us=statistics.median(merge),
        combine_top_us=combine[-8:], end_median_us=statistics.median(end),
        ends_after_last_loop_us=max(end) - max(loop))


def main() -> int:
    import torch

    from evoengine import paths
    from evoengine.compile import compile_source
    from evoengine.decode import DecodeKernel
    from evoengine.problems.decode import Decode, DecodeWorkload
    from evoengine.render import make_candidate, render
    from evoengine.runtime import gpu_arch
    from evoengine.space import SearchSpace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", metavar="KEY")
    ap.add_argument("--points", required=True, help="JSON list of decode parameter dicts")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()
    problem = Decode()
    rows = []
    for key in args.workloads:
        w = DecodeWorkload.from_key(key)
        sets = problem.inputs(w)
        for params in json.loads(Path(args.points).read_text()):
            params = space.complete(params)
            cand = make_candidate(space, params, w.problem(), arch)
            compiled = compile_source(traced_source(render(cand)), arch, cand.defines(arch),
                                      identity=f"{cand.identity}@trace",
                                      smem_bytes=cand.smem_bytes)
            if not compiled.ok:
                raise SystemExit(f"trace: {cand.identity}: {compiled.error}")
            kernel = DecodeKernel(cand, compiled)
            call = problem.timed_call(kernel, w, sets)
            for i in range(3 * len(sets)):  # warm
                call(i % len(sets))
            torch.cuda.synchronize()
            module = kernel.main.load(torch.cuda.current_device()).owner[0]  # (module, function)
            import cupy

            ptr = module.get_global_var("evo_trace")  # a device address
            mem = cupy.cuda.UnownedMemory(ptr, MAX_BLOCKS * SLOTS * 8, module)
            buf = cupy.ndarray((MAX_BLOCKS, SLOTS), dtype=cupy.uint64,
                               memptr=cupy.cuda.MemoryPointer(mem, 0))
            buf[:] = 0
            torch.cuda.synchronize()
            call(0)
            torch.cuda.synchronize()
            data = buf.get()
            trace = [[int(x) for x in row] for row in data if row[0]]
            s = summarise(trace)
            row = dict(workload=key, params=params, **s)
            rows.append(row)
            print(f"{key} BM{params['BLOCK_M']} BN{params['BLOCK_N']} W{params['NUM_WARPS']} "
                  f"S{params['STAGES']} {params['COMBINE']}/{params['COMBINE_ITEMS']}: "
                  f"{s['blocks']} blocks on {s['sms']} SMs, span {s['span_us']:.1f} us, last "
                  f"start {s['start_last_us']:.1f}, first tile {s['first_tile_us'][1]:.1f} "
                  f"(max {s['first_tile_us'][2]:.1f}), loops end {s['loop_end_us'][0]:.1f}/"
                  f"{s['loop_end_us'][1]:.1f}/{s['loop_end_us'][2]:.1f}, merge+write "
                  f"{s['merge_write_us']:.2f}, combine tail {s['combine_top_us'][-1]:.2f}, "
                  f"after last loop {s['ends_after_last_loop_us']:.2f}", flush=True)
            rows[-1]["blocks_trace"] = trace
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
