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
SLOTS = 8  # per block: globaltimer at MARKS marks, smid, then the cluster merge's two marks
CLUSTER_MARKS = (6, 7)  # (added 2026-11-29, eleventh session) before and after its first barrier
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


# The combine kernel (COMBINE "kernel"; added 2026-11-29): each block's thread 0 marks when its
# wait for the main kernel returned (a programmatic launch's griddepcontrol.wait; at once for
# a stream launch) and when it is done (thread 0's own return: every thread of a block walks the
# same splits), in row blockIdx.x of its own module's evo_trace (the two entries load the cubin
# as two modules).
PATCHES.append((
    "  if constexpr (COMBINE_PDL) wait_for_prerequisites();\n",
    f"  if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS}) "
    f"evo_trace[blockIdx.x * {SLOTS}] = evo_now();\n"
    f"  struct EvoDone {{ ~EvoDone() {{ if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS}) "
    f"evo_trace[blockIdx.x * {SLOTS} + 1] = evo_now(); }} }} evo_done;\n"))


# Where the block is in a cluster (CLUSTER > 1), marks 6 and 7 on either side of the cluster
# merge's first barrier: the block's write-out to its own shared memory done, and the barrier
# passed (both blocks' write-outs seen).
CLUSTER_SYNC = "    cluster_sync();  // every block's O and LSE are in its shared memory\n"


def traced_source(source: str) -> str:
    if source.count(CLUSTER_SYNC) == 1:
        source = source.replace(CLUSTER_SYNC, f"    evo_mark({CLUSTER_MARKS[0]});\n" + CLUSTER_SYNC
                                + f"    evo_mark({CLUSTER_MARKS[1]});\n")
    for anchor, text in PATCHES:
        if source.count(anchor) != 1:
            raise SystemExit(f"trace: the template changed: {anchor.strip()!r} is not there once")
        source = source.replace(anchor, anchor + text)
    if source.count(COMBINE_CALL) != 1:
        raise SystemExit("trace: the template changed: the slices merge's combine call")
    source = source.replace(COMBINE_CALL, COMBINE_TRACED)
    first = source.index('extern "C"')  # after the includes and cfg, before the kernels
    return source[:first] + PRELUDE + source[first:]


def trace_buffer(module: Any) -> Any:
    """A module's evo_trace as a cupy array of [MAX_BLOCKS, SLOTS] uint64."""
    import cupy

    ptr = module.get_global_var("evo_trace")  # a device address
    mem = cupy.cuda.UnownedMemory(ptr, MAX_BLOCKS * SLOTS * 8, module)
    return cupy.ndarray((MAX_BLOCKS, SLOTS), dtype=cupy.uint64,
                        memptr=cupy.cuda.MemoryPointer(mem, 0))


def traced_launch(kernel: Any, call: Any, n_sets: int, combine: bool) -> dict[str, Any]:
    """``call`` (a traced kernel's timed call) warmed over its ``n_sets`` inputs, then launched
    once with the trace buffers zeroed; ``summarise``'s dict, with the main kernel's blocks as
    ``blocks_trace``. ``combine``: the combine kernel's buffer too (COMBINE "kernel")."""
    import torch

    for i in range(3 * n_sets):  # warm
        call(i % n_sets)
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    bufs = [trace_buffer(kernel.main.load(device).owner[0])]
    if combine:
        bufs.append(trace_buffer(kernel.combine.load(device).owner[0]))
    for buf in bufs:
        buf[:] = 0
    torch.cuda.synchronize()
    call(0)
    torch.cuda.synchronize()
    trace = [[int(x) for x in row] for row in bufs[0].get() if row[0]]
    marks = [[int(x) for x in row[:2]] for row in bufs[1].get() if row[0]] if combine else []
    return dict(summarise(trace, marks), blocks_trace=trace)


