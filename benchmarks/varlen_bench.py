"""Ragged prefill: our VARLEN kernels next to SDPA on the padded batch and FlashAttention-4.

    python benchmarks/varlen_bench.py --json out.json            # issue #18's workload
    python benchmarks/varlen_bench.py --seqlens 128,4096,300 --heads 16 --head-dim 64
    python benchmarks/varlen_bench.py --kind varlen_bwd --points search.json --json out.json

``--kind varlen_bwd`` times the backward of the same ragged batch (its anchors: SDPA's
backward on the padded batch and FA4's varlen backward, by ``torch.autograd.grad``), its
candidates the rows of ``--points`` (a search's results JSON: each row's family and
parameters).

The workload (default: 16 sequences of random.Random(0) lengths in 128..4096, causal, GQA
32/8, d128, fp16) is a ``varlen`` problem (evoengine/problems/varlen.py). The candidates are
the forward's d128 causal re-time points (benchmarks/wgmma_retime_points.json, SCHEDULER
expanded) on sm_90a, or the mma family's points below elsewhere, each compiled with VARLEN.
Every candidate goes through the search's own GPU worker (``GpuWorker``, in this process): the
criterion (``validate.check_varlen_workload``), then a timing; the ``--keep`` fastest are
re-timed ``--rounds`` rounds interleaved with the problem's anchors: SDPA cuDNN and flash on
the batch padded to its longest sequence and FA4's ``flash_attn_varlen_func`` where it
imports. The row holds the best, with same-run ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine.compile import compile_many  # noqa: E402
from evoengine.problems.varlen import VarlenWorkload, parse_seqlens  # noqa: E402
from evoengine.problems.varlen_bwd import VarlenBackwardWorkload  # noqa: E402
from evoengine.provenance import header  # noqa: E402
from evoengine.search.domain import Domain  # noqa: E402
from evoengine.space import default_spaces  # noqa: E402

HERE = Path(__file__).resolve().parent
RETIME_POINTS = HERE / "wgmma_retime_points.json"
# The re-time workloads whose points are candidates, by head dim (their causal ones first:
# ragged prefill is causal in the workload; the points of the full ones follow).
RETIME_WORKLOADS = {64: ("16,16,2048,64,causal", "16,16,2048,64"),
                    128: ("8,16,4096,128,causal", "2,32,8192,128,causal")}
MMA_POINTS = [
    dict(BLOCK_M=128, BLOCK_N=64, NUM_WARPS=8, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
         LAZY_RESCALE=True, MIN_BLOCKS=1, PIPELINE="split"),
    dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
         LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split"),
    dict(BLOCK_M=128, BLOCK_N=32, NUM_WARPS=4, STAGES=3, SWIZZLE="pad", Q_IN_REGS=False,
         LAZY_RESCALE=True, MIN_BLOCKS=1, PIPELINE="split"),
]


def points(domain: Domain, limit: int | None,
           listed: Path | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The candidate points the domain admits: wgmma's re-time points (parameters they lack
    expanded over their domains) where wgmma runs, and the mma points."""
    out: list[tuple[str, dict[str, Any]]] = []

    def add(family: str, params: dict[str, Any]) -> None:
        space = domain.spaces.get(family)
        if space is None:
            return
        missing = [n for n in space.parameters if n not in params]
        for values in itertools.product(*(space.parameters[n] for n in missing)):
            p = {n: params.get(n, dict(zip(missing, values, strict=True)).get(n))
                 for n in space.parameters}
            if not domain.violations(family, p) and (family, p) not in out:
                out.append((family, p))

    if listed is not None:  # a results JSON's rows
        for r in json.loads(listed.read_text())["rows"]:
            add(r["family"], r["params"])
    elif "wgmma" in domain.spaces:
        table = json.loads(RETIME_POINTS.read_text())["workloads"]
        head_dim = int(domain.workload.head_dim)
        for text in RETIME_WORKLOADS.get(head_dim, RETIME_WORKLOADS[128]):
            for params in table.get(text, []):
                add("wgmma", params)
    else:
        for params in MMA_POINTS:
            add("mma", params)
    return out[:limit] if limit else out


