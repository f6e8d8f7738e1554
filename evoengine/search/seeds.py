"""Where a search starts: the points its sampler tries before any of its own, nearest first.

Two sources. The store's elites (ranks 1 and 2) of other workloads on the same target: good
kernels for a neighbouring shape are likely good here, and this machine measured them
(``evoengine tune`` relies on it: its ladder's previous rung seeds the next). With
``priors``, the target's shipped priors too (``search.priors``): the points the project's
re-times measured fastest on the target's reference GPU. Both are ordered by
``workload_distance`` from the searched workload; at equal distance the store's elites come
first, and a prior that names no workload ranks after every elite of a problem as near.
"""

from __future__ import annotations

import math

from evoengine.search import priors as shipped
from evoengine.search.domain import Domain, Point
from evoengine.store import Store
from evoengine.workload import Workload

ELITE, PRIOR = 0, 1  # at equal distance, the store's elites first


def seeds(store: Store, domain: Domain, key: str, priors: bool = False) -> list[Point]:
    """The admitted points to try first for workload ``key``, nearest first, each once."""
    return [point for point, _ in seeds_by_origin(store, domain, key, priors)]


def seeds_by_origin(store: Store, domain: Domain, key: str,
                    priors: bool = False) -> list[tuple[Point, bool]]:
    """``seeds``, each with whether only the priors name it (no elite of the store does)."""
    found: list[tuple[tuple[float, ...], int, int, Point]] = []
    for elite in store.elites(arch=domain.arch.name):
        if elite.workload_key == key or elite.rank > 2:
            continue
        point = domain.point(domain.identity(elite.family, elite.params)
                             if elite.family in domain.spaces else "")
        if point is not None:
            found.append((workload_distance(domain.workload, elite.workload_key), ELITE,
                          elite.rank, point))
    if priors:
        for prior, point in shipped.admitted(domain):
            far = (workload_distance(domain.workload, prior.workload) if prior.workload
                   else (float(shipped.differ(prior.problem, domain.problem)), math.inf))
            found.append((far, PRIOR, 0, point))
    found.sort(key=lambda f: f[:3])  # stable: the store's and the file's order break ties
    elites = [point for _, origin, _, point in found if origin == ELITE]
    out: list[tuple[Point, bool]] = []
    for *_, point in found:
        if all(point != seen for seen, _ in out):
            out.append((point, point not in elites))
    return out


def workload_distance(here: Workload, key: str) -> tuple[float, ...]:
    """How far the workload ``key`` names is from ``here``, to order seeds: first whether
    its problem (head dim, dtype, causal, ...) differs in 0 to 3 ways, then the log distance
    of its lengths, then of its batch x heads. A key no problem reads is farthest."""
    from evoengine.problems import workload_from_key

    try:
        there = workload_from_key(key)
    except ValueError:
        return (math.inf,)
    differ = float(shipped.differ(here.problem(), there.problem()))

    def log_ratio(x: object, y: object) -> float:
        ok = all(isinstance(v, int) and v > 0 for v in (x, y))
        return abs(math.log(x / y)) if ok else math.inf  # type: ignore[operator]

    lengths = sum(log_ratio(getattr(here, n, None), getattr(there, n, None))
                  for n in ("seq_q", "seq_k"))
    rows = log_ratio(getattr(here, "batch", 0) * getattr(here, "heads", 0),
                     getattr(there, "batch", 0) * getattr(there, "heads", 0))
    return (differ, lengths, rows)
