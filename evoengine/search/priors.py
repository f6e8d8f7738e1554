"""Where a search starts when its store knows nothing near: the points measured fastest on a
target, shipped beside the spaces (``search_spaces/priors/<arch>.json``, written by
``benchmarks/priors.py`` from results files, each point naming the file it came from).

A store's own elites say what ran fast on this machine for a neighbouring workload; the priors
say what ran fast on the target's reference GPU for the workloads they name. The search tries
both first, nearest workload first (``search.seeds``). A seed costs one evaluation, and a
short search (a tune's rung, ``--timeout 2m`` on a slow workload: 100 evaluations) then starts
from the known winners instead of hoping to meet them. ``--no-priors``
(``SearchConfig.priors``) turns them off, to see what the search finds from nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from evoengine import paths
from evoengine.search.domain import Domain, Point

PRIORS = paths.SPACES / "priors"


@dataclass(frozen=True)
class Prior:
    kind: str  # the problem kind it was measured for (fwd, bwd, varlen, decode)
    family: str
    problem: Mapping[str, Any]
    params: Mapping[str, Any]
    source: str  # the results file that measured it
    workload: str = ""  # the key of the workload it was measured on ("": not named)


def path(arch: str) -> Path:
    return PRIORS / f"{arch}.json"


@cache
def load(arch: str) -> tuple[Prior, ...]:
    """The priors of target ``arch`` (none where no file names it); ``ValueError`` naming the
    file and the entry where one is malformed."""
    file = path(arch)
    if not file.is_file():
        return ()
    doc = json.loads(file.read_text())
    out = []
    for i, p in enumerate(doc.get("points", [])):
        try:
            out.append(Prior(str(p["kind"]), str(p["family"]), dict(p["problem"]),
                             dict(p["params"]), str(p["source"]), str(p.get("workload", ""))))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{file}: points[{i}] lacks {e}") from None
    return tuple(out)


def differ(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
    """In how many problem dimensions (head dim, dtype, causal, ...) ``a`` and ``b`` differ."""
    return sum(a.get(k) != b.get(k) for k in a.keys() | b.keys())


def admitted(domain: Domain) -> list[tuple[Prior, Point]]:
    """The priors of the domain's target whose family it searches, with the point each names
    there (measured for another problem of the family, a point serves where it is admitted:
    a forward's seeds a ragged prefill's search), in the file's order."""
    out = []
    for prior in load(domain.arch.name):
        if prior.family not in domain.spaces:
            continue
        try:
            identity = domain.identity(prior.family, prior.params)
        except KeyError:  # a parameter the space no longer has, with no legacy value
            continue
        point = domain.point(identity)
        if point is not None:
            out.append((prior, point))
    return out