def main() -> None:
    from evoengine.arch import arch_of_capability
    from evoengine.search.worker import GpuWorker

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="random:16:128:4096:0")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="not causal")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--limit", type=int, help="at most N candidates")
    ap.add_argument("--keep", type=int, default=4, help="fastest N re-timed interleaved")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--kind", choices=("varlen", "varlen_bwd"), default="varlen")
    ap.add_argument("--points", type=Path, help="candidates: a results JSON's rows")
    ap.add_argument("--untested", action="store_true",
                    help="admit the spaces' [untested] values (GPU tests, A/B runs)")
    args = ap.parse_args()
    if args.kind == "varlen_bwd" and args.points is None:
        ap.error("--kind varlen_bwd needs --points (a search's results JSON)")

    lengths, source = parse_seqlens(args.seqlens)
    cls = VarlenBackwardWorkload if args.kind == "varlen_bwd" else VarlenWorkload
    w = cls(lengths, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            causal=not args.full, dtype=args.dtype, source=source)
    worker = GpuWorker(w, 0)
    info = worker.info
    arch = arch_of_capability(*info.capability)
    spaces = default_spaces(args.kind)
    domain = Domain([s.with_untested() for s in spaces] if args.untested else spaces, w, arch)
    cands = [domain.candidate(f, p) for f, p in points(domain, args.limit, args.points)]
    print(f"{w.key()}: {w.batch} sequences, {w.total_q} query rows (longest {w.max_seqlen_q}), "
          f"{w.flops() / 1e12:.3f} useful TFLOP; {len(cands)} candidates on {info.name}",
          flush=True)
    timed, invalid = [], []
    for cand, compiled in zip(cands, compile_many(cands, arch), strict=True):
        if not compiled.ok or (compiled.spill_bytes and args.kind == "varlen"):
            invalid.append({"params": cand.params, "reason": compiled.error or "spills"})
            continue
        r = worker.evaluate(cand, compiled)
        if r["ok"]:
            timed.append((r["median_us"], cand, compiled))
            print(f"  {r['median_us']:9.1f} us  err {r['max_err']:.2e} / {r['tolerance']:.2e}"
                  f"  {cand.params}", flush=True)
        else:
            invalid.append({"params": cand.params, "reason": r["reason"]})
            print(f"  INVALID {r['reason']}  {cand.params}", flush=True)
    timed.sort(key=lambda t: t[0])
    top = timed[:args.keep]
    final = worker.final([(c, r) for _, c, r in top], args.rounds)
    t, (search_us, cand, compiled) = min(zip(final["candidates"], top, strict=True),
                                         key=lambda x: x[0]["median_us"])
    ours = t["median_us"]
    anchors = {"sdpa_cudnn_padded_us": final.get("cudnn_padded"),
               "sdpa_flash_padded_us": final.get("flash_padded"), "fa4_us": final.get("fa4")}
    row = {
        "kind": w.kind, "workload": w.key(), "seqlens": [list(x) for x in w.seqlens],
        "heads": w.heads, "kv_heads": w.kv_heads, "head_dim": w.head_dim, "causal": w.causal,
        "dtype": w.dtype, "family": cand.family, "ours_us": ours, "spread_us": t["spread_us"],
        **anchors,
        **{f"vs_{k.removesuffix('_us')}": (v / ours if v else None) for k, v in anchors.items()},
        "tflops": w.flops() / ours / 1e6, "params": cand.params, "identity": cand.identity,
        "registers": compiled.registers, "spill_bytes": compiled.spill_bytes,
        "candidates": len(cands), "valid": len(timed), "invalid": invalid,
        "retimed": [{"params": c.params, "median_us": f["median_us"], "search_us": s}
                    for f, (s, c, _) in zip(final["candidates"], top, strict=True)],
    }
    cudnn, flash, fa4 = (anchors[k] for k in ("sdpa_cudnn_padded_us", "sdpa_flash_padded_us",
                                              "fa4_us"))
    summary = (f"{w.key()}: ours {ours:.1f} us ({row['tflops']:.0f} useful TFLOPS), SDPA cuDNN "
               f"padded {cudnn or float('nan'):.1f} us (x{(cudnn or 0) / ours:.2f}), SDPA flash "
               f"padded {flash or float('nan'):.1f} us (x{(flash or 0) / ours:.2f})"
               + (f", FA4 varlen {fa4:.1f} us (x{fa4 / ours:.3f}: FA4's time over ours)" if fa4
                  else ", FA4 not timed"))
    if args.kind == "varlen_bwd":
        summary = "backward: " + summary
    print(summary)
    if args.json:
        sources = RETIME_WORKLOADS.get(args.head_dim, RETIME_WORKLOADS[128])
        doc = header(device=info.name, driver=info.driver, torch=info.versions.get("torch"),
                     method=worker.problem.method() + f"; the {args.keep} fastest valid "
                     f"candidates re-timed {args.rounds} rounds interleaved with the anchors "
                     "(medians over rounds)",
                     versions=info.versions, summary=summary,
                     candidates=(f"the rows of {args.points}" if args.points else
                                 f"{RETIME_POINTS.name} ({', '.join(sources)}), "
                                 "SCHEDULER expanded") + ", compiled with VARLEN",
                     rows=[row])
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
