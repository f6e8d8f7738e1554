"""Write a target's priors (``search_spaces/priors/<arch>.json``, read by
``evoengine/search/priors.py``): the points its results files measured fastest, per workload,
so a search starts from them.

    python benchmarks/priors.py            # rewrite search_spaces/priors/sm_90a.json
    python benchmarks/priors.py --check    # exit 1 if the file is not what the sources give

The sources are named below, one reader per results layout; each point keeps the file it
came from. Per workload row, the ``KEEP`` fastest points the row's re-time measured (the
forward's and ragged prefill's ``retimed``, the backward's ``bwd_points``, decode's
``points_us``; a search's final re-time, a row a point), fastest first; a point measured on
several rows is kept once, at its first; one naming a value since removed with its parameter
(``[retired]``) is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import paths  # noqa: E402
from evoengine.arch import Arch, get_arch  # noqa: E402
from evoengine.problems.backward import BackwardWorkload  # noqa: E402
from evoengine.render import make_identity  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

KEEP = 2
RESULTS = paths.ROOT / "benchmarks" / "results"
# (arch, reader, results file): the re-times that hold each kind's best known points, on the
# H100 and (decode, since the fourth session of 2026-11-28, the same sm_90a) the H200.
SOURCES = [
    ("sm_90a", "retimed", "2026-11-27-h100-wgmma-o-tma.json"),
    ("sm_90a", "retimed", "2026-11-27-h100-wgmma-o-store.json"),
    ("sm_90a", "retimed", "2026-11-27-h100-wgmma-full-dynamic.json"),
    ("sm_90a", "retimed", "2026-11-27-h100-wgmma-fa3-levers.json"),
    ("sm_90a", "retimed", "2026-11-24-h100-wgmma-retime-fa4.json"),
    ("sm_90a", "retimed", "2026-11-25-h100-varlen-pack-gqa.json"),
    ("sm_90a", "retimed", "2026-11-25-h100-varlen-all-points.json"),
    ("sm_90a", "retimed", "2026-11-29-h200-varlen-bwd-fa4-d128.json"),
    ("sm_90a", "retimed", "2026-11-29-h200-varlen-bwd-fa4-d64-mqa.json"),
    ("sm_90a", "retimed", "2026-11-29-h200-varlen-bwd-fa4-d64-mqa-group-split.json"),
    ("sm_90a", "retimed", "2026-11-29-h200-varlen-bwd-fa4-d64-mqa-split-search.json"),
    ("sm_90a", "retimed", "2026-11-29-h200-wgmma-twelve-searched.json"),
    ("sm_90a", "searched", "2026-11-29-h200-search-2m-fwd.json"),
    ("sm_90a", "searched", "2026-11-29-h200-bwd-search-2m.json"),
    ("sm_90a", "searched", "2026-11-29-h200-bwd-search-2m-d128.json"),
    ("sm_90a", "bwd_points", "2026-11-27-h100-bwd-step-order.json"),
    ("sm_90a", "bwd_points", "2026-11-27-h100-bwd-step-order-fp16.json"),
    ("sm_90a", "bwd_points", "2026-11-25-h100-train-step-fa4.json"),
    ("sm_90a", "bwd_points", "2026-11-29-h200-bwd-split-ab.json"),
    ("sm_90a", "bwd_points", "2026-11-29-h200-bwd-ds-buffers.json"),
    ("sm_90a", "bwd_points", "2026-11-29-h200-bwd-ds-store.json"),
    ("sm_90a", "bwd_points", "2026-11-29-h200-bwd-launch-kv-pair.json"),
    ("sm_90a", "points_us", "2026-11-25-h100-decode-fused.json"),
    ("sm_90a", "points_us", "2026-11-25-h100-decode-q4-h64-bm32.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q1-h64-paged.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q1-h64-contig.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q4-b1.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-combine-items.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q1-h64-items-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q4-h64-b1-sweep-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-cluster-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-cooperative-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-q4-b64-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-cluster-waves-q4-bf16.json"),
    ("sm_90a", "points_us", "2026-11-27-h100-decode-cluster-waves-q1-bf16.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-programmatic-spread.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-off-grid.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-row-groups.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-wgmma.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-search-q1-d64-bench.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-search-q16-h64-b8-bf16-bench.json"),
    ("sm_90a", "points_us", "2026-11-28-h200-decode-search-q4-h64-b1-bf16-pdl-bench.json"),
    ("sm_90a", "points_us", "2026-11-29-h200-decode-cluster-push.json"),
    ("sm_90a", "points_us", "2026-11-29-h200-decode-cluster-2-4-8.json"),
    ("sm_90a", "points_us", "2026-11-29-h200-decode-cluster-8-paged.json"),
    ("sm_90a", "cell_ids", "2026-11-25-h100-cell-kernels.json"),
]

Prior = dict[str, Any]


def _problem(row: dict[str, Any], kind: str) -> dict[str, Any]:
    head_dim = row["shape"][3] if "shape" in row else row["head_dim"]
    if kind == "decode":
        return {"HEAD_DIM": head_dim, "DTYPE": row["dtype"], "PAGED": row["layout"] == "paged"}
    problem = {"HEAD_DIM": head_dim, "DTYPE": row["dtype"], "CAUSAL": bool(row["causal"])}
    return {**problem, "VARLEN": True} if kind in ("varlen", "varlen_bwd") else problem


def _workload(row: dict[str, Any], kind: str) -> str:
    """The key of the workload a row measured (its own where it names one)."""
    if "workload" in row:
        return str(row["workload"])
    b, h, s, d = row["shape"]
    w = Workload(b, h, s, d, kv_heads=row.get("kv_heads"), seq_k=row.get("seq_k"),
                 causal=bool(row["causal"]), dtype=row["dtype"])
    return (BackwardWorkload.of(w) if kind == "bwd" else w).key()


def retimed(row: dict[str, Any], arch: Arch) -> Iterator[Prior]:
    """A forward, ragged-prefill or ragged-backward re-time row: its re-timed points, fastest
    first."""
    kind = row.get("kind", "fwd")
    for t in sorted(row["retimed"], key=lambda t: t["median_us"])[:KEEP]:
        yield {"kind": kind, "family": row["family"], "problem": _problem(row, kind),
               "workload": _workload(row, kind), "params": t["params"]}


def bwd_points(row: dict[str, Any], arch: Arch) -> Iterator[Prior]:
    """A training-step row: the backward points it timed, fastest first (its step rows, which
    time the chosen pair as a whole, carry none)."""
    if row.get("kind") != "bwd" or "bwd_points" not in row:
        return
    for t in sorted(row["bwd_points"], key=lambda t: t["median_us"])[:KEEP]:
        yield {"kind": "bwd", "family": t["family"], "problem": _problem(row, "bwd"),
               "workload": _workload(row, "bwd"), "params": t["params"]}


def searched(row: dict[str, Any], arch: Arch, rows: list[dict[str, Any]]) -> Iterator[Prior]:
    """A row of a search's final re-time (one point a row; ``rows``, the file's, may hold
    several searches): its point, where it is among its workload's ``KEEP`` fastest."""
    kind = row.get("kind", "fwd")
    key = _workload(row, kind)
    same = sorted((r for r in rows if _workload(r, r.get("kind", "fwd")) == key),
                  key=lambda r: r["ours_us"])
    if any(r is row for r in same[:KEEP]):
        yield {"kind": kind, "family": row["family"], "problem": _problem(row, kind),
               "workload": key, "params": row["params"]}


