"""What one search may try: the admitted points of every family for one workload and target.

Optuna sees the domain as one categorical ``family`` plus, per family, its parameters named
``<family>.<PARAM>`` with their declared domains; only the chosen family's parameters are
suggested in a trial, so the dashboard shows exactly the point that was built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from evoengine.arch import Arch
from evoengine.render import Candidate, make_candidate, make_identity
from evoengine.space import SearchSpace, workload_names
from evoengine.workload import Workload

if TYPE_CHECKING:
    import optuna

FAMILY = "family"

Point = tuple[str, dict[str, Any]]  # (family, parameters in declared order)


class Domain:
    """The admitted points of ``spaces`` for ``workload`` on ``arch``.

    Raises ``ValueError`` when no space targets the arch or none admits a point.
    """

    renders = True  # whether the search stores each candidate's rendered source

    def __init__(self, spaces: Iterable[SearchSpace], workload: Workload, arch: Arch) -> None:
        self.workload = workload
        self.arch = arch
        self.problem = workload.problem()
        self.facts = workload_names(workload)
        self.spaces: dict[str, SearchSpace] = {}
        self.points: dict[str, list[dict[str, Any]]] = {}
        for space in spaces:
            if (not space.serves(workload.kind) or not space.supports(arch)
                    or space.family in self.spaces):
                continue  # another problem's family, another target's, or named twice
            admitted = list(space.iter_admitted(self.problem, arch, self.facts))
            if admitted:
                self.spaces[space.family] = space
                self.points[space.family] = admitted
        if not self.spaces:
            raise ValueError(f"no search space admits a candidate for {workload.key()} on "
                             f"{arch.name}")
        self._identities = {self.identity(f, p): (f, p)
                            for f, pts in self.points.items() for p in pts}

    @property
    def families(self) -> list[str]:
        return list(self.spaces)

    def __len__(self) -> int:
        return len(self._identities)

    def all_points(self) -> list[Point]:
        return list(self._identities.values())

    def items(self) -> list[tuple[str, Point]]:
        """``(identity, point)`` of every admitted point."""
        return list(self._identities.items())

    def identity(self, family: str, params: Mapping[str, Any]) -> str:
        """The identity of the point ``params`` names, a stored point that lacks parameters
        added since it was measured included (``SearchSpace.complete``). One that names a
        retired parameter's removed value keeps it in its identity, which no admitted point
        has."""
        space = self.spaces[family]
        params = space.complete(params)
        named = {**{k: params[k] for k in space.parameters}, **space.removed(params)}
        return make_identity(family, self.problem, named)

    def point(self, identity: str) -> Point | None:
        """The admitted point with this identity, or None."""
        return self._identities.get(identity)

    def violations(self, family: str, params: Mapping[str, Any]) -> list[str]:
        if family not in self.spaces:
            return [f"family {family!r} is not searched here ({', '.join(self.spaces)})"]
        space = self.spaces[family]
        return (space.violations(params, self.problem, self.arch)
                or space.workload_violations(params, self.problem, self.arch, self.facts))

    def candidate(self, family: str, params: Mapping[str, Any]) -> Candidate:
        """The buildable candidate; ``ValueError`` if the constraints reject the point."""
        return make_candidate(self.spaces[family], params, self.problem, self.arch)

    # ---- Optuna's view ------------------------------------------------------------------

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        from optuna.distributions import CategoricalDistribution

        out: dict[str, optuna.distributions.BaseDistribution] = {
            FAMILY: CategoricalDistribution(self.families)}
        for family, space in self.spaces.items():
            for name, values in space.parameters.items():
                out[f"{family}.{name}"] = CategoricalDistribution(list(values))
        return out

    def to_trial_params(self, family: str, params: Mapping[str, Any]) -> dict[str, Any]:
        return {FAMILY: family, **{f"{family}.{k}": v for k, v in params.items()}}

    def from_trial_params(self, params: Mapping[str, Any]) -> Point | None:
        """The point a trial's parameters name, or None when they are incomplete."""
        family = params.get(FAMILY)
        if family not in self.spaces:
            return None
        names = self.spaces[family].parameters
        if any(f"{family}.{n}" not in params for n in names):
            return None
        return family, {n: params[f"{family}.{n}"] for n in names}

    def suggest(self, trial: optuna.trial.BaseTrial) -> Point:
        """Ask the trial for a family and that family's parameters."""
        dists = self.distributions()
        family = trial.suggest_categorical(FAMILY, dists[FAMILY].choices)  # type: ignore[attr-defined]
        params = {n: trial.suggest_categorical(f"{family}.{n}",
                                               dists[f"{family}.{n}"].choices)  # type: ignore[attr-defined]
                  for n in self.spaces[str(family)].parameters}
        return str(family), params
