"""The kinds of attention call evoengine searches kernels for, by name.

``problem(kind)`` is the one registry every stage dispatches on (the CLI's flags, the
search's validation and timing, the store's workload keys, the exported module). A kind is
a ``Problem`` (``base.py``: the contract) in a module of its own here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evoengine.problems.backward import Backward
from evoengine.problems.base import DEFAULT_KIND, Problem, Rate, Workload
from evoengine.problems.decode import Decode
from evoengine.problems.forward import Forward
from evoengine.problems.varlen import Varlen
from evoengine.problems.varlen_bwd import VarlenBackward

PROBLEMS: dict[str, Problem] = {p.kind: p for p in (Forward(), Backward(), Varlen(),
                                                     VarlenBackward(), Decode())}

__all__ = ["DEFAULT_KIND", "PROBLEMS", "Problem", "Rate", "Workload", "problem", "problem_of",
           "workload_from_dict", "workload_from_key"]


def problem(kind: str) -> Problem:
    """The problem named ``kind``; ``ValueError`` naming the known ones otherwise."""
    try:
        return PROBLEMS[kind]
    except KeyError:
        raise ValueError(f"unknown problem kind {kind!r} (known: "
                         f"{', '.join(PROBLEMS)})") from None


def problem_of(workload: Workload) -> Problem:
    return problem(type(workload).kind)


def workload_from_dict(data: Mapping[str, Any]) -> Workload:
    """The workload a ``to_dict()`` wrote; a dict with no ``kind`` is a forward's (stores and
    records written before kinds existed)."""
    return problem(str(data.get("kind", DEFAULT_KIND))).workload_from_dict(data)


def workload_from_key(key: str) -> Workload:
    """The workload a ``key()`` names: ``<kind>-...`` for every kind but the forward, whose
    keys predate kinds and carry no prefix."""
    head, _, rest = key.partition("-")
    if head in PROBLEMS and head != DEFAULT_KIND and rest:
        return PROBLEMS[head].workload_from_key(key)
    return PROBLEMS[DEFAULT_KIND].workload_from_key(key)
