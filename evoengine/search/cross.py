"""The cross re-time: choose each tuned entry among its neighbours' elites, timed over the
lengths the entry will serve.

An exported module serves a call with the entry tuned nearest its lengths
(``launch.dispatch.nearest``), so the entry of ladder rung ``S`` answers every call between
``S/sqrt 2`` and ``S sqrt 2``, most of them at lengths no tile divides. A search ranks its
points on the rung alone, and a short one can end on a point that is fast there and slow a
little way off (on the H100 a 100 s search's rank 1 at 16 x 1024 ran 11 x 1225 at 0.96x
cuDNN). ``cross_retime`` therefore takes, for each rung of one kind, the best
``PER_RUNG`` elites of the rung and of the rungs either side in its series (a tune's
ladder, or its latency calls: ``geometry.ModelGeometry``) and of the other series' rung at
its lengths and that rung's either side (the ladder's and the latency call's entries at one
length share its calls by batch x heads: ``neighbours``), times them all interleaved on
the rung and on its cell's off-ladder workloads (``Problem.cell_workloads``: a quarter octave
below and above, odd lengths, at the rung's tokens and a quarter of them), next to the
problem's anchors as a search's final re-time
does, and ranks them by the geometric mean over those workloads of their time over the
fastest one's. Rank 1 becomes the rung's entry. Kinds with no cell workloads are left as
their searches ranked them.

What it writes. Per timed workload, a run of study ``<tune>/cross/<arch>-<workload key>``
holding each candidate's time as a ``final``-phase measurement with the anchors' times (as
a search's final re-time; ``evoengine report`` shows them). The rung's own run, written
last, then holds the rung's elites, replaced in the order chosen, each with its time on the
rung; a later search of the rung ranks them by time again. A rung whose own cross run ended
``done`` is skipped, so a tune run again resumes here too.

Contract: ``cross_retime`` never changes a measurement, only the elites of the rungs it
finishes; it raises ``EvaluatorError`` when the device cannot be used, and lets
``KeyboardInterrupt`` through (a rung left unfinished keeps its search's elites).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.problems import Workload, problem_of
from evoengine.provenance import git_commit
from evoengine.render import Candidate
from evoengine.search.domain import Domain
from evoengine.search.evaluator import DeviceInfo, Evaluator
from evoengine.search.evidence import anchor_times, versions
from evoengine.space import SearchSpace
from evoengine.store import Store

PER_RUNG = 2  # elites taken from the rung and from each neighbour
CROSS_ROUNDS = 2  # interleaved rounds per timed workload


@dataclass
class CellOutcome:
    """What the cross re-time did for one rung."""

    rung: Workload
    status: str  # chosen | kept (nothing to choose from) | skipped (finished before)
    order: list[str] = field(default_factory=list)  # identities, the chosen first
    scores: dict[str, float] = field(default_factory=dict)  # identity: geomean vs fastest
    own: str | None = None  # the search's rank 1
    seconds: float = 0.0

    def line(self) -> str:
        if self.status != "chosen":
            return self.status
        best = self.order[0]
        if best == self.own:
            return f"kept the search's rank 1 ({self.scores[best]:.3f}x the fastest)"
        was = self.scores.get(self.own or "", math.nan)
        return (f"chose {best} ({self.scores[best]:.3f}x the fastest over the cell; the "
                f"search's rank 1 {was:.3f}x)")


def cross_study(tune: str, arch: Arch, workload: Workload) -> str:
    return f"{tune}/cross/{arch.name}-{workload.key()}"


def is_cross_study(study: str) -> bool:
    """Whether ``study`` names a cross re-time's runs (``cross_study``), not a search."""
    return "/cross/" in study


def neighbours(series: Sequence[object], i: int,
               lengths: Sequence[object] | None = None) -> list[int]:
    """Rung ``i``, then the nearest rung before it and after it in the same series
    (``series[j]``: rung ``j``'s); then, for each rung of another series at rung ``i``'s
    lengths (``lengths[j]``: rung ``j``'s; None matches nothing), that rung and the nearest
    either side of it in its own series. An entry serves the calls of its lengths nearest its
    own batch x heads, so the entries of two series at one length split those calls between
    them: a latency call's entry serves calls of a few sequences, where the ladder's kernels
    can be the faster (docs/NOTES.md, "calls of a few sequences")."""
    def around(j: int) -> list[int]:
        same = [x for x, s in enumerate(series) if s == series[j]]
        k = same.index(j)
        return [j, *same[max(0, k - 1):k], *same[k + 1:k + 2]]

    out = around(i)
    if lengths is not None and lengths[i] is not None:
        for j, s in enumerate(series):
            if s != series[i] and lengths[j] == lengths[i]:
                out += [x for x in around(j) if x not in out]
    return out


def _lengths(workload: Workload) -> tuple[int, int] | None:
    """A rung's (seq_q, seq_k), or None for a kind whose workload has no such lengths."""
    seq_q, seq_k = getattr(workload, "seq_q", None), getattr(workload, "seq_k", None)
    return None if seq_q is None or seq_k is None else (seq_q, seq_k)


def candidates_for(store: Store, arch: Arch, rungs: Sequence[Workload], i: int,
                   series: Sequence[object] | None = None) -> list[str]:
    """Identities to time for rung ``i``: the best ``PER_RUNG`` elites of it, then of the
    rung before and the rung after in its series (default: one series), then of each other
    series' rung at its lengths and of the rungs either side of that one, each once."""
    out: list[str] = []
    for j in neighbours(series or [0] * len(rungs), i, [_lengths(w) for w in rungs]):
        for e in store.elites(arch=arch.name, workload_key=rungs[j].key())[:PER_RUNG]:
            if e.identity not in out:
                out.append(e.identity)
    return out