def points_us(row: dict[str, Any], arch: Arch) -> Iterator[Prior]:
    """A decode row: its points by identity, fastest first, their parameters found among the
    decode space's admitted points (an identity today's space no longer builds is skipped)."""
    problem = _problem(row, "decode")
    by_part = _points_by_part(arch, "decode", tuple(problem.items()))
    prefix = make_identity("decode", problem, {}).rsplit("-", 1)[0] + "-"
    timed = sorted(row["points_us"].items(), key=lambda kv: kv[1])
    for identity, _ in timed[:KEEP]:
        params = by_part.get(identity.rsplit("-", 1)[0][len(prefix):])
        if params is not None:
            yield {"kind": "decode", "family": "decode", "problem": problem,
                   "workload": row["workload"], "params": params}


# experiments/2026-11-25-tune-cell/cell_kernels.py timed its points at Llama-3-8B's geometry.
CELL_GEOMETRY = dict(heads=32, kv_heads=8, head_dim=128, causal=True, dtype="bf16")


def cell_ids(row: dict[str, Any], arch: Arch, ids: list[str]) -> Iterator[Prior]:
    """A row of the short-sequence cell timing (b, L, ours_us per point of the file's ids,
    each an identity's parameter part): its fastest points."""
    g = CELL_GEOMETRY
    w = Workload(row["b"], g["heads"], row["L"], g["head_dim"], kv_heads=g["kv_heads"],
                 causal=g["causal"], dtype=g["dtype"])
    problem = w.problem()
    by_part = _points_by_part(arch, "wgmma", tuple(problem.items()))
    timed = sorted(zip(row["ours_us"], ids, strict=True))
    for _, part in timed[:KEEP]:
        if part in by_part:
            yield {"kind": "fwd", "family": "wgmma", "problem": problem, "workload": w.key(),
                   "params": by_part[part]}


