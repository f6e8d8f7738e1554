"""Tune for a model: search every call a model's attention makes, then export one module
that serves them all.

``plan`` turns a ``ModelGeometry`` (``evoengine.geometry``: heads, head dim, dtype, causal,
longest sequence, read from a Transformers ``config.json``) into the workloads of each
problem kind asked for, by default every kind the model makes calls of that a space serves
(``Problem.tune_workloads``: for the forward and the backward, the prefill ladder 256, 512, 1K,
2K, ... up to the model's maximum, ~16K tokens per call; ragged batches of the same tokens;
decode steps against 4K, 32K and the longest cache, for decoders), in
ladder order within each kind, so that each search is seeded by the elites of the rung
before it (the search seeds from the nearest workloads' elites first). ``tune`` runs one
search per workload, each its own study, ``<tune name>/<arch>-<workload key>``, then
exports one module (``export.export_best`` with ``cover=True``): the tuned kernels, plus each
compiled for the (dtype, causal) combinations the tune did not search, so the module
answers every call of the geometry.

The cross re-time. Once every workload is searched, each kind whose problem names the
off-ladder calls an entry serves (``Problem.cell_workloads``: the forward's and the
backward's) has each rung's entry chosen among its own and its neighbours' elites, timed on
the rung and a quarter octave either side (``evoengine.search.cross``): an entry serves a
whole cell of lengths, not only the one its search timed. ``cross=False`` (``--no-cross``)
skips it.

The budget. ``timeout_s``, less what is kept for the cross re-time where it runs (its estimate,
``CROSS_S_PER_RUNG`` a rung, within ``CROSS_SHARE`` and ``CROSS_MAX_SHARE`` of the timeout;
the cross re-time is not cut short), is split over the workloads not yet finished, each taking
``remaining x weight / (sum of the unfinished weights)`` when it starts, so time a search
leaves unspent (its domain exhausted) or overruns (its elites' final re-time comes after its
own timeout) is passed on to the ones after it. Weights are ``equal`` (the default: a
search's cost per trial is mostly compiling and validating, not the timed call, so equal
time gives each workload about as many trials) or ``flops`` (the workload's FLOPs: a
long-sequence call, where a model spends its time, gets the time). A share is never below
``MIN_SHARE_S``, so the whole may overrun by the re-times and that floor.

Resuming. A workload whose study has a run that ended ``done`` is finished and skipped; one
interrupted (Ctrl-C, a lost machine) is searched again under the same study, which resumes
it (nothing is measured twice). Running the same command again therefore continues where it
stopped and, once every workload is finished, only exports.

Contract: ``plan`` raises a one-line ``ValueError`` for a kind asked for that no problem or
space serves (by default such a kind is left out and named in the plan's notes);
``tune`` lets ``SearchError``/``EvaluatorError`` of a search through (nothing after it runs)
and returns status ``interrupted`` on Ctrl-C, without exporting.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from evoengine import paths
from evoengine.arch import Arch
from evoengine.geometry import ModelGeometry
from evoengine.problems import PROBLEMS, Rate, Workload, problem, problem_of
from evoengine.search import cross
from evoengine.search.evaluator import Evaluator
from evoengine.search.loop import SearchConfig, SearchResult, default_study, search
from evoengine.search.progress import Progress, Tally
from evoengine.space import SearchSpace, default_spaces, workload_names

SPLITS = ("equal", "flops")
MIN_SHARE_S = 10.0
DEFAULT_TIMEOUT_S = 30 * 60.0
# What of --timeout is kept for the cross re-time (evoengine.search.cross) when it runs: its
# estimate, CROSS_S_PER_RUNG a rung, at least CROSS_SHARE of the timeout and at most
# CROSS_MAX_SHARE (a short budget stays mostly the searches'). A rung took 7-20 s, 12 on
# average, in a d64 model's 10-minute tune on the H200 (10 rungs, 3-11 candidates on 5
# workloads each) and in tests/gpu/test_tune.py's (9 rungs, 2026-11-29): 118 s in all for
# the d64 model, where a tenth of the 10 minutes (60 s) had been kept.
CROSS_SHARE = 0.1
CROSS_S_PER_RUNG = 12.0
CROSS_MAX_SHARE = 0.3
# The rounds of a crossed kind's searches' own final re-time: the cross re-time times each
# rung's best again, with the anchors, on the rung and its cell, so the searches' re-time
# only orders their elites (a search's own default is 5 rounds).
CROSSED_FINAL_ROUNDS = 2

# (config, progress) -> result: ``search`` by default; tests and replays pass their own.
Searcher = Callable[[SearchConfig, Progress], SearchResult]


@dataclass(frozen=True)
class Part:
    """One workload of a tune, and the study that searches it."""

    workload: Workload
    study: str
    weight: float

    @property
    def kind(self) -> str:
        return type(self.workload).kind


@dataclass(frozen=True)
class TunePlan:
    """What ``tune`` will search: the workloads in order, with their studies and weights."""

    name: str
    geometry: ModelGeometry
    arch: Arch
    kinds: tuple[str, ...]
    parts: tuple[Part, ...]
    split: str = "equal"
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    trials: int | None = None  # per workload, instead of a time budget
    notes: tuple[str, ...] = ()  # what the plan left out, and why
    cross: bool = True  # re-time each rung's neighbours' elites over its cell, then export

    @property
    def crossed(self) -> tuple[str, ...]:
        """The kinds whose entries the cross re-time chooses (their problems name cells)."""
        if not self.cross:
            return ()
        return tuple(k for k in self.kinds
                     if sum(p.kind == k for p in self.parts) > 1
                     and problem(k).cell_workloads(next(p.workload for p in self.parts
                                                        if p.kind == k)))

    def cross_seconds(self) -> float:
        """The cross re-time's estimated seconds: CROSS_S_PER_RUNG for each rung it re-times."""
        crossed = self.crossed
        return CROSS_S_PER_RUNG * sum(p.kind in crossed for p in self.parts)

    def search_seconds(self) -> float | None:
        """What of the timeout the searches share: all of it but what is kept for the cross
        re-time (its estimate, within CROSS_SHARE and CROSS_MAX_SHARE of the timeout)."""
        if self.timeout_s is None:
            return None
        if not self.crossed:
            return self.timeout_s
        keep = min(max(CROSS_SHARE * self.timeout_s, self.cross_seconds()),
                   CROSS_MAX_SHARE * self.timeout_s)
        return self.timeout_s - keep

    def shares(self, seconds: float | None = None) -> list[float]:
        """Each part's share of ``seconds`` (default: the timeout), were all unfinished."""
        total = self.search_seconds() if seconds is None else seconds
        weights = sum(p.weight for p in self.parts)
        return [max(MIN_SHARE_S, (total or 0.0) * p.weight / weights) for p in self.parts]

    def describe(self) -> str:
        """The plan as a table: the geometry, then one line per workload with its share."""
        budget = (f"{self.trials} trials per workload" if self.trials is not None
                  else f"{self.timeout_s:.0f} s split {self.split}")
        lines = [f"tune {self.name} on {self.arch.name}: {self.geometry.describe()}",
                 *(f"  note: {n}" for n in (*self.geometry.notes, *self.notes)),
                 f"{len(self.parts)} workloads ({', '.join(self.kinds)}), {budget}:",
                 f"  {'#':>3} {'kind':<6} {'batch':>5} {'seq':>6} {'GFLOP':>9} "
                 f"{'budget':>8}  study"]
        shares = self.shares() if self.trials is None else [None] * len(self.parts)
        for i, (part, share) in enumerate(zip(self.parts, shares, strict=True), start=1):
            w = part.workload
            spend = f"{share:7.0f}s" if share is not None else f"{self.trials:>5} tr"
            # seq: the keys a query sees at most (decode: the cache; varlen: the longest)
            lines.append(f"  {i:>3} {part.kind:<6} {getattr(w, 'batch', '-'):>5} "
                         f"{getattr(w, 'seq_k', '-'):>6} {w.flops() / 1e9:9.1f} {spend:>8}  "
                         f"{part.study}")
        if self.crossed:
            lines.append(f"  then the cross re-time of {', '.join(self.crossed)} (each rung's "
                         f"and its neighbours' best {cross.PER_RUNG} on the rung and its cell"
                         + f", ~{self.cross_seconds():.0f} s)")
        return "\n".join(lines)


