"""Every family at head dims other than the 64 and 128 its space is drawn at (multiples of 16):
where the space admits a point of such a problem, the point compiles for every target it
serves, offline. Spills are allowed there (some spaces' register models are drawn at 64 and
128: docs/NOTES.md, "Other head dims"); compile errors are not: every d96 point of the wgmma
backward failed a static assertion once, and decode refused d96 outright."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from evoengine.arch import get_arch
from evoengine.compile import compile_many
from evoengine.render import make_candidate
from evoengine.space import default_spaces

HEAD_DIMS = (48, 96, 192, 256)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_an_admitted_point_of_each_family_compiles_at_other_head_dims(arch: str,
                                                                      cache: Path) -> None:
    target = get_arch(arch)
    cands, served = [], set()
    for space in default_spaces(None):
        if not space.supports(target):
            continue
        for d in HEAD_DIMS:
            problem = next(space.problems(head_dims=[d]))
            points = space.admitted(problem, target)
            if points:
                served.add((space.family, d))
                cands.append(make_candidate(space, random.Random(d).choice(points), problem,
                                            target))
    for c, r in zip(cands, compile_many(cands, target, workers=2), strict=True):
        assert r.ok, f"{c.identity}: {r.error}"
    # d96 is served by every family on every target (forward, backward, decode).
    assert {f for f, d in served if d == 96} == {
        s.family for s in default_spaces(None) if s.supports(target)}
