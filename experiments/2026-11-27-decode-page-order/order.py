"""Where do paged decode's 2-4% go? The same points timed on one cache with three block tables.

    python experiments/2026-11-27-decode-page-order/order.py --out order.json

Per row (q_len 1, GQA 32/8, d128, fp16, pages of 64): the paged points of
benchmarks/results/2026-11-25-h100-decode-fused.json, each through the decode criterion, then
timed over the same K/V pages with the block table
- ``shuffled``: the pages dealt in a random order (the benchmark's and the criterion's table);
- ``sorted``: each sequence's pages in ascending address order (same pages);
- ``identity``: sequence b owns pages b*P .. b*P+P-1 in order, i.e. a contiguous cache;
- ``chunks`` (``--tables``): identity's pages moved as runs of 16 (2 MB of K or V at d128, 8
  KV heads, pages of 64), the runs dealt in a random order: each 2 MB read in order;
- ``local``: identity's pages dealt in a random order inside each run of 16: the sequence
  stays in its 2 MB regions, the order within them is random;
and the same points built for a contiguous cache, with SDPA cuDNN and flash on that cache,
interleaved over ``--rounds``. If ``identity`` matches the contiguous build, the kernel's
page arithmetic costs nothing and the gap is the shuffle (address translation or DRAM).
If ``chunks`` matches identity and ``local`` the shuffle, the order inside 2 MB costs (DRAM);
the other way round, the number of 2 MB regions a sequence crosses (translation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

POINTS = [dict(BLOCK_N=bn, BLOCK_M=16, NUM_WARPS=nw, STAGES=st, VEC_BYTES=16, L2_PREFETCH=0,
               MERGE="slices", SPLIT_POLICY="waves", SPLITS=1, COMBINE="fused")
          for bn, nw, st in ((64, 4, 4), (128, 4, 3), (128, 8, 2), (64, 4, 3))]
ROWS = [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 4096), (64, 32768)]


def main() -> None:
    import torch

    from evoengine import measure, paths
    from evoengine.arch import arch_of_capability
    from evoengine.decode import DecodeKernel
    from evoengine.problems.decode import Decode, DecodeWorkload, time_sdpa_decode
    from evoengine.provenance import header, local_device
    from evoengine.render import make_candidate
    from evoengine.space import SearchSpace

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="*", default=list(range(len(ROWS))),
                    help="indices into ROWS")
    ap.add_argument("--points", type=int, nargs="*", default=list(range(len(POINTS))),
                    help="indices into POINTS")
    ap.add_argument("--tables", default="shuffled,sorted,identity",
                    help="of shuffled, sorted, identity, chunks, local")
    args = ap.parse_args()
    arch = arch_of_capability(*torch.cuda.get_device_capability())
    space = SearchSpace.load(paths.SPACES / "decode.toml")
    problem = Decode()
    rows = []
    modes = args.tables.split(",")
    for batch, cache in [ROWS[i] for i in args.rows]:
        paged = DecodeWorkload(batch=batch, q_len=1, q_heads=32, kv_heads=8, head_dim=128,
                               cache_len=cache, layout="paged", page_size=64, dtype="fp16")
        contig = DecodeWorkload(batch=batch, q_len=1, q_heads=32, kv_heads=8, head_dim=128,
                                cache_len=cache, layout="contiguous", page_size=0,
                                dtype="fp16")
        kp, kc = [], []
        for p in [POINTS[i] for i in args.points]:
            for w, out in ((paged, kp), (contig, kc)):
                p2 = space.complete(p)
                k = DecodeKernel.build(make_candidate(space, p2, w.problem(), arch), arch)
                verdict = problem.check(k, w)
                if not verdict.ok:
                    print("refused", k.name, verdict.reason, flush=True)
                    continue
                out.append(k)
        sets = problem.inputs(paged)
        per_seq = cache // 64
        tables = {"shuffled": [s[4] for s in sets]}
        tables["sorted"] = [torch.sort(s[4], dim=1).values.contiguous() for s in sets]
        ident = torch.arange(batch * per_seq, device="cuda", dtype=torch.int32)
        tables["identity"] = [ident.reshape(batch, per_seq).contiguous() for _ in sets]
        gen = torch.Generator(device="cpu").manual_seed(0)
        run = 16
        n = batch * per_seq
        assert n % run == 0
        runs = torch.randperm(n // run, generator=gen)
        chunks = (runs[:, None] * run + torch.arange(run)).reshape(-1)
        local = torch.cat([r * run + torch.randperm(run, generator=gen)
                           for r in range(n // run)])
        tables["chunks"] = [chunks.to("cuda", torch.int32).reshape(batch, per_seq)
                            .contiguous() for _ in sets]
        tables["local"] = [local.to("cuda", torch.int32).reshape(batch, per_seq).contiguous()
                           for _ in sets]
        tables = {m: tables[m] for m in modes}
        csets = problem.inputs(contig)
        t: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for k in kp:
                for name, tabs in tables.items():
                    s2 = [(*s[:4], tabs[i], s[5]) for i, s in enumerate(sets)]
                    us = measure.time_calls(problem.timed_call(k, paged, s2), len(s2)).median_us
                    t.setdefault(f"{name} {k.name}", []).append(us)
            for k in kc:
                us = measure.time_calls(problem.timed_call(k, contig, csets),
                                        len(csets)).median_us
                t.setdefault(f"contiguous {k.name}", []).append(us)
            for a in ("cudnn", "flash"):
                r = time_sdpa_decode(a, contig, csets)
                if r is not None:
                    t.setdefault(f"sdpa_{a}", []).append(r.median_us)
        med = {k: statistics.median(v) for k, v in t.items()}
        best = {mode: min(v for k, v in med.items() if k.startswith(mode + " "))
                for mode in (*modes, "contiguous")}
        anchor = min(v for k, v in med.items() if k.startswith("sdpa_"))
        row = dict(batch=batch, cache_len=cache, best_us=best, best_anchor_us=anchor,
                   vs_anchor={m: anchor / v for m, v in best.items()}, points_us=med)
        rows.append(row)
        print(f"{batch:3d} {cache:7d} " + " ".join(f"{m} {v:8.1f}" for m, v in best.items())
              + f" anchor {anchor:8.1f} " + " ".join(f"{m} {anchor / v:.3f}"
                                                    for m, v in best.items()), flush=True)
        del sets, csets, tables
        torch.cuda.empty_cache()
        doc = header(**local_device(),
                     method=f"{measure.METHOD}; {args.rounds} rounds interleaved, median of "
                            "the rounds' medians; the same K/V pages under three tables",
                     summary=f"{len(rows)} rows", rows=rows)
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