def device_arch(device: int = 0) -> Arch:
    """The target of CUDA device ``device``, asked of a child process: the tune's process,
    like the search's, never touches CUDA (its GPU workers are spawned processes, and the
    export compiles offline). ``ValueError`` naming why where there is no such GPU."""
    import subprocess

    from evoengine.arch import arch_of_capability

    probe = ("import sys, torch; d = int(sys.argv[1]); "
             "print(*torch.cuda.get_device_capability(d)) if torch.cuda.is_available() "
             "and d < torch.cuda.device_count() else sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", probe, str(device)], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise ValueError(f"no CUDA device {device} is visible to torch"
                         + (f": {done.stderr.strip().splitlines()[-1]}" if done.stderr.strip()
                            else ""))
    major, minor = (int(x) for x in done.stdout.split())
    return arch_of_capability(major, minor)


def study_name(name: str, arch: Arch, workload: Workload) -> str:
    """A tune's study for one workload: ``<tune name>/<arch>-<workload key>``."""
    return f"{name}/{default_study(arch, workload)}"


def spaces_for(kind: str, files: Sequence[str] | None = None) -> list[SearchSpace]:
    """The spaces a tune searches for ``kind``: those named (of that kind), else the shipped
    ones."""
    if files:
        return [s for s in (SearchSpace.load(f) for f in files) if s.serves(kind)]
    return default_spaces(kind)


