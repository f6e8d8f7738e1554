"""Search spaces: parameters, their domains and the constraints checked before compiling.

A space is a TOML file under ``search_spaces/`` (see ``search_spaces/mma.toml``):

- ``family``, ``description``, ``archs``: which template it tunes and for which targets;
- ``kind``: the problem the family's kernels solve (``evoengine.problems``: ``"fwd"``, the
  default, or ``"bwd"``), or ``kinds``: the problems one template serves (``["fwd",
  "varlen"]``: the forward and ragged batches), the first being its main one.
  The forward search and ``default_spaces()`` take forward families only;
- ``[problem]``: the workload dimensions compiled into a kernel (head dim, dtype, causal).
  Results for different values are incomparable; the lists are the defaults that
  ``compile-check`` sweeps;
- ``[kind_problem.<kind>]``: the dimensions a kind of ``kinds`` adds to ``[problem]``, with
  the one value it gives each (``VARLEN = true``). Only that kind's problems name them, so
  the other kinds' candidates keep their identities; a template reads them with a default;
- ``[parameters]``: each searched parameter and its domain, in the order that names a
  candidate;
- ``[derived]``: named expressions computed from the above, in order (shared memory, ...);
- ``[[constraints]]``: a ``rule`` that must hold and ``why`` it must, so a rejected candidate
  says what it broke;
- ``[[workload_rules]]``: like constraints, but they may also read the workload's runtime
  facts (``KV_GROUP``: query heads per KV head), which no kernel compiles in. They never
  reject a kernel, only a point that would do another point's work for one workload (packing
  the heads of a group of one), so a search measures each kernel once; a ``Domain`` checks
  them, compile-check and the offline sweeps do not;
- ``[legacy]``: for a parameter added after points were measured, the value that builds the
  kernel as it was before the parameter existed. ``complete`` fills it into a stored point
  that lacks the parameter, so points measured before it stay valid, buildable and
  comparable with the points that have it;
- ``[untested]``: values of a parameter that the template builds and the offline checks
  passed but no GPU has run yet (a CPU-only session's work). The search never proposes them;
  ``with_untested()`` is the space that admits them, for the GPU tests that must pass before
  they move into ``[parameters]``.
- ``[retired]``: a parameter removed after points were measured with it (its other values
  lost to their twins), with the one value today's template still builds. ``complete`` drops
  it from a stored point that names that value, so the point keeps building what it measured;
  a point naming another value is rejected by ``violations``, never built as something else.

Expressions may read the problem, the parameters, earlier derived values and the target's
limits (``SM``, ``SMEM_LIMIT``, ``MAX_THREADS``, ``REGS_PER_SM``).
"""

from __future__ import annotations

import itertools
import random
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from evoengine import paths
from evoengine.arch import Arch, get_arch
from evoengine.expr import Expr, ExprError
from evoengine.workload import DEFAULT_KIND

_ARCH_NAMES = frozenset(("SM", "SMEM_LIMIT", "MAX_THREADS", "REGS_PER_SM"))
# What a workload says of itself that [[workload_rules]] read (``workload_names``).
_WORKLOAD_NAMES = frozenset(("KV_GROUP",))
_FAMILY_NAME = re.compile(r"[a-z][a-z0-9_]*")
_TOP_KEYS = {"family", "kind", "kinds", "description", "archs", "problem", "kind_problem",
             "parameters", "derived", "constraints", "workload_rules", "legacy", "untested",
             "retired"}


def _in_domain(value: object, domain: tuple[object, ...]) -> bool:
    """Membership by type and value: 64.0 is not 64, and True is not 1."""
    return any(type(value) is type(d) and value == d for d in domain)


