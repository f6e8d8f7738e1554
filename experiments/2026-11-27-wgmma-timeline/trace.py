"""Where a wgmma forward block's cycles go: one traced launch per point, warpgroup by warpgroup.

The wgmma template is rendered as it is, then marks are written into the source text (not the
template) around each key block of the intra-warpgroup-overlap loop. Lane 0 of warp 0 of each
consumer warpgroup of the first BLOCKS blocks stores %clock64 (SM cycles) with a code:
  1 the block starts          8 its K and V have landed    2 its turn: the GEMMs issue
  3 S_j and P_{j-1} V_{j-1} issued, turn passed            4 S_j done
  5 softmax of S_j done       6 P_{j-1} V_{j-1} done       7 P_j written (the block ends)
With --tiles, also a tile's edges: 15 the last S done (Q handed back), 9 the last P.V done,
16 the epilogue's barrier passed, 17 O staged, 10 O stored, 11 the next tile's loop top, 12 its
Q landed, 13 its first S done, 14 its first P written (tile_phases).

    python experiments/2026-11-27-wgmma-timeline/trace.py --out $OUT/timeline.json \
        --points experiments/2026-11-27-wgmma-timeline/points.json

Prints per point the median cycles of each phase per key block and the cycles per key block
of each warpgroup, next to the ideal of the tensor pipe (the block's GEMM FLOPs at 4096 dense
FLOPs a cycle an SM) and of the MUFU (its exponentials at 16 a cycle an SM).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCKS = 4
MAXEV = 16384
CODES = {1: "start", 8: "data", 2: "turn", 3: "issued", 4: "s_done", 5: "softmax",
         6: "pv_done", 7: "end"}

PRELUDE = f"""
__device__ unsigned long long evo_trace[{BLOCKS * 3 * MAXEV}];
#define EVO_MARK(code) do {{ if (evo_on && evo_k < {MAXEV}) {{ \\
    evo_trace[(blockIdx.x * 3 + cw) * {MAXEV} + evo_k++] = (clock64() << 5) | (code); \\
  }} }} while (0)
