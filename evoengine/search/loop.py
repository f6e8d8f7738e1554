"""The search loop: propose, compile ahead in worker processes, evaluate on the GPU workers,
record, repeat; then re-time the elites next to SDPA.

The loop schedules; each other concern has a module of its own, which the loop calls in a
fixed order: ``study`` (the adapter to Optuna: trials are created, heartbeat and end only
there), ``coordination`` (claims, heartbeats and the view of other workers), ``evidence``
(what is written to the store, and the results document), ``evaluator`` (the devices).

The store is the state. Optuna's study lives in the same database (its own tables beside
the ``evo_*`` ones), every measurement is written as it is taken, and the elites are
rewritten whenever they change, so an interrupted search loses at most the trials that were
still compiling, and running the same study again resumes it.

Many GPUs, many hosts. ``SearchConfig.gpus`` gives one process one evaluator per local GPU,
each driven by its own thread, all fed by the one compile pool and one sampler: the
process's cores compile for every GPU (N processes on one host would each want cores-1
compilers, or a split by hand), the sampler sees every point in flight, and all database
writes stay on the main thread. Each GPU keeps its own worker process, so a fault or hang
costs one trial on that GPU only. Other hosts run the same search on the same store URL
(PostgreSQL) and join the study; ``coordination`` says how they share it.

Contract of ``search``: it raises ``SearchError`` when it cannot run as asked (and before
anything is measured), ``EvaluatorError`` when a device cannot be used, and lets store
errors through; a candidate's failure (compile error, wrong answer, fault, hang) is a
stored result, never an exception. Ctrl-C (``KeyboardInterrupt``) ends it cleanly with
status ``interrupted``. It never mutates its config, spaces or domain, and closes only the
evaluators it created.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from typing import Any

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate, is_cached
from evoengine.problems import problem_of
from evoengine.render import Candidate
from evoengine.search.coordination import Coordination
from evoengine.search.domain import Domain, Point
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator
from evoengine.search.evidence import ANCHOR_KEYS, Evidence, results_document
from evoengine.search.progress import Progress, Tally
from evoengine.search.samplers import NOT_EVALUATED, make_sampler
from evoengine.search.seeds import seeds_by_origin
from evoengine.search.study import SearchStudy, open_storage, quiet_optuna
from evoengine.search.worker import GpuEvaluator
from evoengine.space import SearchSpace
from evoengine.store import ClaimLost, Store
from evoengine.workload import Workload

ELITES = 5
FINAL_ROUNDS = 5
# Optuna samplers may keep proposing rejected or measured points; give up after this many
# proposals in a row that needed no evaluation.
MAX_IDLE_PROPOSALS = 500


class SearchError(RuntimeError):
    """The search cannot run as asked (wrong arch for the device, study mismatch...)."""


@dataclass
class SearchConfig:
    workload: Workload
    spaces: Sequence[SearchSpace]
    arch: Arch | None = None  # None: the device's own target
    store: str | None = None  # SQLAlchemy URL; None: sqlite:///runs/evoengine.db
    study: str | None = None  # None: derived from arch and workload
    strategy: str = "evo"
    trials: int | None = None
    timeout_s: float | None = None
    # Stop starting trials once the store holds a valid time at or below this (the
    # strategies benchmark's target); None: spend the whole budget.
    target_us: float | None = None
    seed: int | None = None
    compile_workers: int | None = None  # None: all cores but one
    eval_timeout_s: float = 30.0
    device: int = 0
    gpus: Sequence[int] | None = None  # one evaluator per device; None: ``device`` alone
    elites: int = ELITES
    final_rounds: int = FINAL_ROUNDS
    # Optuna's heartbeat: a RUNNING trial with no heartbeat for grace_s is failed (by any
    # worker of the study, checked every heartbeat_s) and its point may be taken again.
    heartbeat_s: int = 60
    grace_s: int = 180
    refresh_s: float = 10.0  # how often other workers' claims are read back for the sampler
    priors: bool = False  # seed with the target's shipped priors too (the CLI's default)

    def devices(self) -> list[int]:
        return list(self.gpus) if self.gpus else [self.device]


@dataclass
class SearchResult:
    run_id: int
    study: str
    arch: str
    workload: Workload
    device: DeviceInfo
    tally: Tally
    status: str  # done | interrupted
    rows: list[dict[str, Any]] = field(default_factory=list)  # final elites, fastest first
    stopped_because: str = ""

    def evidence(self) -> dict[str, Any]:
        """The run as the results JSON of ``benchmarks/results/``."""
        return results_document(device=self.device, workload=self.workload, study=self.study,
                                run_id=self.run_id, tally=self.tally, rows=self.rows)


@dataclass
class _Gpu:
    """One device's evaluator and the thread that drives it."""

    device: int
    evaluator: Evaluator
    thread: ThreadPoolExecutor
    busy: bool = False