def cross_retime(store_url: str | None, arch: Arch, rungs: Sequence[Workload],
                 spaces: Sequence[SearchSpace], *, tune: str,
                 evaluator: Callable[[Workload], Evaluator],
                 compile_fn: Callable[[Candidate, str], CompileResult] = compile_candidate,
                 rounds: int = CROSS_ROUNDS, stream: TextIO | None = None,
                 series: Sequence[object] | None = None) -> list[CellOutcome]:
    """Choose the entry of each of ``rungs`` (one kind's tuned workloads, in ladder order:
    each rung's neighbours are the ones either side of the same ``series`` label, default
    one series); see the module docstring. ``evaluator(first workload)`` gives the
    (unstarted) evaluator that times them all."""
    if series is not None and len(series) != len(rungs):
        raise ValueError(f"{len(series)} series labels for {len(rungs)} rungs")
    outcomes: list[CellOutcome] = []
    if not rungs:
        return outcomes
    problem = problem_of(rungs[0])
    cells = [problem.cell_workloads(w) for w in rungs]
    if not any(cells):
        return outcomes
    domain = Domain(spaces, rungs[0], arch)  # the kind's problem: one for every rung
    ev: Evaluator | None = None
    info: DeviceInfo | None = None
    with Store(store_url) as store:
        done = {r.study for r in store.runs() if r.status == "done" and r.study}
        try:
            for i, rung in enumerate(rungs):
                started = time.monotonic()
                where = f"cross {i + 1}/{len(rungs)} {rung.key()}"
                if cross_study(tune, arch, rung) in done:
                    outcomes.append(CellOutcome(rung, "skipped"))
                    _say(stream, f"[{where}] finished before: skipped")
                    continue
                entries = _entries(store, domain,
                                   candidates_for(store, arch, rungs, i, series), compile_fn)
                own = next((e.identity for e in store.elites(arch=arch.name,
                                                             workload_key=rung.key())), None)
                if len(entries) < 2 or not cells[i]:
                    outcomes.append(CellOutcome(rung, "kept", own=own))
                    _say(stream, f"[{where}] {len(entries)} candidate(s): kept")
                    continue
                if ev is None:
                    ev = evaluator(rung)
                    info = ev.start()
                assert info is not None
                times: dict[str, list[float]] = {c.identity: [] for c, _ in entries}
                on_rung: dict[str, float] = {}
                # the off-ladder workloads first: the rung's run, holding the elites, is last
                for w in (*cells[i], rung):
                    timed = ev.final_on(w, entries, rounds)
                    run_id = store.start_run(arch=arch.name, workload=w.to_dict(),
                                             workload_key=w.key(), device=info.name,
                                             versions=versions(info), commit=git_commit(),
                                             study=cross_study(tune, arch, w))
                    for (c, _), t in zip(entries, timed["candidates"], strict=True):
                        if "median_us" not in t:
                            continue
                        times[c.identity].append(t["median_us"])
                        if w is rung:
                            on_rung[c.identity] = t["median_us"]
                        store.add_measurement(run_id, c.identity, ok=True,
                                              median_us=t["median_us"],
                                              spread_us=t["spread_us"],
                                              tflops=w.flops() / t["median_us"] / 1e6,
                                              extra={"phase": "final", "rounds": t.get("rounds"),
                                                     "cross": rung.key(),
                                                     **anchor_times(timed)})
                    if w is not rung:
                        store.finish_run(run_id)
                n = len(cells[i]) + 1
                scores = _scores({k: v for k, v in times.items() if len(v) == n}, n)
                order = sorted(scores, key=lambda k: (scores[k], on_rung[k]))
                if order:
                    store.set_elites(arch=arch.name, workload_key=rung.key(),
                                     entries=[(k, on_rung[k]) for k in order], run_id=run_id)
                store.finish_run(run_id)
                out = CellOutcome(rung, "chosen" if order else "kept", order, scores, own,
                                  time.monotonic() - started)
                outcomes.append(out)
                _say(stream, f"[{where}] {len(entries)} candidates on {n} workloads in "
                             f"{out.seconds:.0f} s: {out.line()}")
        finally:
            if ev is not None:
                ev.close()
    return outcomes


def _entries(store: Store, domain: Domain, identities: list[str],
             compile_fn: Callable[[Candidate, str], CompileResult],
             ) -> list[tuple[Candidate, CompileResult]]:
    """The identities the current spaces still admit, built (the disk cache has them)."""
    out = []
    for identity in identities:
        record = store.candidate(identity)
        if record is None or record.family not in domain.spaces:
            continue
        point = domain.point(domain.identity(record.family, record.params))
        if point is None:
            continue
        candidate = domain.candidate(*point)
        compiled = compile_fn(candidate, domain.arch.name)
        if compiled.ok:
            out.append((candidate, compiled))
    return out


def _scores(times: dict[str, list[float]], n: int) -> dict[str, float]:
    """Each candidate's geometric mean, over the ``n`` workloads, of its time over the
    fastest candidate's there."""
    if not times:
        return {}
    fastest = [min(v[j] for v in times.values()) for j in range(n)]
    return {k: math.exp(sum(math.log(t / f) for t, f in zip(v, fastest, strict=True)) / n)
            for k, v in times.items()}


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