def summarise(trace: list[list[int]], combine: list[list[int]] | None = None) -> dict[str, Any]:
    """The main kernel's blocks (``trace``) and the combine kernel's ([waited, done] a block)."""
    t0 = min(b[0] for b in trace)
    us = lambda ns: ns / 1e3  # noqa: E731
    starts = [us(b[0] - t0) for b in trace]
    first = [us(b[1] - b[0]) for b in trace if b[1]]
    loop = [us(b[2] - t0) for b in trace]
    merge = [us(b[3] - b[2]) for b in trace]
    tail = sorted(us(b[4] - b[3]) for b in trace)
    end = [us(b[4] - t0) for b in trace]
    # The cluster merge's steps (pairs of consecutive blocks: clusters run along x): the
    # write-out to shared memory, the first barrier from the later block's arrival, and the
    # merge from every block's shared memory to the mark after the last barrier.
    a, b = CLUSTER_MARKS
    cluster = {}
    if all(x[a] and x[b] for x in trace):
        pair = {i: trace[i ^ 1] for i in range(len(trace) - len(trace) % 2)}
        cluster = dict(
            write_smem_us=statistics.median(us(x[a] - x[2]) for x in trace),
            first_barrier_us=statistics.median(
                us(x[b] - max(x[a], pair[i][a])) for i, x in pair.items()),
            cluster_merge_us=statistics.median(us(x[3] - x[b]) for x in trace))
    waited = [us(c[0] - t0) for c in combine or []]
    done = [us(c[1] - t0) for c in combine or []]
    return dict(
        blocks=len(trace), sms=len({b[MARKS] for b in trace}),
        span_us=max(end), start_last_us=max(starts),
        first_tile_us=[min(first), statistics.median(first), max(first)],
        loop_end_us=[min(loop), statistics.median(loop), max(loop)],
        merge_write_us=statistics.median(merge),
        combine_top_us=tail[-8:], end_median_us=statistics.median(end),
        ends_after_last_loop_us=max(end) - max(loop), **cluster,
        **({} if not combine else dict(
            combine_blocks=len(combine),
            combine_waited_us=[min(waited), statistics.median(waited), max(waited)],
            combine_done_us=[min(done), statistics.median(done), max(done)],
            combine_ends_after_main_us=max(done) - max(end))))


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
            s = traced_launch(kernel, problem.timed_call(kernel, w, sets), len(sets),
                              combine=params["COMBINE"] == "kernel")
            row = dict(workload=key, params=params, **s)  # blocks_trace last
            rows.append(row)
            print(f"{key} BM{params['BLOCK_M']} BN{params['BLOCK_N']} W{params['NUM_WARPS']} "
                  f"S{params['STAGES']} {params['COMBINE']}/{params['COMBINE_ITEMS']}: "
                  f"{s['blocks']} blocks on {s['sms']} SMs, span {s['span_us']:.1f} us, last "
                  f"start {s['start_last_us']:.1f}, first tile {s['first_tile_us'][1]:.1f} "
                  f"(max {s['first_tile_us'][2]:.1f}), loops end {s['loop_end_us'][0]:.1f}/"
                  f"{s['loop_end_us'][1]:.1f}/{s['loop_end_us'][2]:.1f}, merge+write "
                  f"{s['merge_write_us']:.2f}, combine tail {s['combine_top_us'][-1]:.2f}, "
                  f"after last loop {s['ends_after_last_loop_us']:.2f}"
                  + (f"; cluster merge: write {s['write_smem_us']:.2f}, first barrier "
                     f"{s['first_barrier_us']:.2f}, merge {s['cluster_merge_us']:.2f}"
                     if "write_smem_us" in s else "")
                  + (f"; combine: {s['combine_blocks']} blocks, waits end "
                     f"{s['combine_waited_us'][0]:.1f}/{s['combine_waited_us'][2]:.1f}, done "
                     f"{s['combine_done_us'][2]:.1f} ({s['combine_ends_after_main_us']:.2f} after "
                     "the main kernel)" if "combine_blocks" in s else ""), flush=True)
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