@dataclass
class _Pending:
    trial: Any  # optuna.Trial
    family: str
    params: dict[str, Any]
    candidate: Candidate
    cached: bool


def default_study(arch: Arch, workload: Workload) -> str:
    return f"{arch.name}-{workload.key()}"


def search(config: SearchConfig, *, evaluator: Evaluator | Sequence[Evaluator] | None = None,
           progress: Progress | None = None,
           compile_fn: Callable[[Candidate, str], CompileResult] = compile_candidate,
           domain: Domain | None = None) -> SearchResult:
    """Run (or resume) a search; see the module docstring. Ctrl-C stops it cleanly.

    ``evaluator`` defaults to a ``GpuEvaluator`` on each of ``config.devices()``; a sequence
    gives one evaluator per device (the first re-times the elites). ``compile_fn`` (run in
    the compiler processes, so a module-level function or a picklable object) defaults to
    NVRTC with the disk cache. ``domain`` defaults to every admitted point of
    ``config.spaces``; it must be of ``config.workload`` and the search's arch. Tests and the
    replay (``search.replay``) replace them to run the loop without a GPU.
    """
    with quiet_optuna():
        return _search(config, evaluator, progress, compile_fn, domain)


def _search(config: SearchConfig, evaluator: Evaluator | Sequence[Evaluator] | None,
            progress: Progress | None, compile_fn: Callable[[Candidate, str], CompileResult],
            domain: Domain | None) -> SearchResult:
    w = config.workload
    devices = config.devices()
    if len(set(devices)) != len(devices):
        raise SearchError(f"GPUs {devices} name a device twice")
    own_evaluator = evaluator is None
    if evaluator is None:
        evaluators: list[Evaluator] = [GpuEvaluator(w, device=d, timeout_s=config.eval_timeout_s)
                                       for d in devices]
    elif isinstance(evaluator, Evaluator):
        evaluators = [evaluator]
    else:
        evaluators = list(evaluator)
    if len(evaluators) != len(devices):
        if config.gpus:
            raise SearchError(f"{len(evaluators)} evaluators for GPUs {devices}")
        devices = list(range(len(evaluators)))
    gpus = [_Gpu(d, e, ThreadPoolExecutor(1, thread_name_prefix=f"evoengine-gpu{d}"))
            for d, e in zip(devices, evaluators, strict=True)]
    store = Store(config.store)
    try:
        starting = [g.thread.submit(g.evaluator.start) for g in gpus]  # in parallel
        infos = [f.result() for f in starting]
        info = infos[0]
        arch = config.arch or _arch_of(info)
        for d, i in zip(devices, infos, strict=True):
            if not arch.runs_on(*i.capability):
                raise SearchError(f"--arch {arch.name} cannot run on this GPU (device {d}: "
                                  f"{i.name}, compute capability "
                                  f"{i.capability[0]}.{i.capability[1]})")
        if domain is None:
            domain = Domain(config.spaces, w, arch)
        elif domain.workload != w or domain.arch != arch:
            raise SearchError(f"the domain is of {domain.workload.key()} on {domain.arch.name}, "
                              f"the search of {w.key()} on {arch.name}")
        study_name = config.study or default_study(arch, w)
        key = w.key()
        storage = open_storage(store.url, heartbeat_s=config.heartbeat_s, grace_s=config.grace_s)
        taken: set[str] = set()  # measured or claimed by any worker: not to be proposed
        origins = seeds_by_origin(store, domain, key, config.priors)
        sampler = make_sampler(config.strategy, domain, seed=config.seed,
                               blocked=lambda: taken, seeds=[point for point, _ in origins])
        study = SearchStudy.open(storage, study_name, sampler, domain)
        other = study.tie(arch.name, key)
        if other is not None:  # a study belongs to one (arch, workload)
            raise SearchError(f"study {study_name!r} searches {other[1]} on {other[0]}, not "
                              f"{key} on {arch.name}; pick another --study")
        evidence = Evidence.start(store, domain, info, study_name, elites=config.elites)
        tally = Tally(planned=config.trials, seeds=len(origins),
                      seeds_from_priors=sum(only_prior for _, only_prior in origins))
        tally.per_gpu = {d: 0 for d in devices}
        if config.timeout_s is not None:
            tally.deadline = time.monotonic() + config.timeout_s
        tally.baseline = gpus[0].evaluator.baseline()
        progress = progress or Progress(problem_of(w).rate(w))
        ranked = evidence.ranked(limit=1)
        if ranked:
            tally.best_us, tally.best_identity = ranked[0][1], ranked[0][0]
        loop = _Loop(config, domain, study, store, evidence, gpus, tally, progress, taken,
                     compile_fn)
        loop.reap()  # a killed run's trials and claims, before anything is proposed
        status = "done"
        try:
            loop.run()
        except KeyboardInterrupt:
            status = "interrupted"
            loop.stopped_because = "interrupted"
        finally:
            loop.abandon()
            progress.close()
        rows: list[dict[str, Any]] = []
        if status == "done":
            try:
                rows = _final(config, domain, evidence, gpus[0].evaluator, tally, compile_fn)
            except KeyboardInterrupt:
                status = "interrupted"
        if not rows:
            if tally.valid:  # the loop rewrote them only when they changed; settle them
                evidence.settle_elites()
            rows = evidence.rows_from_store(tally.baseline)
        store.finish_run(evidence.run_id, status)
        return SearchResult(evidence.run_id, study_name, arch.name, w, info, tally, status,
                            rows, loop.stopped_because)
    finally:
        for g in gpus:
            if own_evaluator:
                g.evaluator.close()
            g.thread.shutdown(wait=False, cancel_futures=True)
        store.close()


