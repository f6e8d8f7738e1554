"""Where the transposed dQ loses: each of the backward's three kernels (pre, main, post) timed
alone for the d128 TMA point of the backward table (64 rows, dQ = dS K), its transposed twin
(64 rows, dQ^T; no longer admitted by the space, so built from it without that constraint)
and the 80-row transposed point, bf16 without a mask at 8,16,4096 and 2,32,8192.

    python experiments/2026-11-27-bwd-dq-transposed/kernel_split.py  # writes $OUT/kernel_split.json

For a profiler, one point on the first shape, no torch.profiler (the point's name as below):

    ncu --clock-control none -k regex:'attn_bwd$' -s 3 -c 1 --set full --import-source yes \
        -o $OUT/dqt64 python experiments/2026-11-27-bwd-dq-transposed/kernel_split.py \
        --point "64 rows, dQ^T" --calls 5

torch.profiler's CUDA kernel durations, the mean of 20 calls after 3 untimed ones, the same
inputs each call (no L2 rotation: each call moves > 1 GB); out and lse from SDPA's flash
forward. A diagnostic, not a comparison with the anchors."""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import torch

from evoengine import paths
from evoengine.arch import get_arch
from evoengine.backward import BackwardKernel
from evoengine.compile import compile_many
from evoengine.render import make_candidate
from evoengine.space import SearchSpace

RULE = 'rule = "DQ_TRANSPOSED == (BLOCK_M % 64 != 0)"'


def space_without_the_rows_rule() -> SearchSpace:
    text = (paths.SPACES / "wgmma_bwd.toml").read_text()
    head, rest = text.split(RULE)
    head = head[:head.rindex("[[constraints]]")]
    rest = rest[rest.index("\n[") + 1:]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(head + rest)
    return SearchSpace.load(f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", help="run only this point, --calls times, on the first shape")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    sp, arch = space_without_the_rows_rule(), get_arch("sm_90a")
    base = dict(BLOCK_M=64, BLOCK_N=128, DQ_ACCUM="atomic", DQ_BUFFERS=1, DQ_LAYOUT="fragment",
                DQ_REDUCE="bulk", DQ_WRITER="consumer", LOADER="tma", REFILL="top",
                ROWS_EARLY=False, STAGES=1, SWIZZLE=128)
    points = {"64 rows, dQ = dS K": {**base, "DQ_TRANSPOSED": False},
              "64 rows, dQ^T": {**base, "DQ_TRANSPOSED": True},
              "80 rows, dQ^T": {**base, "BLOCK_M": 80, "DQ_TRANSPOSED": True}}
    if args.point is not None:
        if args.point not in points:
            raise SystemExit(f"--point must be one of {', '.join(map(repr, points))}")
        points = {args.point: points[args.point]}
    problem = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=False)
    cands = {k: make_candidate(sp, sp.complete(p), problem, arch) for k, p in points.items()}
    kernels = {k: BackwardKernel(c, r)
               for (k, c), r in zip(cands.items(), compile_many(list(cands.values()), arch),
                                   strict=True)}
    rows = []
    for b, h, s, d in ((8, 16, 4096, 128), (2, 32, 8192, 128)):
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
        if args.point is not None:
            for _ in range(args.calls):
                kernels[args.point](q, k, v, o, lse, do, causal=False)
            torch.cuda.synchronize()
            return
        for name, kernel in kernels.items():
            for _ in range(3):
                kernel(q, k, v, o, lse, do, causal=False)
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(20):
                    kernel(q, k, v, o, lse, do, causal=False)
                torch.cuda.synchronize()
            total: dict[str, float] = collections.defaultdict(float)
            count: collections.Counter[str] = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    total[e.name] += e.device_time_total
                    count[e.name] += 1
            us = {kn: round(total[kn] / count[kn], 1) for kn in total}
            rows.append({"shape": [b, h, s, d], "dtype": "bf16", "causal": False, "point": name,
                         "params": points[name], "kernel_us": us})
            print(f"{b},{h},{s},{d} {name:20s} " + "  ".join(f"{kn} {t:.1f}"
                                                          for kn, t in sorted(us.items())))
    out = os.path.join(os.environ.get("OUT", "."), "kernel_split.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