def plan(geometry: ModelGeometry, arch: Arch, *, name: str,
         kinds: Sequence[str] | None = None, split: str = "equal",
         timeout_s: float | None = DEFAULT_TIMEOUT_S, trials: int | None = None,
         spaces: Sequence[str] | None = None, cross: bool = True) -> TunePlan:
    """The workloads to search for ``geometry`` on ``arch``; see the module docstring.
    ``kinds`` None: every kind the model makes calls of (``Problem.tune_workloads``) that
    some space serves on ``arch``, each left out named in the plan's notes."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not name or name.startswith("/") or "//" in name:
        raise ValueError(f"a tune name must be non-empty text, got {name!r}")
    asked = kinds is not None
    kinds = tuple(dict.fromkeys(kinds if asked else PROBLEMS))  # type: ignore[arg-type]
    if not kinds:
        raise ValueError("at least one kind to tune is needed (e.g. fwd or fwd,bwd)")
    notes: list[str] = []
    parts: list[Part] = []
    for kind in kinds:
        solver = problem(kind)  # an unknown kind: ValueError naming the known ones
        workloads = solver.tune_workloads(geometry)
        if not workloads:
            if asked:
                raise ValueError(f"{kind}: a {'causal' if geometry.causal else 'non-causal'} "
                                 f"model makes no {kind} calls to tune")
            notes.append(f"{kind}: the model makes no such calls")
            continue
        why = _why_unserved(kind, spaces_for(kind, spaces), workloads, arch)
        if why:
            if asked:
                raise ValueError(why)
            notes.append(f"{kind} left out: {why}")
            continue
        for w in workloads:
            parts.append(Part(w, study_name(name, arch, w),
                              w.flops() if split == "flops" else 1.0))
    if not parts:
        raise ValueError("no kind of call to tune: " + "; ".join(notes))
    kinds = tuple(dict.fromkeys(p.kind for p in parts))
    return TunePlan(name, geometry, arch, kinds, tuple(parts), split,
                    None if trials is not None else timeout_s, trials, tuple(notes), cross)


def _why_unserved(kind: str, spaces: list[SearchSpace], workloads: list[Workload],
                  arch: Arch) -> str:
    """Why no space serves the kind's workloads on ``arch`` (none targets it, or all rule its
    problem out); empty when one does."""
    mine = [s for s in spaces if s.supports(arch)]
    if not mine:
        return f"no {kind} search space targets {arch.name}"
    w = workloads[0]  # the problem (head dim, dtype, causal) is the same for all
    problem_ = w.problem()
    why = [s.problem_violations(problem_, arch) for s in mine]
    # A space whose constraints on the problem alone pass may still admit no point of it
    # (every tile's registers too many at d256, say): the search would stop on it mid-tune.
    facts = workload_names(w)
    for i, s in enumerate(mine):
        if not why[i] and s.first_admitted(problem_, arch, facts) is None:
            first = s.violations(next(s.grid()), problem_, arch)
            why[i] = [f"no point admitted (its first: {first[0] if first else 'a workload rule'})"]
    if all(why):
        return (f"no {kind} search space admits {w.key()} on {arch.name}: "
                + "; ".join(f"{s.family}: {b[0]}" for s, b in zip(mine, why, strict=True)))
    return ""


# ---- running it --------------------------------------------------------------------------

class TuneProgress(Progress):
    """The search's own live line, after where the whole tune stands:
    ``[3/12 b8-h32-...] tune 1234s left | trial 40 ...``."""

    def __init__(self, rate: Rate | float, *, position: str, deadline: float | None,
                 stream: TextIO | None = None, quiet: bool = False) -> None:
        super().__init__(rate, stream=stream, quiet=quiet)
        self.position = position
        self.deadline = deadline

    def line(self, t: Tally) -> str:
        left = ("" if self.deadline is None
                else f" tune {max(0.0, self.deadline - time.monotonic()):.0f}s left")
        return f"[{self.position}]{left} | {super().line(t)}"


@dataclass
class PartOutcome:
    part: Part
    status: str  # searched | skipped (finished before) | interrupted
    result: SearchResult | None = None
    seconds: float = 0.0
    budget_s: float | None = None


@dataclass
class TuneResult:
    plan: TunePlan
    status: str  # done | interrupted
    parts: list[PartOutcome] = field(default_factory=list)
    cells: list[cross.CellOutcome] = field(default_factory=list)  # the cross re-time's
    exported: Any = None  # export.Exported, once written

    def summary(self) -> str:
        searched = sum(p.status == "searched" for p in self.parts)
        skipped = sum(p.status == "skipped" for p in self.parts)
        text = (f"tune {self.plan.name} ({self.status}): {searched} workloads searched now, "
                f"{skipped} finished before, of {len(self.plan.parts)}")
        chosen = [c for c in self.cells if c.status == "chosen"]
        if chosen:
            moved = sum(c.order[0] != c.own for c in chosen)
            text += (f"; the cross re-time chose {len(chosen)} entries, {moved} of them "
                     "not their search's fastest")
        if self.exported is not None:
            text += f"\n{self.exported.summary()}"
        return text


def _gpu_evaluator(options: dict[str, Any] | None) -> Callable[[Workload], Evaluator]:
    """The cross re-time's evaluator: a GPU worker on the searches' (first) device."""
    from evoengine.search.worker import GpuEvaluator

    o = options or {}
    device = (o.get("gpus") or [o.get("device", 0)])[0]
    return lambda w: GpuEvaluator(w, device=device, timeout_s=o.get("eval_timeout_s", 30.0))


def finished_studies(store: str | None) -> dict[str, int]:
    """Study name -> id of a run that ended ``done``, for every such study in ``store``."""
    from evoengine.store import Store

    with Store(store) as s:
        return {r.study: r.id for r in sorted(s.runs(), key=lambda r: r.id)
                if r.study and r.status == "done"}


def tune(tp: TunePlan, *, store: str | None = None, output: str | Path | None = None,
         searcher: Searcher | None = None, spaces: Sequence[str] | None = None,
         options: dict[str, Any] | None = None, stream: TextIO | None = None,
         quiet: bool = False,
         cross_evaluator: Callable[[Workload], Evaluator] | None = None) -> TuneResult:
    """Search each unfinished workload of ``tp``, run the cross re-time of the kinds it
    chooses (``TunePlan.crossed``), then export to ``output`` (None: no export).
    ``options`` are further ``SearchConfig`` fields (seed, workers, devices...);
    ``searcher`` defaults to ``evoengine.search.search``, ``cross_evaluator(workload)`` to a
    ``GpuEvaluator`` on the search's first device."""
    stream = stream if stream is not None else sys.stderr
    if output is not None:  # refused now, not after the searches
        paths.output_file(output, "module")
    run = searcher or (lambda config, progress: search(config, progress=progress))
    result = TuneResult(tp, "done")
    seconds = tp.search_seconds()
    deadline = None if seconds is None else time.monotonic() + seconds
    finished = finished_studies(store)
    n = len(tp.parts)
    # How far each search has run past its budget: it re-times its elites with the anchors
    # after its timeout and starts its workers before it (19-30 s each in a 6-minute Llama
    # tune on the H100, whatever the budget). The mean is kept back from every part still to
    # run, so a tune of many short parts ends near its deadline, not one overrun per part past.
    overruns: list[float] = []
    for i, part in enumerate(tp.parts, start=1):
        where = f"{i}/{n} {part.kind} {part.workload.key()}"
        if part.study in finished:
            print(f"[{where}] finished before (run {finished[part.study]}): skipped",
                  file=stream)
            result.parts.append(PartOutcome(part, "skipped"))
            continue
        budget = None
        if deadline is not None:
            pending = [p.weight for p in tp.parts[i - 1:] if p.study not in finished]
            overrun = sum(overruns) / len(overruns) if overruns else 0.0
            left = deadline - time.monotonic() - overrun * len(pending)
            budget = max(MIN_SHARE_S, left * part.weight / sum(pending))
        print(f"[{where}] study {part.study}: "
              + (f"{budget:.0f} s" if budget is not None else f"{tp.trials} trials"),
              file=stream)
        settings = dict(options or {})
        if part.kind in tp.crossed:
            settings.setdefault("final_rounds", CROSSED_FINAL_ROUNDS)
        config = SearchConfig(workload=part.workload, spaces=spaces_for(part.kind, spaces),
                              arch=tp.arch, store=store, study=part.study, trials=tp.trials,
                              timeout_s=budget, **settings)
        rate = problem_of(part.workload).rate(part.workload)
        progress = TuneProgress(rate, position=where, deadline=deadline,
                                stream=stream, quiet=quiet)
        started = time.monotonic()
        found = run(config, progress)
        outcome = PartOutcome(part, "searched" if found.status == "done" else "interrupted",
                              found, time.monotonic() - started, budget)
        result.parts.append(outcome)
        if budget is not None:
            overruns.append(max(0.0, outcome.seconds - budget))
        best = f"{found.rows[0]['ours_us']:.1f} us" if found.rows else "no valid kernel"
        print(f"[{where}] {found.status} in {outcome.seconds:.0f} s"
              + (f" ({found.stopped_because})" if found.stopped_because else "")
              + f": best {best}", file=stream)
        if found.status != "done":
            result.status = "interrupted"
            return result
    for kind in tp.crossed:
        rungs = [p.workload for p in tp.parts if p.kind == kind]
        # the ladder's rungs and the latency calls are two series: each rung's neighbours
        # are of its own, plus the other series' rung at its lengths and that rung's either
        # side (cross.neighbours)
        series = [tp.geometry.is_latency_call(getattr(w, "batch", 0), getattr(w, "seq_q", 0))
                  for w in rungs]
        try:
            result.cells += cross.cross_retime(
                store, tp.arch, rungs, spaces_for(kind, spaces), tune=tp.name,
                evaluator=cross_evaluator or _gpu_evaluator(options), stream=stream,
                series=series)
        except KeyboardInterrupt:
            result.status = "interrupted"
            return result
    if output is not None:
        from evoengine.export import export_best

        result.exported = export_best(store, tp.arch, tune=tp.name, output=output, cover=True)
    return result