class _Loop:
    """Schedules one search: keeps the compilers ``lookahead`` points ahead of the GPUs,
    hands compiled points to idle GPUs, and records each result as it comes."""

    def __init__(self, config: SearchConfig, domain: Domain, study: SearchStudy, store: Store,
                 evidence: Evidence, gpus: list[_Gpu], tally: Tally, progress: Progress,
                 taken: set[str],
                 compile_fn: Callable[[Candidate, str], CompileResult]) -> None:
        self.config = config
        self.compile_fn = compile_fn
        self.domain = domain
        self.study = study
        self.evidence = evidence
        self.gpus = gpus
        self.tally = tally
        self.progress = progress
        self.arch = domain.arch
        self.coord = Coordination(store, study, taken, arch=self.arch.name,
                                  workload_key=domain.workload.key(), run_id=evidence.run_id,
                                  heartbeat_s=config.heartbeat_s, refresh_s=config.refresh_s,
                                  in_flight=self._in_flight)
        self.workers = config.compile_workers or max(1, (os.cpu_count() or 2) - 1)
        self.lookahead = min(max(4, 2 * self.workers, 2 * len(gpus)), 32)
        self.inflight: dict[Future[CompileResult], _Pending] = {}
        self.ready: collections.deque[tuple[_Pending, CompileResult]] = collections.deque()
        self.evaluating: dict[Future[Evaluation], tuple[_Pending, _Gpu]] = {}
        self.started = 0
        self.exhausted = False
        self.waiting = False  # nothing fresh, but other workers hold open claims
        self.stopped_because = ""
        self._pool: ProcessPoolExecutor | None = None
        self.refresh()

    # ---- budget -------------------------------------------------------------------------

    def _may_start(self) -> bool:
        if self.exhausted:
            return False
        target = self.config.target_us
        if target is not None and self.tally.best_us is not None and self.tally.best_us <= target:
            self.stopped_because = self.stopped_because or f"a time within {target:g} us found"
            return False
        if self.config.trials is not None and self.started >= self.config.trials:
            self.stopped_because = self.stopped_because or f"{self.config.trials} trials done"
            return False
        if self.tally.deadline is not None and time.monotonic() >= self.tally.deadline:
            self.stopped_because = self.stopped_because or "time budget spent"
            return False
        return True

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=self.workers,
                                         mp_context=mp.get_context("spawn"),
                                         initializer=_compiler_init)
        beat_s = self.coord.beat_s
        try:
            while True:
                self.waiting = False
                while (self._may_start() and not self.waiting
                       and len(self.inflight) + len(self.ready) < self.lookahead):
                    self._start_one()
                    self.coord.heartbeat()
                self.tally.compiling = len(self.inflight)
                self._dispatch()
                if self.inflight or self.evaluating:
                    idle = sum(not g.busy for g in self.gpus)
                    waited = time.monotonic()
                    done, _ = wait([*self.inflight, *self.evaluating],
                                   timeout=min(5.0, beat_s), return_when=FIRST_COMPLETED)
                    self.tally.gpu_idle_s += (time.monotonic() - waited) * idle
                    for future in done:
                        if future in self.inflight:
                            self._compiled(future)  # type: ignore[arg-type]
                        else:
                            self._evaluated(future)  # type: ignore[arg-type]
                elif self.waiting and self._may_start():
                    time.sleep(min(1.0, beat_s))  # for other workers' claims to settle
                else:
                    break
                self.coord.heartbeat()
                if self.coord.reap_due():
                    self.reap()
                elif self.coord.refresh_due():
                    self.refresh()
                self.progress.update(self.tally)
        finally:
            self.tally.stopped = time.monotonic()
            self.progress.update(self.tally, force=True)

    def _start_one(self) -> None:
        """Ask for one fresh, admitted point, claim it and send it to the compiler."""
        fresh_only = self.study.fresh_only
        for _ in range(MAX_IDLE_PROPOSALS):
            self.coord.heartbeat()  # a long run of taken proposals must not starve in-flight trials
            if fresh_only and not self.coord.fresh_left(self.domain):
                self.refresh()
                if not self.coord.fresh_left(self.domain):
                    break
            point = self.study.next_point() if fresh_only else None
            if fresh_only and point is None:
                # Every admitted point is measured, or in flight here or elsewhere (the
                # sampler sees other workers' running trials). Asking Optuna instead would
                # churn through MAX_IDLE_PROPOSALS rejected or taken points, a trial each.
                self.refresh()
                break
            trial, family, params, bad = self._ask(point)
            if bad:
                self.tally.rejected += 1
                self.study.fail(trial, "rejected by the search space: " + "; ".join(bad))
                continue
            identity = self.domain.identity(family, params)
            if identity in self.coord.taken or self._is_in_flight(identity):
                self._answer_from_store(trial, identity)
                continue
            if not self.coord.claim(identity, self.study.trial_id(trial)):
                self.tally.claimed_elsewhere += 1
                self.study.fail(trial, f"{NOT_EVALUATED}: another worker claimed it first")
                continue
            candidate = self.domain.candidate(family, params)
            cached = is_cached(candidate, self.arch)
            assert self._pool is not None
            future = self._pool.submit(self.compile_fn, candidate, self.arch.name)
            self.inflight[future] = _Pending(trial, family, params, candidate, cached)
            self.started += 1
            return
        if fresh_only and (self.coord.others_hold_claims() or self._held_unclaimed()):
            self.waiting = True  # other workers' points: measured soon, or freed if dead
            return
        self.exhausted = True
        self.stopped_because = self.stopped_because or (
            "every admitted candidate has been measured" if fresh_only
            else f"{MAX_IDLE_PROPOSALS} proposals in a row were rejected or already measured")

    def _ask(self, point: Point | None) -> tuple[Any, str, dict[str, Any], list[str]]:
        """A new RUNNING trial, heartbeating, that holds its point (and, if admitted, its
        identity): ``(trial, family, params, violations)``. Our samplers propose first
        (``point``) and the trial is written with it at once; Optuna's (``point`` None)
        suggest through the trial."""
        if point is None:
            trial, (family, params) = self.study.ask()
            bad = self.domain.violations(family, params)
            if not bad:
                self.study.set_identity(trial, self.domain.identity(family, params))
            return trial, family, params, bad
        family, params = point
        bad = self.domain.violations(family, params)
        trial = self.study.create(family, params,
                                  None if bad else self.domain.identity(family, params))
        return trial, family, params, bad

    def _pending(self) -> list[_Pending]:
        return [*self.inflight.values(), *(p for p, _ in self.ready),
                *(p for p, _ in self.evaluating.values())]

    def _in_flight(self) -> list[tuple[Any, str]]:
        return [(p.trial, p.candidate.identity) for p in self._pending()]

    def _held_unclaimed(self) -> bool:
        """Whether another worker's RUNNING trial holds a point it has not claimed yet: it
        claims it in a moment, or, its worker killed before that, the trial goes stale (the
        reap, or ``holds_unclaimed`` for one killed before its first heartbeat, fails it)
        and the point is fresh again. Stopping here would lose it."""
        return self.study.holds_unclaimed(self.coord.taken | self.coord.mine(),
                                          self.config.grace_s)

    def _is_in_flight(self, identity: str) -> bool:
        return any(p.candidate.identity == identity for p in self._pending())

    def _answer_from_store(self, trial: Any, identity: str) -> None:
        """A point measured before (or being measured): tell the sampler what is known."""
        self.tally.answered_from_store += 1
        ranked = dict(self.evidence.ranked())
        if identity in ranked:
            self.study.tell_known(trial, ranked[identity])
        elif identity in self.coord.measured:
            self.study.fail(trial, "measured before: failed (see the store)")
        else:  # another worker's, or this one's, in flight: may be needed again if it dies
            self.study.fail(trial, f"{NOT_EVALUATED}: in flight (claimed)")

    def _compiled(self, future: Future[CompileResult]) -> None:
        pending = self.inflight.pop(future)
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 (a compiler process crash is the trial's result)
            result = CompileResult(pending.candidate.identity, self.arch.name, False,
                                   error=f"compiler process failed: {type(e).__name__}: {e}")
        if pending.cached:
            self.tally.cached_compiles += 1
        else:
            self.tally.cold_compiles += 1
        self.evidence.compiled(pending.candidate, result)
        if result.ok:
            self.ready.append((pending, result))
            return
        self.tally.compile_failed += 1
        self._record(pending, Evaluation(False, reason=f"compile error: {result.error}"))

    def _dispatch(self) -> None:
        """Hand compiled candidates to idle GPUs; each GPU's thread blocks on its worker."""
        for gpu in self.gpus:
            if not self.ready:
                return
            if gpu.busy:
                continue
            pending, compiled = self.ready.popleft()
            if self.tally.first_eval is None:
                self.tally.first_eval = time.monotonic()
            gpu.busy = True
            future = gpu.thread.submit(gpu.evaluator.evaluate, pending.candidate, compiled)
            self.evaluating[future] = (pending, gpu)

    def _evaluated(self, future: Future[Evaluation]) -> None:
        pending, gpu = self.evaluating[future]
        evaluation = future.result()  # an evaluator's own error (or a test's Ctrl-C) stops
        del self.evaluating[future]
        gpu.busy = False
        self.tally.evaluated += 1
        self.tally.per_gpu[gpu.device] = self.tally.per_gpu.get(gpu.device, 0) + 1
        if evaluation.fault:
            self.tally.faults += 1
        self._record(pending, evaluation, gpu.device)

    def _record(self, pending: _Pending, e: Evaluation, device: int | None = None) -> None:
        """Write the measurement (settling the claim) first, then tell Optuna: a crash
        between the two leaves a measured point that no worker will measure again."""
        identity = pending.candidate.identity
        try:
            self.evidence.measurement(pending.candidate, e, trial=pending.trial.number,
                                      trial_id=self.study.trial_id(pending.trial),
                                      device=device)
        except ClaimLost as lost:  # this trial was failed as stale; another worker has it
            self.tally.claims_lost += 1
            self.study.fail(pending.trial, f"{NOT_EVALUATED}: {lost}")
            return
        self.coord.measured_here(identity)
        if e.ok and e.median_us is not None:
            self.tally.valid += 1
            self.study.complete(pending.trial, e.median_us)
            if self.tally.best_us is None or e.median_us < self.tally.best_us:
                self.tally.best_us, self.tally.best_identity = e.median_us, identity
            self.evidence.valid_time(e.median_us)
        else:
            self.study.fail(pending.trial, e.reason or "failed")

    # ---- other workers ------------------------------------------------------------------

    def refresh(self) -> None:
        """Read back what every worker has measured or claimed, and the elites."""
        self.coord.refresh()
        self.evidence.read_elite_bar()

    def reap(self) -> None:
        """Fail dead workers' trials and free their claims (``Coordination.reap``)."""
        self.tally.released += self.coord.reap()
        self.refresh()

    def abandon(self) -> None:
        """Fail the trials that were not measured (interrupted) and give back their claims:
        nothing was measured, so a later run (or another worker) may propose them again."""
        pending = self._pending()
        compiling = bool(self.inflight)
        self.inflight.clear()
        self.ready.clear()
        self.evaluating.clear()
        for p in pending:
            try:
                self.study.fail(p.trial, f"{NOT_EVALUATED}: the search stopped first")
            except Exception:  # noqa: BLE001 (best effort while stopping)
                pass
        self.coord.release_quietly([p.candidate.identity for p in pending])
        if self._pool is not None:
            _stop_compilers(self._pool, compiling)
            self._pool = None


def _stop_compilers(pool: ProcessPoolExecutor, compiling: bool) -> None:
    """Shut the compile pool down before the search goes on to its final re-time and the
    store: compiles still running (a Ctrl-C stops the loop with some in flight; a search that
    ends on its budget has drained them) are ended, then the pool is joined. Not
    ``shutdown(wait=False)``: that leaves the pool's manager thread closing its pipes beside
    this thread, which CPython did without a lock against other threads' use of them until
    late 2024 (gh-125451; the device's Python 3.12.3 predates it): the candidate cause of one
    search's end on a bare "[Errno 9] Bad file descriptor" (docs/NOTES.md, 2026-11-29)."""
    if compiling:
        terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
        if terminate is not None:
            terminate()
        else:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                if process.is_alive():
                    process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def _final(config: SearchConfig, domain: Domain, evidence: Evidence, evaluator: Evaluator,
           tally: Tally, compile_fn: Callable[[Candidate, str], CompileResult],
           ) -> list[dict[str, Any]]:
    """Re-time the elites interleaved with SDPA's backends; store and return the rows."""
    entries: list[tuple[Candidate, CompileResult]] = []
    for identity, _ in evidence.ranked():
        point = domain.point(identity)
        if point is None:  # measured by a space this search was not given
            continue
        candidate = domain.candidate(*point)
        compiled = compile_fn(candidate, domain.arch.name)
        if compiled.ok:
            entries.append((candidate, compiled))
        if len(entries) == config.elites:
            break
    if not entries:
        return []
    timed = evaluator.final(entries, config.final_rounds)
    rows = evidence.final(entries, timed)
    if rows:
        tally.best_us = min(tally.best_us or rows[0]["ours_us"], rows[0]["ours_us"])
        tally.baseline = {a: timed[a] for a in ANCHOR_KEYS if a in timed}
    return rows


def _arch_of(info: DeviceInfo) -> Arch:
    from evoengine.arch import arch_of_capability

    try:
        return arch_of_capability(*info.capability)
    except ValueError:
        raise SearchError(f"no target known for {info.name} (compute capability "
                          f"{info.capability[0]}.{info.capability[1]})") from None


def _compiler_init() -> None:
    """A compiler process: Ctrl-C is the parent's to handle, and it runs niced, since the
    compilers can fill every core while the GPU workers and this loop (whose every delay idles
    a GPU) need a core each. Seen on 2 H200s and 32 cores, 31 compilers cold: two GPUs gave
    1.55x the evaluations per minute of one, while the GPUs never waited on a compile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(10)
    except OSError:
        pass
