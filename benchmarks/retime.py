"""Re-time chosen points per workload the way a search's final step does, next to SDPA.

    python benchmarks/retime.py --records 6 \
        --points experiments/2026-11-22-wgmma-causal/wgmma_causal_points.json \
        --family wgmma --dtypes fp16,bf16 --json out.json

For each workload (default: issue #5's three shapes, causal and not) and dtype, the
candidates are: the best ``--records N`` valid points of every recorded sweep in tests/data
(any workload: a good kernel for one shape is a candidate for its neighbours, as the search's
seeds are), plus the points a ``--points`` file lists for that workload. A parameter the point
lacks (one added to the space after the sweep) is expanded over its whole domain; points the
space does not admit for the workload are dropped. Every candidate goes through the search's
own GPU worker (``evoengine.search.worker.GpuWorker``, run in this process): the criterion on
``validate.plan(workload)``, then a timing; the ``--keep`` fastest valid ones are re-timed
``--rounds`` times interleaved with SDPA's flash and cuDNN backends, and the row holds the
best, with same-run ratios.

A template change's A/B: ``--base-templates DIR`` (another tree's ``templates/``, e.g. a
``git worktree`` of the commit before the change) builds each kept point from those templates
as well (uncached), and the final rounds time each point next to its base build; the row's
``base`` lists both medians per point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import measure, paths  # noqa: E402
from evoengine.compile import compile_many, compile_source  # noqa: E402
from evoengine.provenance import header  # noqa: E402
from evoengine.render import render  # noqa: E402
from evoengine.search.domain import Domain  # noqa: E402
from evoengine.search.replay import load_record  # noqa: E402
from evoengine.space import default_spaces  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

WORKLOADS = ["16,16,2048,64", "16,16,2048,64,causal", "8,16,4096,128",
             "8,16,4096,128,causal", "2,32,8192,128", "2,32,8192,128,causal"]


def expand(domain: Domain, family: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """``params`` completed over the domains of the parameters it lacks, in declared order,
    keeping the admitted ones."""
    space = domain.spaces.get(family)
    if space is None:
        return []
    missing = [n for n in space.parameters if n not in params]
    out = []
    for values in itertools.product(*(space.parameters[n] for n in missing)):
        p = {n: params.get(n, dict(zip(missing, values, strict=True)).get(n))
             for n in space.parameters}
        if not domain.violations(family, p):
            out.append(p)
    return out


def candidates(domain: Domain, text: str, family: str | None, records: int,
               points_file: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    seen: list[tuple[str, dict[str, Any]]] = []

    def add(f: str, params: dict[str, Any]) -> None:
        for p in expand(domain, f, params):
            if (f, p) not in seen:
                seen.append((f, p))

    for path in sorted((paths.ROOT / "tests" / "data").glob("sweep-*.json.gz")) if records else []:
        ok = sorted((p for p in load_record(path).points
                     if p.ok and (family is None or p.family == family)),
                    key=lambda p: p.median_us)  # type: ignore[arg-type, return-value]
        for p in ok[:records]:
            add(p.family, dict(p.params))
    if points_file:
        for p in points_file["workloads"].get(text, []):
            add(points_file.get("family", family or "mma"), dict(p))
    return seen


def main() -> None:
    from evoengine.arch import arch_of_capability
    from evoengine.search.worker import GpuWorker

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=WORKLOADS, metavar="B,H,S,D[,causal]")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--family", help="only this family's recorded points")
    ap.add_argument("--records", type=int, default=6, help="best N points of each sweep")
    ap.add_argument("--points", type=Path, help="JSON {family, workloads: {text: [params]}}")
    ap.add_argument("--keep", type=int, default=4, help="fastest N re-timed interleaved")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--untested", action="store_true",
                    help="admit the spaces' [untested] values (the points file names them)")
    ap.add_argument("--base-templates", type=Path, metavar="DIR",
                    help="also build each kept point from these templates and time it beside")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    points_file = json.loads(args.points.read_text()) if args.points else None
    spaces = default_spaces()
    if args.untested:  # e.g. twins of a value whose GPU tests passed in the same call
        spaces = [s.with_untested() for s in spaces]
    rows, info = [], None

    def write() -> None:  # after every row: a run cut short keeps what it measured
        if not args.json:
            return
        doc = header(
            device=info.name if info else None, driver=info.driver if info else None,
            torch=info.versions.get("torch") if info else None,
            method="each candidate: the criterion on validate.plan(workload), then "
                   f"{measure.METHOD}; the {args.keep} fastest re-timed {args.rounds} rounds "
                   "interleaved with SDPA flash and cuDNN (and FlashAttention-4 where it "
                   "imports, eager) in the same process (medians over "
                   "rounds)",
            versions=info.versions if info else None,
            candidates=f"best {args.records} of each recorded sweep in tests/data"
                       + (f" + {args.points}" if args.points else "")
                       + "; parameters added since a sweep expanded over their domains"
                       + (f"; each kept point also built from {args.base_templates} (its base, "
                          "through the criterion too) and timed beside it"
                          if args.base_templates else ""),
            rows=rows)
        args.json.write_text(json.dumps(doc, indent=1))

    for dtype in args.dtypes.split(","):
        for text in args.workloads:
            w = Workload.parse_spec(text, dtype=dtype)
            worker = GpuWorker(w, 0)
            info = worker.info
            arch = arch_of_capability(*info.capability)
            domain = Domain(spaces, w, arch)
            pts = candidates(domain, text, args.family, args.records, points_file)
            cands = [domain.candidate(f, p) for f, p in pts]
            timed, invalid = [], []
            for cand, compiled in zip(cands, compile_many(cands, arch), strict=True):
                if not compiled.ok:
                    invalid.append({"params": cand.params, "reason": compiled.error})
                    continue
                r = worker.evaluate(cand, compiled)
                if r["ok"]:
                    timed.append((r["median_us"], cand, compiled))
                else:
                    invalid.append({"params": cand.params, "reason": r["reason"]})
            timed.sort(key=lambda t: t[0])
            top = timed[:args.keep]
            base = [(c, compile_source(render(c, args.base_templates), arch, c.defines(arch),
                                       identity=f"{c.identity}@base", smem_bytes=c.smem_bytes))
                    for _, c, _ in top] if args.base_templates else []
            base = [(c, r) for c, r in base if r.ok and worker.evaluate(c, r)["ok"]]
            final = worker.final([(c, r) for _, c, r in top] + base, args.rounds)
            base_times = final["candidates"][len(top):]
            final["candidates"] = final["candidates"][:len(top)]
            best = min(zip(final["candidates"], top, strict=True),
                       key=lambda x: x[0]["median_us"])
            t, (search_us, cand, compiled) = best
            flash, cudnn, fa4 = final["flash"], final["cudnn"], final.get("fa4")
            row = {
                "family": cand.family, "shape": [w.batch, w.heads, w.seq_q, w.head_dim],
                "kv_heads": w.kv_heads, "seq_k": w.seq_k, "causal": w.causal, "dtype": dtype,
                "ours_us": t["median_us"], "spread_us": t["spread_us"],
                "sdpa_flash_us": flash, "sdpa_cudnn_us": cudnn,
                "vs_flash": flash / t["median_us"] if flash else None,
                "vs_cudnn": cudnn / t["median_us"] if cudnn else None,
                "fa4_us": fa4, "vs_fa4": fa4 / t["median_us"] if fa4 else None,
                "tflops": w.flops() / t["median_us"] / 1e6, "params": cand.params,
                "identity": cand.identity, "registers": compiled.registers,
                "spill_bytes": compiled.spill_bytes, "candidates": len(cands),
                "valid": len(timed), "invalid": invalid,
                "retimed": [{"params": c.params, "median_us": f["median_us"], "search_us": s}
                            for f, (s, c, _) in zip(final["candidates"], top, strict=True)],
            }
            if args.base_templates:
                now = {c.identity: f["median_us"]
                       for f, (_, c, _) in zip(final["candidates"], top, strict=True)}
                row["base"] = [{"params": c.params, "median_us": now[c.identity],
                                "base_us": f["median_us"]}
                               for f, (c, _) in zip(base_times, base, strict=True)]
            rows.append(row)
            write()
            print(f"{dtype} {text:22} ours {row['ours_us']:8.1f} us  flash {flash or 0:8.1f}  "
                  f"cudnn {cudnn or 0:8.1f}  x{row['vs_flash'] or 0:.2f} flash  "
                  f"x{row['vs_cudnn'] or 0:.2f} cudnn  fa4 {fa4 or 0:8.1f}  "
                  f"x{row['vs_fa4'] or 0:.3f} fa4  {row['tflops']:.0f} TFLOPS  "
                  f"({len(timed)}/{len(cands)} valid)  {cand.params}", flush=True)


if __name__ == "__main__":
    main()
