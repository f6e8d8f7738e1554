"""Where a search starts (evoengine/search/seeds.py): the store's elites of other workloads
and the target's priors, nearest workload first."""

from __future__ import annotations

import json
from pathlib import Path

from evoengine import paths
from evoengine.arch import get_arch
from evoengine.render import make_candidate, render
from evoengine.search.domain import Domain
from evoengine.search.seeds import seeds, workload_distance
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload

SM90 = get_arch("sm_90a")


def mma() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "mma.toml")


def plant_elite(store: Store, space: SearchSpace, params: dict, w: Workload) -> None:
    """Store ``params``, built for ``w`` on sm_90a, as ``w``'s rank-1 elite there."""
    cand = make_candidate(space, params, w.problem(), SM90)
    store.add_candidate(identity=cand.identity, family=cand.family,
                        template_hash=cand.template_hash, params=cand.params,
                        problem=cand.problem, source=render(cand))
    run = store.start_run(arch="sm_90a", workload=w.to_dict(), workload_key=w.key(),
                          device="fake", commit=None, study=w.key())
    store.set_elites(arch="sm_90a", workload_key=w.key(), entries=[(cand.identity, 1.0)],
                     run_id=run)


def test_seeds_come_from_the_nearest_workloads_first(tmp_path: Path) -> None:
    """The sampler tries the elites of other workloads in order of how near they are: same
    problem before another dtype or mask, then nearest lengths, then nearest batch x heads."""
    here = Workload(8, 8, 2048, 64, causal=True)
    space = mma()
    points = space.admitted(here.problem(), SM90)[:5]
    others = [Workload(1, 8, 16384, 64, causal=True),   # far in length
              Workload(8, 8, 2048, 64, causal=False),   # same lengths, other mask
              Workload(16, 8, 1024, 64, causal=True),   # the rung below: the nearest
              Workload(2, 8, 4096, 64, causal=True),    # the rung above, fewer rows
              Workload(2, 8, 2048, 64, causal=True)]    # same lengths, fewer rows
    with Store(f"sqlite:///{tmp_path / 'seeds.db'}") as store:
        for w, params in zip(others, points, strict=True):
            plant_elite(store, space, params, w)
        found = seeds(store, Domain([space], here, SM90), here.key())
    order = [others.index(w) for w in (others[4], others[2], others[3], others[0], others[1])]
    assert [p for _, p in found] == [points[i] for i in order]
    assert workload_distance(here, "not-a-key") == (float("inf"),)


def test_priors_come_after_the_stores_elites_of_as_near_a_problem(planted: Path,
                                                                   tmp_path: Path) -> None:
    """Seeds: the store's elites of the same problem (measured on this machine), then the
    priors of the same problem, then elites of a farther problem, then farther priors; none
    of the priors without ``priors``."""
    here = Workload(8, 8, 2048, 64, causal=True)
    other = Workload(8, 8, 2048, 64, causal=False)
    space = mma()
    points = space.admitted(here.problem(), SM90)
    elite_near, elite_far, prior_near, prior_far = points[0], points[1], points[2], points[3]
    (planted / "sm_90a.json").write_text(json.dumps({"points": [
        {"kind": "fwd", "family": "mma", "problem": other.problem(), "params": prior_far,
         "source": "x.json"},
        {"kind": "fwd", "family": "mma", "problem": here.problem(), "params": prior_near,
         "source": "x.json"},
        {"kind": "varlen", "family": "mma", "problem": {**here.problem(), "VARLEN": True},
         "params": points[4], "source": "another kind's, as far as two dimensions"},
        {"kind": "bwd", "family": "mma_bwd", "problem": here.problem(), "params": {},
         "source": "a family this search does not run: not a seed"},
    ]}))
    with Store(f"sqlite:///{tmp_path / 'seeds.db'}") as store:
        plant_elite(store, space, elite_near, Workload(2, 8, 4096, 64, causal=True))
        plant_elite(store, space, elite_far, other)
        domain = Domain([space], here, SM90)
        with_priors = [p for _, p in seeds(store, domain, here.key(), priors=True)]
        without = [p for _, p in seeds(store, domain, here.key())]
    assert with_priors == [elite_near, prior_near, elite_far, prior_far, points[4]]
    assert without == [elite_near, elite_far]


def test_a_prior_measured_on_a_nearer_workload_comes_first(planted: Path, tmp_path: Path) -> None:
    """Priors that name their workload are ordered like elites, by workload distance: one
    measured at the searched lengths before one measured far away; at equal distance the
    store's elite first."""
    here = Workload(8, 8, 2048, 64, causal=True)
    space = mma()
    points = space.admitted(here.problem(), SM90)
    far, near, same = points[0], points[1], points[2]
    (planted / "sm_90a.json").write_text(json.dumps({"points": [
        {"kind": "fwd", "family": "mma", "problem": here.problem(), "params": p,
         "workload": w.key(), "source": "x.json"}
        for p, w in ((far, Workload(1, 8, 16384, 64, causal=True)),
                     (near, Workload(8, 8, 1024, 64, causal=True)),
                     (same, Workload(16, 8, 1024, 64, causal=True)))]}))
    with Store(f"sqlite:///{tmp_path / 'seeds.db'}") as store:
        plant_elite(store, space, points[3], Workload(16, 8, 1024, 64, causal=True))
        found = seeds(store, Domain([space], here, SM90), here.key(), priors=True)
    # near: 1024 at the same rows; then the elite and the prior at 16 x 1024 (elite first)
    assert [p for _, p in found] == [near, points[3], same, far]