def _removed(prior: Prior) -> bool:
    """Whether the point names a value its space has since removed with its parameter (a
    ``[retired]`` one: it lost to the value kept, so it seeds nothing)."""
    return bool(_space(prior["family"]).removed(prior["params"]))


@cache
def _space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


@cache
def _points_by_part(arch: Arch, family: str, problem: tuple[tuple[str, Any], ...]) -> dict:
    """``family``'s admitted points for ``problem`` by the parameter part of their identity,
    the parameters added since the measurement (``[legacy]``, at their legacy value) left out
    of the part, as an identity written before them lacks them."""
    space = _space(family)
    out: dict[str, Any] = {}
    newest_last = list(space.legacy)
    for p in space.admitted(dict(problem), arch):
        for added in range(len(newest_last) + 1):  # with 0, 1, ... of the newest left out
            dropped = newest_last[len(newest_last) - added:]
            if any(p[k] != space.legacy[k] for k in dropped):
                continue  # an identity from before them names only their legacy value
            kept = {k: v for k, v in p.items() if k not in dropped}
            prefix = make_identity(family, dict(problem), {}).rsplit("-", 1)[0] + "-"
            out.setdefault(make_identity(family, dict(problem), kept).rsplit("-", 1)[0]
                           [len(prefix):], p)
    return out


READERS = {"retimed": retimed, "bwd_points": bwd_points, "points_us": points_us,
           "cell_ids": cell_ids, "searched": searched}


def build(arch: str) -> dict[str, Any]:
    points: list[Prior] = []
    seen: set[str] = set()
    for target, reader, name in SOURCES:
        if target != arch:
            continue
        doc = json.loads((RESULTS / name).read_text())
        extra = ((doc["ids"],) if reader == "cell_ids"
                 else (doc["rows"],) if reader == "searched" else ())
        for row in doc["rows"]:
            for prior in READERS[reader](row, get_arch(arch), *extra):
                if _removed(prior):
                    continue
                key = json.dumps([prior["kind"], prior["family"], prior["workload"],
                                  prior["params"]], sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    points.append({**prior, "source": f"benchmarks/results/{name}"})
    return {"arch": arch,
            "note": "written by benchmarks/priors.py; the points its sources measured fastest "
                    "per workload, which a search tries first (evoengine/search/priors.py)",
            "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args()
    stale = []
    for arch in sorted({a for a, _, _ in SOURCES}):
        doc = build(arch)
        text = json.dumps(doc, indent=1) + "\n"
        out = paths.SPACES / "priors" / f"{arch}.json"
        if args.check:
            if not out.is_file() or out.read_text() != text:
                stale.append(str(out))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"wrote {out} ({len(doc['points'])} points)")
    if stale:
        raise SystemExit(f"stale: {', '.join(stale)} (run python benchmarks/priors.py)")


if __name__ == "__main__":
    main()
