"""Time wgmma_bwd's new levers (DQ_REDUCE, REFILL) next to the searched points they modify and
SDPA's cuDNN backward (and FlashAttention-4's where it imports), interleaved in one process.

    python experiments/2026-11-24-bwd-levers/bwd_levers.py --json out.json [--rounds 3]

Per workload: the best searched point of the #16 searches (benchmarks/results/
2026-11-24-h100-backward-fp16-fa4.json) with its legacy levers, then each lever on its own
and both; every variant passes the backward criterion (validate.check_backward_workload)
before it is timed. Rounds time every contender once each, in turn; the row keeps the median
of the rounds' medians (evoengine.measure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from evoengine import measure, paths, validate  # noqa: E402
from evoengine.backward import BackwardKernel  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.problems.backward import Backward, BackwardWorkload  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

# The searched points (fp16 #16 searches): d128 and d64.
BASE = {
    128: dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic"),
    64: dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic"),
}
VARIANTS = {
    "legacy": dict(DQ_REDUCE="red", REFILL="top"),
    "refill-dq": dict(DQ_REDUCE="red", REFILL="dq"),
    "bulk": dict(DQ_REDUCE="bulk", REFILL="top"),
    "bulk+refill-dq": dict(DQ_REDUCE="bulk", REFILL="dq"),
}
WORKLOADS = ["8,16,4096,128", "8,16,4096,128,causal", "16,16,2048,64",
             "16,16,2048,64,causal", "2,32,8192,128"]


def workload(spec: str, dtype: str) -> BackwardWorkload:
    parts = spec.split(",")
    b, h, s, d = map(int, parts[:4])
    return BackwardWorkload.of(Workload(batch=b, heads=h, kv_heads=h, seq_q=s, seq_k=s,
                                        head_dim=d, causal="causal" in parts, dtype=dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=WORKLOADS)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--anchors", nargs="*", default=["cudnn", "fa4"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                    help="the first is the reference of the /legacy column")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / "wgmma_bwd.toml")
    problem = Backward()
    works = [workload(w, args.dtype) for w in args.workloads]
    cands = {}
    for w in works:
        prob = dict(HEAD_DIM=w.head_dim, DTYPE=w.dtype, CAUSAL=w.causal)
        for name in args.variants:
            lever = VARIANTS[name]
            cands[(w.key(), name)] = make_candidate(space, {**BASE[w.head_dim], **lever}, prob,
                                                    arch)
    unique = {c.identity: c for c in cands.values()}
    kernels = {}
    for c, res in zip(unique.values(), compile_many(list(unique.values()), arch), strict=True):
        assert res.ok and not res.spill_bytes, f"{c.identity}: {res.error} {res.spill_bytes}"
        k = BackwardKernel(c, res)
        k.load(torch.cuda.current_device())
        kernels[c.identity] = (k, res.registers)

    rows = []
    print(f"{'workload':34} {'contender':16} {'us':>9} {'TFLOPS':>7} {'/legacy':>8} {'/cudnn':>7}"
          f" {'/fa4':>6} regs")
    for w in works:
        names = list(args.variants)
        verdicts = {}
        for name in names:
            k, _ = kernels[cands[(w.key(), name)].identity]
            verdicts[name] = validate.check_backward_workload(k, w)
        sets = problem.inputs(w)
        medians: dict[str, list[float]] = {n: [] for n in [*names, *args.anchors]}
        for _ in range(args.rounds):
            for name in names:
                k, _ = kernels[cands[(w.key(), name)].identity]
                if verdicts[name].ok:
                    t = measure.time_calls(problem.timed_call(k, w, sets), len(sets), graph=False)
                    medians[name].append(t.median_us)
            for anchor in args.anchors:
                t = problem.time_anchor(anchor, w, sets)
                if t is not None:
                    medians[anchor].append(t.median_us)
        us = {n: statistics.median(v) for n, v in medians.items() if v}
        del sets
        torch.cuda.empty_cache()
        for n in [*names, *args.anchors]:
            if n not in us:
                why = verdicts[n].reason if n in verdicts else "n/a"
                print(f"{w.key():34} {n:16} {'-':>9}  ({why})")
                continue
            ratio = {a: f"{us[a] / us[n]:.3f}" if a in us else "-"
                     for a in (names[0], "cudnn", "fa4")}
            regs = kernels[cands[(w.key(), n)].identity][1] if n in verdicts else ""
            print(f"{w.key():34} {n:16} {us[n]:9.1f} {w.flops() / us[n] / 1e6:7.1f} "
                  f"{ratio[names[0]]:>8} {ratio['cudnn']:>7} {ratio['fa4']:>6} {regs}")
            row = dict(workload=w.key(), contender=n, median_us=us[n],
                       round_medians_us=medians[n], tflops=w.flops() / us[n] / 1e6)
            if n in verdicts:
                c = cands[(w.key(), n)]
                row.update(identity=c.identity, params=c.params, registers=regs,
                           criterion_ok=verdicts[n].ok,
                           criterion_err_over_tol=verdicts[n].max_err / verdicts[n].tolerance)
            rows.append(row)
    if args.json:
        doc = header(**local_device(), method=problem.method() + f"; {args.rounds} rounds",
                     about="wgmma_bwd levers DQ_REDUCE and REFILL against their legacy values")
        doc["rows"] = rows
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
