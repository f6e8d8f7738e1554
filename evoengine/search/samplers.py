"""Search strategies, as Optuna samplers.

``evo`` (the default) is a genetic algorithm that knows the domain: it only ever proposes
admitted points no trial has taken and the store has not measured, starts from the elites
of neighbouring workloads where there are any, and breeds within a family. ``random`` is
uniform over the same admitted, unseen points. ``tpe`` and ``nsga2`` are Optuna's own; they
may propose rejected or measured points, which the search answers without compiling.

=================  =======  ==============================================================
option (evo)       default  meaning
=================  =======  ==============================================================
population         16       random points before breeding starts, and parents kept
tournament         3        contestants per parent draw
mutation           0.25     chance to change each parameter of a child (at least one)
step               0.7      chance a mutation moves to an adjacent value of an ordered
                            domain rather than any value
immigrants         0.1      chance a child is a fresh random point instead (any family)
balanced           True     fresh random points pick a family uniformly, then a point of
                            it, so a small family is tried as often as a large one
=================  =======  ==============================================================
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from evoengine.search.domain import Domain, Point

STRATEGIES = ("evo", "random", "tpe", "nsga2")
IDENTITY_ATTR = "identity"
REASON_ATTR = "reason"
NOT_EVALUATED = "not evaluated"  # reason prefix of trials stopped before the GPU saw them


def trial_identity(domain: Domain, trial: FrozenTrial) -> str | None:
    """The identity a trial built (or was about to), from its attribute or parameters."""
    identity = trial.user_attrs.get(IDENTITY_ATTR)
    if identity is not None:
        return str(identity)
    point = domain.from_trial_params(trial.params)
    return None if point is None else domain.identity(*point)


class EvoSampler(BaseSampler):
    """A genetic algorithm over a ``Domain``'s admitted points (options: module docstring).

    ``blocked()`` returns identities that must not be proposed (measured in the store, or
    claimed there by a search worker);
    ``seeds`` are points tried first (the elites of related workloads). Proposes nothing
    (an empty dict) when every admitted point is taken; the search checks that first.
    """

    def __init__(self, domain: Domain, *, seed: int | None = None,
                 blocked: Callable[[], set[str]] = set, seeds: Sequence[Point] = (),
                 random_only: bool = False, population: int = 16, tournament: int = 3,
                 mutation: float = 0.25, step: float = 0.7, immigrants: float = 0.1,
                 balanced: bool = True) -> None:
        self.domain = domain
        self._rng = random.Random(seed)
        self._blocked = blocked
        self._seeds = list(seeds)
        self._random_only = random_only
        self.population = population
        self.tournament = tournament
        self.mutation = mutation
        self.step = step
        self.immigrants = immigrants
        self.balanced = balanced and not random_only
        self._fallback = RandomSampler(seed=seed)
        self._encodings: dict[str, Any] = {}

    # ---- Optuna's interface -------------------------------------------------------------

    def infer_relative_search_space(self, study: Study,
                                    trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.domain.distributions()

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:  # an enqueued trial: its params are given
            return {}
        point = self.next_point(study)
        return {} if point is None else self.domain.to_trial_params(*point)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    # ---- the algorithm ------------------------------------------------------------------

    def next_point(self, study: Study) -> Point | None:
        """The next point for ``study``, as ``sample_relative`` proposes it (None: none
        fresh). The search calls this before creating the trial, so that the trial is
        written with its point in one transaction instead of one per parameter."""
        trials = study.get_trials(deepcopy=False)
        return self.propose(trials, self.seen(trials))

    def seen(self, trials: Sequence[FrozenTrial]) -> set[str]:
        out = set(self._blocked())
        for t in trials:
            if t.state == TrialState.FAIL and str(
                    t.user_attrs.get(REASON_ATTR, NOT_EVALUATED)).startswith(NOT_EVALUATED):
                # Never measured (stopped first, or claimed by another worker), or failed
                # with no reason: its worker died and the heartbeat check failed it. The
                # store's measurements and claims, in ``blocked``, say what is taken.
                continue
            identity = trial_identity(self.domain, t)
            if identity is not None:
                out.add(identity)
        return out

    def propose(self, trials: Sequence[FrozenTrial], seen: set[str]) -> Point | None:
        while self._seeds:
            family, params = self._seeds.pop(0)
            if (family in self.domain.spaces and not self.domain.violations(family, params)
                    and self.domain.identity(family, params) not in seen):
                return family, params
        scored = []
        for t in trials:
            if t.state == TrialState.COMPLETE and t.value is not None:
                point = self.domain.from_trial_params(t.params)
                if point is not None:
                    scored.append((t.value, point))
        if (self._random_only or len(scored) < self.population
                or self._rng.random() < self.immigrants):
            return self._random_unseen(seen)
        scored.sort(key=lambda s: s[0])
        parents = scored[: self.population]
        a = self._tournament(parents)
        b = self._tournament(parents)
        child = self._mutate(a[0], self._crossover(a, b))
        return self._repair(a[0], child, seen)

    def _random_unseen(self, seen: set[str]) -> Point | None:
        fresh = [p for i, p in self.domain.items() if i not in seen]
        if not fresh:
            return None
        if self.balanced:
            family = self._rng.choice(sorted({f for f, _ in fresh}))
            fresh = [p for p in fresh if p[0] == family]
        return self._rng.choice(fresh)

    def _tournament(self, parents: list[tuple[float, Point]]) -> Point:
        contestants = self._rng.sample(parents, min(self.tournament, len(parents)))
        return min(contestants, key=lambda s: s[0])[1]

    def _crossover(self, a: Point, b: Point) -> dict[str, Any]:
        family, pa = a
        if b[0] != family:
            return dict(pa)
        return {k: (v if self._rng.random() < 0.5 else b[1][k]) for k, v in pa.items()}

    def _mutate(self, family: str, params: dict[str, Any]) -> dict[str, Any]:
        domains = self.domain.spaces[family].parameters
        names = list(params)
        chosen = [n for n in names if self._rng.random() < self.mutation]
        if not chosen:
            chosen = [self._rng.choice(names)]
        child = dict(params)
        for name in chosen:
            values = domains[name]
            if len(values) < 2:
                continue
            i = _index(values, child[name])
            if self._rng.random() < self.step and _ordered(values):
                j = i + self._rng.choice([d for d in (-1, 1) if 0 <= i + d < len(values)])
            else:
                j = self._rng.choice([k for k in range(len(values)) if k != i])
            child[name] = values[j]
        return child

    def _repair(self, family: str, child: dict[str, Any], seen: set[str]) -> Point | None:
        """The child if admitted and unseen, else the nearest such point of its family
        (ties broken at random), else any unseen point."""
        if (not self.domain.violations(family, child)
                and self.domain.identity(family, child) not in seen):
            return family, child
        points, identities, columns = self._encoded(family)
        distance = np.zeros(len(points))
        for n, (values, ordered, idx) in columns.items():  # declared order, as summed before
            i = _index(values, child[n])
            distance += np.abs(idx - i) / (len(values) - 1) if ordered else (idx != i)
        distance[[k for k, ident in enumerate(identities) if ident in seen]] = np.inf
        best_d = distance.min() if len(points) else np.inf
        if np.isfinite(best_d):
            best = [points[k] for k in np.flatnonzero(distance == best_d)]
            return family, self._rng.choice(best)
        return self._random_unseen(seen)

    def _encoded(self, family: str) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
        """The family's admitted points, their identities, and per parameter the index of
        each point's value (numpy), computed once: repair measures distances to all of them
        for every child, so this is the sampler's hot path."""
        if family not in self._encodings:
            points = self.domain.points[family]
            columns = {}
            for n, values in self.domain.spaces[family].parameters.items():
                ordered = _ordered(values) and len(values) > 1
                columns[n] = (values, ordered, np.array([_index(values, p[n]) for p in points]))
            self._encodings[family] = (
                points, [self.domain.identity(family, p) for p in points], columns)
        return self._encodings[family]


def _index(values: Sequence[Any], value: Any) -> int:
    for i, v in enumerate(values):
        if type(v) is type(value) and v == value:
            return i
    raise ValueError(f"{value!r} not in {values}")


def _ordered(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def make_sampler(name: str, domain: Domain, *, seed: int | None = None,
                 blocked: Callable[[], set[str]] = set,
                 seeds: Sequence[Point] = ()) -> BaseSampler:
    """The sampler for a strategy name in ``STRATEGIES``."""
    if name == "evo":
        return EvoSampler(domain, seed=seed, blocked=blocked, seeds=seeds)
    if name == "random":
        return EvoSampler(domain, seed=seed, blocked=blocked, random_only=True)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=16)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


def proposes_only_fresh(sampler: BaseSampler) -> bool:
    """Whether the sampler itself avoids rejected and seen points (ours do)."""
    return isinstance(sampler, EvoSampler)