"""

# 943e50f's PV_WAIT (measured and reverted) put this line after the softmax; its tree's
# sources have it, today's do not.
PIN = "          if constexpr (PV_PINNED) rows::pin(st, bars.pin_slot());\n"


# (anchor in the rendered source, what replaces it); each anchor must be there once.
PATCHES = [
    ("  const Consumer me = Consumer::at(cw, base, bars, seq_q, seq_k, scale_log2);\n",
     "  const Consumer me = Consumer::at(cw, base, bars, seq_q, seq_k, scale_log2);\n"
     "  int evo_k = 0;\n"
     f"  const bool evo_on = blockIdx.x < {BLOCKS} && me.warp == 0 && me.lane == 0;\n"),
    ("        auto block = [&](int j, auto masked) {\n"
     "          mbar::wait(bars.k_full(k_ring.slot), k_ring.phase);\n"
     "          mbar::wait(bars.v_full(v_ring.slot), v_ring.phase);\n"
     "          wg::issue_in_turn(f, cw, [&] {\n"
     "            wg::issue_s(f, me.q_tile, me.k_tile(k_ring.slot));\n"
     "            wg::issue_pv(f, me.p_tile, me.v_tile(v_ring.slot));\n"
     "          });\n"
     "          wg::s_done<1>(f, me, k_ring.slot);  // P_{j-1} V_{j-1} may still run\n"
     "          k_ring.advance();\n"
     "          softmax(j, alpha, masked);\n"
     + PIN +
     "          wg::pv_done<true>(f, me, v_ring.slot);\n"
     "          v_ring.advance();\n"
     "          rows::rescale(f.o, alpha);\n"
     "          wg::write_p(f, me);\n"
     "        };\n",
     "        auto block = [&](int j, auto masked) {\n"
     "          EVO_MARK(1);\n"
     "          mbar::wait(bars.k_full(k_ring.slot), k_ring.phase);\n"
     "          mbar::wait(bars.v_full(v_ring.slot), v_ring.phase);\n"
     "          EVO_MARK(8);\n"
     "          wg::issue_in_turn(f, cw, [&] {\n"
     "            EVO_MARK(2);\n"
     "            wg::issue_s(f, me.q_tile, me.k_tile(k_ring.slot));\n"
     "            wg::issue_pv(f, me.p_tile, me.v_tile(v_ring.slot));\n"
     "          });\n"
     "          EVO_MARK(3);\n"
     "          wg::s_done<1>(f, me, k_ring.slot);  // P_{j-1} V_{j-1} may still run\n"
     "          EVO_MARK(4);\n"
     "          k_ring.advance();\n"
     "          softmax(j, alpha, masked);\n"
     + PIN +
     "          EVO_MARK(5);\n"
     "          wg::pv_done<true>(f, me, v_ring.slot);\n"
     "          EVO_MARK(6);\n"
     "          v_ring.advance();\n"
     "          rows::rescale(f.o, alpha);\n"
     "          wg::write_p(f, me);\n"
     "          EVO_MARK(7);\n"
     "        };\n"),
]


# With --tiles: marks around a tile's edges too (codes 9-15), the key-block marks as above.
Q_BACK = ("        if constexpr (Q_EARLY) warp::release(bars.q_empty(), me.lane);  // the S GEMMs"
          " are done with Q\n")
O_SYNC = ("    if constexpr (O_OWN) {\n      __syncwarp();  // the warp's reads of its rows are"
          " done before the next tile's writes\n")
S0 = "        wg::s_done<0>(f, me, k_ring.slot);\n"
TILE_PATCHES = [
    ("    int sq = seq_q, sk = seq_k;\n",
     "    EVO_MARK(11);\n    int sq = seq_q, sk = seq_k;\n"),
    ("    if (n_full > 0 || blocks.n_mine() > 0) {\n      float alpha[2];\n",
     "    if (n_full > 0 || blocks.n_mine() > 0) {\n      float alpha[2];\n      EVO_MARK(12);\n"),
    (S0 + "        k_ring.advance();\n",
     S0 + "        EVO_MARK(13);\n        k_ring.advance();\n"),
    ("        wg::write_p(f, me);\n        auto block = [&](int j, auto masked) {\n",
     "        wg::write_p(f, me);\n        EVO_MARK(14);\n"
     "        auto block = [&](int j, auto masked) {\n"),
    (Q_BACK, Q_BACK + "        EVO_MARK(15);\n"),
    ("        wg::pv_done<false>(f, me, v_ring.slot);\n        v_ring.advance();\n"
     "        ring = v_ring;\n",
     "        wg::pv_done<false>(f, me, v_ring.slot);\n        EVO_MARK(9);\n"
     "        v_ring.advance();\n        ring = v_ring;\n"),
    (O_SYNC, "    EVO_MARK(10);\n" + O_SYNC),
    ("    u32 o_tile = O_OWN ? base", "    EVO_MARK(16);\n    u32 o_tile = O_OWN ? base"),
    ("    __syncwarp();\n    warp::store_o(",
     "    EVO_MARK(17);\n    __syncwarp();\n    warp::store_o("),
]
TILE_CODES = {11: "tile", 12: "q_ready", 13: "s0_done", 14: "p0_written", 15: "last_s_done",
              9: "last_pv_done", 16: "o_synced", 17: "o_staged", 10: "o_stored"}


def tile_phases(events: list[tuple[int, int]]) -> dict[str, float]:
    """Median cycles of a tile's edges: from the last key block's end (7) through the last
    P.V (15, 9), the epilogue (its barrier 16, O staged 17, O stored 10), the next tile's start
    (11), its Q (12), its first S (13) and first P (14), to its second key block (1)."""
    order = [7, 15, 9, 16, 17, 10, 11, 12, 13, 14, 1]
    names = ["to_last_pv", "last_pv", "o_sync", "o_stage", "o_store", "loop_top", "q_wait", "s0",
             "softmax0_p0", "to_block1"]
    out: dict[str, list[int]] = {n: [] for n in names}
    codes = [c for _, c in events]
    for i in range(len(events) - len(order) + 1):
        if codes[i:i + len(order)] == order:
            w = events[i:i + len(order)]
            for n, (a, b) in zip(names, zip(w, w[1:], strict=False), strict=True):
                out[n].append(b[0] - a[0])
    return {n: statistics.median(v) for n, v in out.items() if v}


def traced_source(source: str, tiles: bool = False) -> str:
    if tiles:
        for anchor, text in TILE_PATCHES:
            if source.count(anchor) != 1:
                raise SystemExit(f"trace: the template changed: {anchor.splitlines()[0]!r}...")
            source = source.replace(anchor, text)
    for anchor, text in PATCHES:
        if PIN not in source:
            anchor, text = anchor.replace(PIN, ""), text.replace(PIN, "")
        if source.count(anchor) != 1:
            raise SystemExit(f"trace: the template changed: {anchor.splitlines()[0]!r}...")
        source = source.replace(anchor, text)
    first = source.index("namespace wg {")  # after cfg and the includes, before consume
    return source[:first] + PRELUDE + source[first:]


def phases(events: list[tuple[int, int]]) -> dict[str, list[float]]:
    """Per key block (a run 1, 8, 2, 3, 4, 5, 6, 7): the cycles between consecutive marks,
    and from one block's start to the next one's (its period)."""
    out: dict[str, list[float]] = {k: [] for k in
                                   ("data", "turn", "issue", "s_wait", "softmax", "pv_wait",
                                    "write_p", "period")}
    order = [1, 8, 2, 3, 4, 5, 6, 7]
    names = ["data", "turn", "issue", "s_wait", "softmax", "pv_wait", "write_p"]
    starts = []
    i = 0
    while i + len(order) <= len(events):
        window = events[i:i + len(order)]
        if [c for _, c in window] != order:
            i += 1
            continue
        for n, (a, b) in zip(names, zip(window, window[1:], strict=False), strict=True):
            out[n].append(b[0] - a[0])
        starts.append(window[0][0])
        i += len(order)
    out["period"] = [b - a for a, b in zip(starts, starts[1:], strict=False) if 0 < b - a < 20000]
    return out


def main() -> int:
    import cupy
    import torch

    from evoengine import measure
    from evoengine.arch import arch_of_capability
    from evoengine.compile import compile_source
    from evoengine.render import render
    from evoengine.runtime import Kernel
    from evoengine.search.domain import Domain
    from evoengine.space import default_spaces
    from evoengine.workload import Workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", required=True,
                    help="JSON list of {workload: 'B,H,S,D[,causal]', dtype, params}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", action="store_true", help="mark the tiles' edges too")
    args = ap.parse_args()
    arch = arch_of_capability(*torch.cuda.get_device_capability())
    rows = []
    for entry in json.loads(Path(args.points).read_text()):
        w = Workload.parse_spec(entry["workload"], dtype=entry["dtype"])
        sets = measure.workload_inputs(w)
        spaces = [sp.with_untested() for sp in default_spaces()]
        wgmma = next(sp for sp in spaces if sp.family == "wgmma")
        cand = Domain(spaces, w, arch).candidate("wgmma", wgmma.complete(entry["params"]))
        compiled = compile_source(traced_source(render(cand), args.tiles), arch,
                                  cand.defines(arch),
                                  identity=f"{cand.identity}@trace", smem_bytes=cand.smem_bytes)
        if not compiled.ok:
            raise SystemExit(f"trace: {cand.identity}: {compiled.error}")
        kernel = Kernel(cand, compiled)
        call = measure.kernel_call(kernel, sets, 1.0 / math.sqrt(w.head_dim))
        for i in range(3 * len(sets)):
            call(i % len(sets))
        torch.cuda.synchronize()
        module = kernel.load(torch.cuda.current_device()).owner[0]
        ptr = module.get_global_var("evo_trace")
        mem = cupy.cuda.UnownedMemory(ptr, BLOCKS * 3 * MAXEV * 8, module)
        buf = cupy.ndarray((BLOCKS * 3, MAXEV), dtype=cupy.uint64,
                           memptr=cupy.cuda.MemoryPointer(mem, 0))
        buf[:] = 0
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call(0)
        end.record()
        torch.cuda.synchronize()
        data = buf.get()
        p = entry["params"]
        bm, bn, d = p["BLOCK_M"], p["BLOCK_N"], w.head_dim
        consumers = bm // 64
        # One key block of one warpgroup: 2 GEMMs of 64 x BLOCK_N x D; 64 x BLOCK_N exps.
        tensor_ideal = 2 * 2 * 64 * bn * d / 4096
        mufu_ideal = 64 * bn / 16
        per_wg = []
        for slot in range(BLOCKS * 3):
            if slot % 3 >= consumers:
                continue
            events = [(int(x) >> 5, int(x) & 31) for x in data[slot] if x]
            ph = phases([e for e in events if e[1] in CODES])
            edges = tile_phases(events) if args.tiles else {}
            med = {k: (statistics.median(v) if v else None) for k, v in ph.items()}
            per_wg.append(dict(block=slot // 3, wg=slot % 3, blocks=len(ph["period"]) + 1,
                               median=med, tile_edges=edges, raw=events[:400]))
        summary = {k: statistics.median([r["median"][k] for r in per_wg if r["median"][k]])
                   for k in per_wg[0]["median"]}
        row = dict(workload=entry["workload"], dtype=entry["dtype"], params=p,
                   launch_ms=start.elapsed_time(end), tensor_ideal_per_wg=tensor_ideal,
                   mufu_ideal_per_wg=mufu_ideal, consumers=consumers, median=summary,
                   warpgroups=per_wg)
        if args.tiles:
            keys = {k for r in per_wg for k in r["tile_edges"]}
            row["tile_edges"] = {k: statistics.median([r["tile_edges"][k] for r in per_wg
                                                       if k in r["tile_edges"]]) for k in keys}
            print("  tile edges (cycles): " + ", ".join(
                f"{k} {row['tile_edges'][k]:.0f}" for k in
                ("to_last_pv", "last_pv", "o_sync", "o_stage", "o_store", "loop_top", "q_wait",
                 "s0", "softmax0_p0", "to_block1") if k in row["tile_edges"]), flush=True)
        rows.append(row)
        print(f"{entry['workload']} {entry['dtype']} {bm}x{bn} P_{p['P_FROM']}: "
              f"launch {row['launch_ms'] * 1e3:.0f} us; per key block (cycles, median over "
              f"warpgroups): " + ", ".join(f"{k} {v:.0f}" for k, v in summary.items())
              + f"; ideal period {consumers * tensor_ideal:.0f} tensor, "
              f"{consumers * mufu_ideal:.0f} MUFU", flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