class SpaceError(ValueError):
    """A search-space file is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Constraint:
    rule: Expr
    why: str


@dataclass(frozen=True)
class SearchSpace:
    family: str
    description: str
    archs: tuple[str, ...]
    problem: dict[str, tuple[object, ...]]
    parameters: dict[str, tuple[object, ...]]
    derived: dict[str, Expr]
    constraints: tuple[Constraint, ...]
    path: Path | None = field(default=None, compare=False)
    kind: str = DEFAULT_KIND
    legacy: dict[str, object] = field(default_factory=dict)
    kinds: tuple[str, ...] = ()  # every kind served, ``kind`` first; () is ``kind`` alone
    kind_problem: dict[str, dict[str, object]] = field(default_factory=dict)
    untested: dict[str, tuple[object, ...]] = field(default_factory=dict)
    workload_rules: tuple[Constraint, ...] = ()
    retired: dict[str, object] = field(default_factory=dict)

    def with_untested(self) -> SearchSpace:
        """This space with its ``[untested]`` values admitted (after each domain's own)."""
        return replace(self, untested={}, parameters={
            k: v + tuple(x for x in self.untested.get(k, ()) if not _in_domain(x, v))
            for k, v in self.parameters.items()})

    def serves(self, kind: str) -> bool:
        """Whether this family's kernels solve problems of ``kind``."""
        return kind in (self.kinds or (self.kind,))

    @classmethod
    def load(cls, path: str | Path) -> SearchSpace:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise SpaceError(f"{path}: no such search-space file") from None
        except tomllib.TOMLDecodeError as e:
            raise SpaceError(f"{path}: not valid TOML: {e}") from None
        return cls.from_dict(data, path=path)

    @classmethod
    def from_dict(cls, data: Mapping[str, object], path: Path | None = None) -> SearchSpace:
        where = str(path) if path else "search space"

        def fail(msg: str) -> SpaceError:
            return SpaceError(f"{where}: {msg}")

        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise fail(f"unknown keys {sorted(unknown)}; expected {sorted(_TOP_KEYS)}")
        for key in ("family", "archs", "problem", "parameters"):
            if key not in data:
                raise fail(f"missing {key!r}")
        family = data["family"]
        if (not isinstance(family, str) or not _FAMILY_NAME.fullmatch(family)
                or paths.family_dir(family) is None):
            raise fail(f"family {family!r} has no <family>/kernel.cu.j2 under "
                       f"{', '.join(map(str, paths.template_dirs()))}")
        # A name here; whether a problem of that kind exists is the registry's to say when
        # the space is used (evoengine.problems imports the runtime, which imports spaces).
        if "kind" in data and "kinds" in data:
            raise fail("name the problem kind once: kind = \"...\" or kinds = [...]")
        kinds = data.get("kinds", [data.get("kind", DEFAULT_KIND)])
        if not isinstance(kinds, list) or not kinds:
            raise fail(f"kinds must be a non-empty list of problem kinds, got {kinds!r}")
        for kind in kinds:
            if not isinstance(kind, str) or not _FAMILY_NAME.fullmatch(kind):
                raise fail(f"kind must be a problem kind's name (e.g. {DEFAULT_KIND!r}), "
                           f"got {kind!r}")
        if not isinstance(data["archs"], list) or not data["archs"]:
            raise fail("archs must be a non-empty list of target names")
        try:
            archs = tuple(get_arch(a).name for a in data["archs"])  # canonical names
        except (ValueError, AttributeError) as e:
            raise fail(f"archs: {e}") from None

        def domains(section: str) -> dict[str, tuple[object, ...]]:
            table = data[section]
            if not isinstance(table, dict):
                raise fail(f"[{section}] must be a table")
            out = {}
            for name, values in table.items():
                if not isinstance(values, list) or not values:
                    raise fail(f"{section}.{name} must be a non-empty list of values")
                out[name] = tuple(values)
            return out

        problem, parameters = domains("problem"), domains("parameters")
        clash = set(problem) & set(parameters)
        if clash:
            raise fail(f"names in both [problem] and [parameters]: {sorted(clash)}")
        kind_problem: dict[str, dict[str, object]] = {}
        table = data.get("kind_problem", {})
        if not isinstance(table, dict):
            raise fail("[kind_problem] must hold one table per kind: [kind_problem.<kind>]")
        for kind, dims in table.items():
            if kind not in kinds[1:]:
                raise fail(f"kind_problem.{kind}: not one of the kinds besides the first "
                           f"({kinds[1:]})")
            if not isinstance(dims, dict) or not dims:
                raise fail(f"kind_problem.{kind} must be a table of NAME = value")
            taken = set(dims) & (set(problem) | set(parameters))
            if taken:
                raise fail(f"kind_problem.{kind} names {sorted(taken)}, already declared")
            kind_problem[kind] = dict(dims)
        known = set(problem) | set(parameters) | _ARCH_NAMES
        derived: dict[str, Expr] = {}
        table = data.get("derived", {})
        if not isinstance(table, dict):
            raise fail("[derived] must be a table of name = \"expression\"")
        for name, text in table.items():
            if name in known:
                raise fail(f"derived.{name} shadows a parameter, problem or target name")
            derived[name] = cls._expr(text, known, fail, f"derived.{name}")
            known.add(name)

        def rules(section: str, names: set[str]) -> tuple[Constraint, ...]:
            entries = data.get(section, [])
            if not isinstance(entries, list):
                raise fail(f"{section} must be an array of tables ([[{section}]])")
            out = []
            for i, c in enumerate(entries):
                if not isinstance(c, dict) or set(c) != {"rule", "why"}:
                    raise fail(f"{section}[{i}] must have exactly 'rule' and 'why'")
                if not isinstance(c["why"], str) or not c["why"].strip():
                    raise fail(f"{section}[{i}].why must be a sentence saying why")
                out.append(Constraint(cls._expr(c["rule"], names, fail, c["rule"]), c["why"]))
            return tuple(out)

        constraints = rules("constraints", known)
        workload_rules = rules("workload_rules", known | _WORKLOAD_NAMES)
        legacy = data.get("legacy", {})
        if not isinstance(legacy, dict):
            raise fail("[legacy] must be a table of parameter = value")
        for name, value in legacy.items():
            if name not in parameters:
                raise fail(f"legacy.{name} is not a parameter")
            if not _in_domain(value, parameters[name]):
                raise fail(f"legacy.{name} = {value!r} is not in its domain {parameters[name]}")
        untested = domains("untested") if "untested" in data else {}
        for name, values in untested.items():
            if name not in parameters:
                raise fail(f"untested.{name} is not a parameter")
            both = [v for v in values if _in_domain(v, parameters[name])]
            if both:
                raise fail(f"untested.{name}: {both} already in its domain")
        retired = data.get("retired", {})
        if not isinstance(retired, dict):
            raise fail("[retired] must be a table of removed parameter = the value still built")
        for name in retired:
            if name in parameters or name in problem:
                raise fail(f"retired.{name} is still declared")
        return cls(family, str(data.get("description", "")), archs, problem, parameters,
                   derived, constraints, path, str(kinds[0]), dict(legacy),
                   tuple(kinds), kind_problem, untested, workload_rules, dict(retired))

    @staticmethod
    def _expr(text: object, known: set[str], fail, what: str) -> Expr:  # type: ignore[no-untyped-def]
        if not isinstance(text, str):
            raise fail(f"{what}: expected an expression string")
        try:
            expr = Expr(text)
        except ExprError as e:
            raise fail(f"{what}: {e}") from None
        missing = expr.names - known
        if missing:
            raise fail(f"{what}: unknown names {sorted(missing)}")
        return expr

    # ---- evaluation ---------------------------------------------------------------------

    def complete(self, params: Mapping[str, object]) -> dict[str, object]:
        """``params`` in declared order, with the legacy value of each parameter it lacks.

        A point stored before a parameter was added names the kernel that the parameter's
        legacy value builds: this is how every reader of stored points (export, the
        elites, the sampler's seeds, records) sees it. A parameter without a legacy value
        stays missing, for ``violations`` to report; a retired parameter at the value still
        built is dropped; other names the space does not declare are kept, after the declared
        ones.
        """
        out = {name: params[name] if name in params else self.legacy[name]
               for name in self.parameters if name in params or name in self.legacy}
        removed = self.removed(params)
        out.update((k, v) for k, v in params.items()
                   if k not in self.parameters and (k not in self.retired or k in removed))
        return out

    def removed(self, params: Mapping[str, object]) -> dict[str, object]:
        """The retired parameters ``params`` names at a value since removed (not the one the
        template still builds): a point no template of today builds."""
        return {k: v for k, v in params.items()
                if k in self.retired and not _in_domain(v, (self.retired[k],))}

    def supports(self, arch: Arch) -> bool:
        return arch.name in self.archs

    def env(self, params: Mapping[str, object], problem: Mapping[str, object],
            arch: Arch) -> dict[str, object]:
        """Every name a constraint can see, derived values included."""
        env: dict[str, object] = {**arch.as_names(), **problem, **params}
        for name, expr in self.derived.items():
            env[name] = expr(env)
        return env

    def violations(self, params: Mapping[str, object], problem: Mapping[str, object],
                   arch: Arch) -> list[str]:
        """The ``why`` of every constraint the candidate breaks; empty when admitted."""
        if not self.supports(arch):
            return [f"family {self.family} does not target {arch.name}"]
        bad = [f"{k}={v!r} not in {self.parameters[k]}" for k, v in params.items()
               if k in self.parameters and not _in_domain(v, self.parameters[k])]
        bad += [f"{k}={v!r} not a problem value of type {type(self.problem[k][0]).__name__}"
                for k, v in problem.items()
                if k in self.problem and type(v) is not type(self.problem[k][0])]
        bad += [f"{k}={v!r} was retired: only {self.retired[k]!r} is built now"
                for k, v in self.removed(params).items()]
        missing = set(self.parameters) - set(params)
        if missing:
            bad.append(f"missing parameters {sorted(missing)}")
        if bad:
            return bad
        env = self.env(params, problem, arch)
        return [f"{c.why} ({c.rule.text})" for c in self.constraints if not c.rule(env)]

    def workload_violations(self, params: Mapping[str, object], problem: Mapping[str, object],
                            arch: Arch, workload: Mapping[str, object]) -> list[str]:
        """The ``why`` of every ``[[workload_rules]]`` entry an admitted point breaks for a
        workload whose runtime facts are ``workload`` (``workload_names``)."""
        if not self.workload_rules:
            return []
        env = {**self.env(params, problem, arch), **workload}
        return [f"{c.why} ({c.rule.text})" for c in self.workload_rules if not c.rule(env)]

    def problem_violations(self, problem: Mapping[str, object], arch: Arch) -> list[str]:
        """The ``why`` of every constraint that reads only problem and target names and rejects
        ``problem`` on ``arch`` (``HEAD_DIM % 16 == 0``, say): microseconds, where asking for
        an admitted point scans the whole grid. Empty does not mean a point fits."""
        env = {**arch.as_names(), **problem}
        return [f"{c.why} ({c.rule.text})" for c in self.constraints
                if c.rule.names <= env.keys() and not c.rule(env)]

    def problems(self, kind: str | None = None,
                 head_dims: Sequence[int] | None = None) -> Iterator[dict[str, object]]:
        """Every combination of the default problem dimensions, with those ``kind`` adds
        (``[kind_problem.<kind>]``; None: the main kind's, which add none); ``head_dims``, where
        given, in place of ``[problem]``'s HEAD_DIM values."""
        extra = self.kind_problem.get(kind, {}) if kind is not None else {}
        dims = dict(self.problem)
        if head_dims is not None and "HEAD_DIM" in dims:
            dims["HEAD_DIM"] = tuple(dict.fromkeys(head_dims))
        for values in itertools.product(*dims.values()):
            yield {**dict(zip(dims, values, strict=True)), **extra}

    def problem_names_ok(self, names: set[str]) -> bool:
        """Whether a problem naming ``names`` is one of this space's kinds': ``[problem]``,
        plus exactly what one kind adds."""
        extra = names - set(self.problem)
        return set(self.problem) <= names and (
            not extra or any(extra == set(d) for d in self.kind_problem.values()))

    def grid(self) -> Iterator[dict[str, object]]:
        """Every parameter combination, admitted or not, in declared order."""
        for values in itertools.product(*self.parameters.values()):
            yield dict(zip(self.parameters, values, strict=True))

    def admitted(self, problem: Mapping[str, object], arch: Arch) -> list[dict[str, object]]:
        return list(self.iter_admitted(problem, arch))

    def iter_admitted(self, problem: Mapping[str, object], arch: Arch,
                      workload: Mapping[str, object] | None = None,
                      ) -> Iterator[dict[str, object]]:
        """The points admitted for ``problem``, in declared order, lazily; given a workload's
        facts (``workload_names``), only those its ``[[workload_rules]]`` admit too.

        The grid is walked one parameter at a time in declared order, and each constraint is
        checked as soon as every parameter it reads (through derived values) has its value: a
        prefix that breaks one is never extended. The same points as checking ``violations``
        on every grid point, in the same order, without visiting most of the grid."""
        if not self.supports(arch) or any(
                k in self.problem and type(v) is not type(self.problem[k][0])
                for k, v in problem.items()):
            return
        names = list(self.parameters)
        depth = {name: i for i, name in enumerate(names)}
        reads: dict[str, int] = {}  # a derived value's deepest parameter read (-1: none)

        def deepest(expr: Expr) -> int:
            return max((depth[n] if n in depth else reads.get(n, -1) for n in expr.names),
                       default=-1)
        derived_at: list[list[str]] = [[] for _ in range(len(names) + 1)]
        for name, expr in self.derived.items():  # declared order: each reads earlier ones
            reads[name] = deepest(expr)
            derived_at[reads[name] + 1].append(name)
        checks_at: list[list[Constraint]] = [[] for _ in range(len(names) + 1)]
        for c in self.constraints:
            checks_at[deepest(c.rule) + 1].append(c)

        def step(level: int, env: dict[str, object]) -> bool:
            for name in derived_at[level]:
                env[name] = self.derived[name](env)
            return all(c.rule(env) for c in checks_at[level])

        def walk(level: int, env: dict[str, object]) -> Iterator[dict[str, object]]:
            if level == len(names):
                yield {n: env[n] for n in names}
                return
            for value in self.parameters[names[level]]:
                nxt = {**env, names[level]: value}
                if step(level + 1, nxt):
                    yield from walk(level + 1, nxt)

        root: dict[str, object] = {**arch.as_names(), **problem}
        if not step(0, root):
            return
        for p in walk(0, root):
            if workload is None or not self.workload_violations(p, problem, arch, workload):
                yield p

    def first_admitted(self, problem: Mapping[str, object], arch: Arch,
                       workload: Mapping[str, object] | None = None) -> dict[str, object] | None:
        """The first of ``iter_admitted``, or None: asking whether a problem has any point
        costs milliseconds unless it has none."""
        return next(self.iter_admitted(problem, arch, workload), None)

    def nearest_admitted(self, params: Mapping[str, object], problem: Mapping[str, object],
                         arch: Arch) -> dict[str, object] | None:
        """``params`` where admitted for ``problem``, else the admitted point nearest it (a
        changed ordered value costs its distance in steps over the domain's span, any other
        changed value 1; ties: the first in declared order); None where none is admitted.
        An export covers a problem it has no tuned kernel for this way (the causal kernel's
        tile order has no meaning without a mask, say)."""
        params = self.complete(params)
        if not self.violations(params, problem, arch):
            return dict(params)

        def distance(point: Mapping[str, object]) -> float:
            d = 0.0
            for name, values in self.parameters.items():
                a, b = params.get(name), point[name]
                if type(a) is type(b) and a == b:
                    continue
                ordered = all(isinstance(v, int | float) and not isinstance(v, bool)
                              for v in values) and len(values) > 1 and a in values
                d += (abs(values.index(a) - values.index(b)) / (len(values) - 1)
                      if ordered else 1.0)
            return d

        return min(self.admitted(problem, arch), key=distance, default=None)

    def size(self) -> int:
        n = 1
        for values in self.parameters.values():
            n *= len(values)
        return n


class _Grouped(Protocol):  # every problem's workload (evoengine.problems.base.Workload)
    @property
    def kv_group(self) -> int: ...


def workload_names(workload: _Grouped) -> dict[str, object]:
    """What ``workload`` says of itself that ``[[workload_rules]]`` read (``_WORKLOAD_NAMES``)."""
    return {"KV_GROUP": workload.kv_group}


def default_spaces(kind: str | None = DEFAULT_KIND) -> list[SearchSpace]:
    """Every space shipped under ``search_spaces/`` that serves ``kind`` (all of them for
    None): the forward search never mixes in a backward family."""
    spaces = [SearchSpace.load(p) for p in sorted(paths.SPACES.glob("*.toml"))]
    return [s for s in spaces if kind is None or s.serves(kind)]


def sample(items: list, n: int | None, seed: int = 0) -> list:
    """A deterministic spread of ``n`` items (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(items):
        return list(items)
    return random.Random(seed).sample(items, n)


def spread(spaces: list[SearchSpace], arch: Arch, limit: int | None, seed: int = 0,
           head_dims: Sequence[int] | None = None,
           ) -> list[tuple[SearchSpace, dict[str, object], dict[str, object]]]:
    """Admitted (space, problem, params) points for ``arch``, spread evenly over families and
    problems (``head_dims``: of these head dims, not the spaces' own): each (space, problem)
    group is shuffled with ``seed`` and the groups are dealt round-robin, so the first
    ``limit`` points cover them all."""
    groups = []
    for i, space in enumerate(s for s in spaces if s.supports(arch)):
        for j, problem in enumerate(space.problems(head_dims=head_dims)):
            points = space.admitted(problem, arch)
            random.Random(f"{seed}-{i}-{j}").shuffle(points)
            groups.append(((j, i), [(space, problem, p) for p in points]))
    groups = [g for _, g in sorted(groups, key=lambda kg: kg[0])]  # alternate families first
    dealt = [g[k] for k in range(max(map(len, groups), default=0)) for g in groups if k < len(g)]
    return dealt if limit is None else dealt[:limit]
