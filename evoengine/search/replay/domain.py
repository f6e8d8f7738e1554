"""The domain of a replay: only the points a record holds can be proposed.

The record carries each family's search space as swept (its TOML), and a replay uses that by
default, so a record outlives later edits of the spaces (a new parameter, a changed
constraint). A replay given other spaces explicitly refuses a record whose parameter lists
differ from theirs, as Kernel Tuner's cache refuses another parameter list.

Contract. ``replay_domain`` raises ``RecordError`` when the record's parameter lists differ
from the spaces', when a recorded space cannot be read, or when the spaces admit none of the
recorded points; it never mutates the record or the spaces. Every point the record lacks is
a violation (``NOT_RECORDED``), so no sampler gets it built.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from evoengine.arch import get_arch
from evoengine.search.domain import Domain
from evoengine.search.replay.record import NOT_RECORDED, Record, RecordError, point_key
from evoengine.space import SearchSpace, default_spaces


class RecordedDomain(Domain):
    """The admitted points of the spaces that the record holds; any other point is
    rejected with "not in the replay record", so samplers and the loop never build it.

    ``skipped`` lists recorded points the spaces no longer admit (a changed constraint).
    """

    renders = False  # the templates may have moved on since the sweep; replay needs no source

    def __init__(self, spaces: Iterable[SearchSpace] | None, record: Record) -> None:
        spaces = recorded_spaces(record) if spaces is None else list(spaces)
        arch = get_arch(record.arch)
        super().__init__(spaces, record.workload, arch)
        for family, info in record.families.items():
            if family in self.spaces and list(self.spaces[family].parameters) != list(
                    info["parameters"]):
                raise RecordError(
                    f"{record.path or 'the record'}: {family} parameters "
                    f"{info['parameters']} differ from the search space's "
                    f"{list(self.spaces[family].parameters)}; record the sweep again")
        self.record = record
        admitted = {point_key(f, p) for f, pts in self.points.items() for p in pts}
        self.skipped = [p for p in record.points if point_key(p.family, p.params) not in admitted]
        for family in list(self.points):
            kept = [p for p in self.points[family] if record.lookup(family, p) is not None]
            if kept:
                self.points[family] = kept
            else:
                del self.points[family]
                del self.spaces[family]
        if not self.points:
            raise RecordError(f"{record.path or 'the record'}: none of its points is admitted "
                              "by the search spaces")
        self._identities = {self.identity(f, p): (f, p)
                            for f, pts in self.points.items() for p in pts}

    def violations(self, family: str, params: Mapping[str, Any]) -> list[str]:
        bad = super().violations(family, params)
        if not bad and self.record.lookup(family, params) is None:
            bad = [NOT_RECORDED]
        return bad


def recorded_spaces(record: Record) -> list[SearchSpace]:
    """The search spaces the record was swept with (the project's for a family whose record
    carries none)."""
    current = {sp.family: sp for sp in default_spaces()}
    out = []
    for family, info in record.families.items():
        if "space" in info:
            try:
                out.append(SearchSpace.from_dict(tomllib.loads(info["space"])))
            except (tomllib.TOMLDecodeError, ValueError) as e:
                raise RecordError(f"{record.path or 'the record'}: {family}'s space: {e}") from None
        elif family in current:
            out.append(current[family])
    return out


def replay_domain(record: Record, spaces: Iterable[SearchSpace] | None = None) -> Domain:
    """The ``Domain`` of the recorded points that ``spaces`` (default: the record's own)
    admit."""
    return RecordedDomain(spaces, record)
