"""The search loop: propose, compile ahead in worker processes, evaluate on the GPU worker,
record, repeat; then re-time the elites next to SDPA.

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
(PostgreSQL) and join the study. What keeps them from measuring a point twice is the
store's claim (``Store.claim``: a unique row per (arch, workload, identity), inserted in its
own transaction before the point is compiled); the measurement settles the claim in its own
transaction. A worker killed outright leaves RUNNING trials that stop heartbeating: any
running worker fails them after the grace period (``fail_stale_trials``, checked every
heartbeat interval) and releases their unmeasured claims, so the points are proposed again.
"""

from __future__ import annotations

import collections
import datetime
import math
import multiprocessing as mp
import os
import signal
import socket
import time
import warnings
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

from sqlalchemy import exc as sa_exc

from evoengine import __version__, measure
from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate, is_cached, nvrtc_version
from evoengine.provenance import git_commit
from evoengine.render import Candidate, render
from evoengine.search.domain import Domain, Point
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator
from evoengine.search.progress import Progress, Tally
from evoengine.search.samplers import (
    IDENTITY_ATTR,
    NOT_EVALUATED,
    REASON_ATTR,
    make_sampler,
    proposes_only_fresh,
)
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
        return {
            "device": self.device.name, "driver": self.device.driver,
            "torch": self.device.versions.get("torch"), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "study": self.study, "run_id": self.run_id,
            "method": f"{measure.TIMING} (graph replay of 64 calls, "
                      "for every contender, when the workload is under 15 GFLOP), inputs "
                      "rotated over >=256 MB; elites re-timed interleaved with SDPA flash and "
                      "cuDNN, median of the rounds' medians",
            "search": _tally_dict(self.tally),
            "rows": self.rows,
        }


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
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        # Heartbeats (so a killed run's trials are failed, not RUNNING forever) are marked
        # experimental, and meant for Study.optimize; the loop records them itself.
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        return _search(config, evaluator, progress, compile_fn, domain)


def _search(config: SearchConfig, evaluator: Evaluator | None, progress: Progress | None,
            compile_fn: Callable[[Candidate, str], CompileResult],
            domain: Domain | None) -> SearchResult:
    import optuna

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
        storage = _optuna_storage(store.url, config)
        taken: set[str] = set()  # measured or claimed by any worker: not to be proposed
        sampler = make_sampler(config.strategy, domain, seed=config.seed,
                               blocked=lambda: taken, seeds=_seeds(store, domain, key))
        study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                    direction="minimize", load_if_exists=True)
        _claim_study(study, arch, w)
        run_id = store.start_run(arch=arch.name, workload=w.to_dict(), workload_key=key,
                                 device=info.name, versions=_versions(info), commit=git_commit(),
                                 study=study_name)
        tally = Tally(planned=config.trials)
        tally.per_gpu = {d: 0 for d in devices}
        if config.timeout_s is not None:
            tally.deadline = time.monotonic() + config.timeout_s
        tally.baseline = gpus[0].evaluator.baseline()
        progress = progress or Progress(w.flops())
        ranked = store.ranked(arch=arch.name, workload_key=key, limit=1)
        if ranked:
            tally.best_us, tally.best_identity = ranked[0][1], ranked[0][0]
        loop = _Loop(config, domain, study, store, gpus, run_id, tally, progress, taken,
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
                rows = _final(config, domain, store, gpus[0].evaluator, run_id, tally,
                              compile_fn)
            except KeyboardInterrupt:
                status = "interrupted"
        if not rows:
            if tally.valid:  # the loop rewrote them only when they changed; settle them
                store.update_elites(arch=arch.name, workload_key=key, limit=config.elites,
                                    run_id=run_id)
            rows = _rows_from_store(store, domain, arch, key, config.elites, tally)
        store.finish_run(run_id, status)
        return SearchResult(run_id, study_name, arch.name, w, info, tally, status, rows,
                            loop.stopped_because)
    finally:
        for g in gpus:
            if own_evaluator:
                g.evaluator.close()
            g.thread.shutdown(wait=False, cancel_futures=True)
        store.close()


class _Loop:
    def __init__(self, config: SearchConfig, domain: Domain, study: Any, store: Store,
                 gpus: list[_Gpu], run_id: int, tally: Tally, progress: Progress,
                 taken: set[str],
                 compile_fn: Callable[[Candidate, str], CompileResult]) -> None:
        self.config = config
        self.compile_fn = compile_fn
        self.domain = domain
        self.study = study
        self.store = store
        self.gpus = gpus
        self.run_id = run_id
        self.tally = tally
        self.progress = progress
        self.taken = taken  # shared with the sampler: identities not to propose
        self.measured: set[str] = set()
        self.key = domain.workload.key()
        self.arch = domain.arch
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
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
        self._fresh_only = proposes_only_fresh(study.sampler)
        self._distributions = domain.distributions()
        self._elite_bar = math.inf  # a valid time must beat this to enter the elites
        self._beat_s = max(1.0, config.heartbeat_s / 3)
        self._last_beat = self._last_reap = self._last_refresh = time.monotonic()
        self.refresh()

    # ---- budget -------------------------------------------------------------------------

    def _may_start(self) -> bool:
        if self.exhausted:
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
        try:
            while True:
                self.waiting = False
                while (self._may_start() and not self.waiting
                       and len(self.inflight) + len(self.ready) < self.lookahead):
                    self._start_one()
                    self._heartbeat()
                self.tally.compiling = len(self.inflight)
                self._dispatch()
                if self.inflight or self.evaluating:
                    idle = sum(not g.busy for g in self.gpus)
                    waited = time.monotonic()
                    done, _ = wait([*self.inflight, *self.evaluating],
                                   timeout=min(5.0, self._beat_s), return_when=FIRST_COMPLETED)
                    self.tally.gpu_idle_s += (time.monotonic() - waited) * idle
                    for future in done:
                        if future in self.inflight:
                            self._compiled(future)  # type: ignore[arg-type]
                        else:
                            self._evaluated(future)  # type: ignore[arg-type]
                elif self.waiting and self._may_start():
                    time.sleep(min(1.0, self._beat_s))  # for other workers' claims to settle
                else:
                    break
                self._heartbeat()
                if time.monotonic() - self._last_reap >= self.config.heartbeat_s:
                    self.reap()
                elif time.monotonic() - self._last_refresh >= self.config.refresh_s:
                    self.refresh()
                self.progress.update(self.tally)
        finally:
            self.tally.stopped = time.monotonic()
            self.progress.update(self.tally, force=True)

    def _start_one(self) -> None:
        """Ask for one fresh, admitted point, claim it and send it to the compiler."""
        for _ in range(MAX_IDLE_PROPOSALS):
            self._heartbeat()  # a long run of taken proposals must not starve in-flight trials
            if self._fresh_only and not self._fresh_left():
                self.refresh()
                if not self._fresh_left():
                    break
            point = self.study.sampler.next_point(self.study) if self._fresh_only else None
            if self._fresh_only and point is None:
                # Every admitted point is measured, or in flight here or elsewhere (the
                # sampler sees other workers' running trials). Asking Optuna instead would
                # churn through MAX_IDLE_PROPOSALS rejected or taken points, a trial each.
                self.refresh()
                break
            trial, family, params, bad = self._ask(point)
            if bad:
                self.tally.rejected += 1
                self._tell_fail(trial, "rejected by the search space: " + "; ".join(bad))
                continue
            identity = self.domain.identity(family, params)
            if identity in self.taken or self._in_flight(identity):
                self._answer_from_store(trial, identity)
                continue
            if not self.store.claim(arch=self.arch.name, workload_key=self.key,
                                    identity=identity, run_id=self.run_id,
                                    trial_id=trial._trial_id, owner=self.owner):
                self.taken.add(identity)
                self.tally.claimed_elsewhere += 1
                self._tell_fail(trial, f"{NOT_EVALUATED}: another worker claimed it first")
                continue
            self.taken.add(identity)
            candidate = self.domain.candidate(family, params)
            cached = is_cached(candidate, self.arch)
            assert self._pool is not None
            future = self._pool.submit(self.compile_fn, candidate, self.arch.name)
            self.inflight[future] = _Pending(trial, family, params, candidate, cached)
            self.started += 1
            return
        if self._fresh_only and self.taken - self.measured - self._mine():
            self.waiting = True  # other workers' points: measured soon, or released if dead
            return
        self.exhausted = True
        self.stopped_because = self.stopped_because or (
            "every admitted candidate has been measured" if self._fresh_only
            else f"{MAX_IDLE_PROPOSALS} proposals in a row were rejected or already measured")

    def _ask(self, point: tuple[str, dict[str, Any]] | None
             ) -> tuple[Any, str, dict[str, Any], list[str]]:
        """A new RUNNING trial, heartbeating, that holds its point (and, if admitted, its
        identity): ``(trial, family, params, violations)``.

        Our samplers propose first (``point``), and the trial is created with its parameters
        and identity in one transaction (as ``Study.add_trial`` does): what ``ask`` and one
        ``suggest`` per parameter would write in a dozen. Optuna's samplers (``point`` None)
        go through ``ask`` and ``suggest``. The loop never enqueues
        trials, so no waiting trial is skipped.
        """
        import optuna

        storage = self.study._storage
        if point is None:
            trial = self.study.ask()
            # At once, so a trial of a worker killed from here on is failed as stale later.
            storage.record_heartbeat(trial._trial_id)
            family, params = self.domain.suggest(trial)
            bad = self.domain.violations(family, params)
            if not bad:
                trial.set_user_attr(IDENTITY_ATTR, self.domain.identity(family, params))
            return trial, family, params, bad
        family, params = point
        bad = self.domain.violations(family, params)
        named = self.domain.to_trial_params(family, params)
        distributions = self._distributions
        template = optuna.trial.FrozenTrial(
            number=-1, state=optuna.trial.TrialState.RUNNING, value=None,
            datetime_start=datetime.datetime.now(), datetime_complete=None, params=named,
            distributions={n: distributions[n] for n in named},
            user_attrs={} if bad else {IDENTITY_ATTR: self.domain.identity(family, params)},
            system_attrs={}, intermediate_values={}, trial_id=-1)
        trial_id = storage.create_new_trial(self.study._study_id, template_trial=template)
        storage.record_heartbeat(trial_id)
        return optuna.Trial(self.study, trial_id), family, params, bad

    def _pending(self) -> list[_Pending]:
        return [*self.inflight.values(), *(p for p, _ in self.ready),
                *(p for p, _ in self.evaluating.values())]

    def _mine(self) -> set[str]:
        return {p.candidate.identity for p in self._pending()}

    def _fresh_left(self) -> bool:
        """Whether some admitted point is neither taken nor on its way here."""
        mine = self._mine()
        return any(i not in self.taken and i not in mine for i, _ in self.domain.items())

    def _in_flight(self, identity: str) -> bool:
        return any(p.candidate.identity == identity for p in self._pending())

    def _answer_from_store(self, trial: Any, identity: str) -> None:
        """A point measured before (or being measured): tell the sampler what is known."""
        self.tally.answered_from_store += 1
        ranked = dict(self.store.ranked(arch=self.arch.name, workload_key=self.key))
        if identity in ranked:
            self.study.tell(trial, ranked[identity])
        elif identity in self.measured:
            self._tell_fail(trial, "measured before: failed (see the store)")
        else:  # another worker's, or this one's, in flight: may be needed again if it dies
            self._tell_fail(trial, f"{NOT_EVALUATED}: in flight (claimed)")

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
        self._record_candidate(pending, result)
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

    # ---- recording ----------------------------------------------------------------------

    def _record_candidate(self, pending: _Pending, result: CompileResult) -> None:
        c = pending.candidate
        self.store.add_candidate(identity=c.identity, family=c.family,
                                 template_hash=c.template_hash, params=c.params,
                                 problem=c.problem,
                                 source=render(c) if self.domain.renders else "")
        self.store.set_compile_report(c.identity, arch=self.arch.name, ok=result.ok,
                                      registers=result.registers, spill_bytes=result.spill_bytes,
                                      smem_bytes=result.smem_bytes,
                                      compile_seconds=result.seconds, error=result.error,
                                      compiler=nvrtc_version())

    def _record(self, pending: _Pending, e: Evaluation, device: int | None = None) -> None:
        """Write the measurement (settling the claim) first, then tell Optuna: a crash
        between the two leaves a measured point that no worker will measure again."""
        identity = pending.candidate.identity
        tflops = self.domain.workload.flops() / e.median_us / 1e6 if e.ok and e.median_us else None
        extra = {"phase": "search", "trial": pending.trial.number, "reps": e.reps,
                 "graph": e.graph, "seconds": round(e.seconds, 3), "fault": e.fault}
        if device is not None:
            extra["gpu"] = device
        try:
            self.store.add_measurement(
                self.run_id, identity, ok=e.ok, reason=e.reason, median_us=e.median_us,
                spread_us=e.spread_us, max_err=e.max_err, tolerance=e.tolerance, tflops=tflops,
                extra=extra, trial_id=pending.trial._trial_id)
        except ClaimLost as lost:  # this trial was failed as stale; another worker has it
            self.tally.claims_lost += 1
            self._tell_fail(pending.trial, f"{NOT_EVALUATED}: {lost}")
            return
        self.measured.add(identity)
        self.taken.add(identity)
        if e.ok and e.median_us is not None:
            self.tally.valid += 1
            self._tell(pending.trial, e.median_us)
            if self.tally.best_us is None or e.median_us < self.tally.best_us:
                self.tally.best_us, self.tally.best_identity = e.median_us, identity
            if e.median_us <= self._elite_bar:
                self._update_elites()
        else:
            self._tell_fail(pending.trial, e.reason or "failed")

    def _update_elites(self) -> None:
        """Rewrite the elites (the store's ranking); a time slower than the bar this leaves
        cannot change them, so it is not rewritten for. The bar only ever falls (a
        candidate's best time only falls), and other workers' times lower it at the next
        ``refresh``: until then it is too high, which costs a needless rewrite, never a
        missed one."""
        top = self.store.update_elites(arch=self.arch.name, workload_key=self.key,
                                       limit=self.config.elites, run_id=self.run_id)
        self._set_elite_bar(top)

    def _set_elite_bar(self, top: list[tuple[str, float]]) -> None:
        self._elite_bar = top[-1][1] if len(top) >= self.config.elites else math.inf

    def _tell(self, trial: Any, value: float) -> None:
        try:
            self._finish(trial, value)
        except (RuntimeError, ValueError):
            self._unless_finished(trial)

    def _tell_fail(self, trial: Any, reason: str) -> None:
        try:
            trial.set_user_attr(REASON_ATTR, reason[:1000])
            self._finish(trial, None)
        except (RuntimeError, ValueError):
            self._unless_finished(trial)

    def _finish(self, trial: Any, value: float | None) -> None:
        """Complete the trial with ``value``, or fail it (None). ``Study.tell`` reads the
        trial back first, for the sampler's ``after_trial``; ours learn nothing there, so
        for them the state is written at once (a finished trial raises, as with ``tell``)."""
        from optuna.trial import TrialState

        if not self._fresh_only or (value is not None and not math.isfinite(value)):
            if value is None:
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                self.study.tell(trial, value)
            return
        state = TrialState.FAIL if value is None else TrialState.COMPLETE
        if not self.study._storage.set_trial_state_values(
                trial._trial_id, state, None if value is None else [value]):
            raise RuntimeError(f"trial {trial.number} could not be set {state.name}")

    def _unless_finished(self, trial: Any) -> None:
        """Re-raise, unless another worker failed the trial as stale meanwhile (a long stall
        here): then the store holds what this worker measured, and the trial stays failed."""
        if not self.study._storage.get_trial(trial._trial_id).state.is_finished():
            raise

    # ---- liveness and other workers ----------------------------------------------------

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_beat < self._beat_s:
            return
        self._last_beat = time.monotonic()
        storage = self.study._storage
        for p in self._pending():
            storage.record_heartbeat(p.trial._trial_id)

    def refresh(self) -> None:
        """Read back what every worker has measured or claimed (for the sampler)."""
        self._last_refresh = time.monotonic()
        self.measured = self.store.measured_identities(arch=self.arch.name,
                                                       workload_key=self.key)
        taken = self.store.taken_identities(arch=self.arch.name, workload_key=self.key)
        self.taken.clear()
        self.taken.update(taken)
        self._set_elite_bar(self.store.ranked(arch=self.arch.name, workload_key=self.key,
                                              limit=self.config.elites))

    def reap(self) -> None:
        """Fail the study's trials whose worker stopped heartbeating (killed, or its host
        lost), and release the claims of every finished trial that measured nothing, so
        their points can be taken again."""
        import optuna

        self._last_reap = time.monotonic()
        optuna.storages.fail_stale_trials(self.study)
        storage = self.study._storage
        mine = self._mine()
        dead = []
        for identity, trial_id in self.store.open_claims(arch=self.arch.name,
                                                         workload_key=self.key).items():
            if identity in mine:
                continue
            try:
                finished = trial_id is None or storage.get_trial(trial_id).state.is_finished()
            except KeyError:  # the study was deleted
                finished = True
            if finished:
                dead.append(identity)
        if dead:
            self.tally.released += self.store.release_claims(
                arch=self.arch.name, workload_key=self.key, identities=dead)
        self.refresh()

    def abandon(self) -> None:
        """Fail the trials that were not measured (interrupted) and give back their claims:
        nothing was measured, so a later run (or another worker) may propose them again."""
        pending = self._pending()
        self.inflight.clear()
        self.ready.clear()
        self.evaluating.clear()
        for p in pending:
            try:
                self._tell_fail(p.trial, f"{NOT_EVALUATED}: the search stopped first")
            except Exception:  # noqa: BLE001 (best effort while stopping)
                pass
        try:
            self.store.release_claims(arch=self.arch.name, workload_key=self.key,
                                      identities=[p.candidate.identity for p in pending])
        except Exception:  # noqa: BLE001 (the heartbeat releases them later)
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _final(config: SearchConfig, domain: Domain, store: Store, evaluator: Evaluator, run_id: int,
           tally: Tally, compile_fn: Callable[[Candidate, str], CompileResult],
           ) -> list[dict[str, Any]]:
    """Re-time the elites interleaved with SDPA's backends; store and return the rows."""
    key = domain.workload.key()
    entries: list[tuple[Candidate, CompileResult]] = []
    for identity, _ in store.ranked(arch=domain.arch.name, workload_key=key):
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
    rows = []
    flops = domain.workload.flops()
    for (candidate, _), t in zip(entries, timed["candidates"], strict=True):
        if "median_us" not in t:
            continue
        row = _row(domain.workload, candidate, t["median_us"], timed.get("flash"),
                   timed.get("cudnn"))
        row["spread_us"] = t["spread_us"]
        rows.append(row)
        store.add_measurement(run_id, candidate.identity, ok=True, median_us=t["median_us"],
                              spread_us=t["spread_us"], tflops=flops / t["median_us"] / 1e6,
                              extra={"phase": "final", "rounds": t.get("rounds"),
                                     "sdpa_flash_us": timed.get("flash"),
                                     "sdpa_cudnn_us": timed.get("cudnn")})
    rows.sort(key=lambda r: r["ours_us"])
    if rows:
        store.set_elites(arch=domain.arch.name, workload_key=key,
                         entries=[(r["identity"], r["ours_us"]) for r in rows], run_id=run_id)
        tally.best_us = min(tally.best_us or rows[0]["ours_us"], rows[0]["ours_us"])
        tally.baseline = {"flash": timed.get("flash"), "cudnn": timed.get("cudnn")}
    return rows


def _rows_from_store(store: Store, domain: Domain, arch: Arch, key: str, limit: int,
                     tally: Tally) -> list[dict[str, Any]]:
    rows = []
    for identity, us in store.ranked(arch=arch.name, workload_key=key, limit=limit):
        point = domain.point(identity)
        if point is not None:
            rows.append(_row(domain.workload, domain.candidate(*point), us,
                             tally.baseline.get("flash"), tally.baseline.get("cudnn")))
    return rows


def _row(w: Workload, candidate: Candidate, us: float, flash: float | None,
         cudnn: float | None) -> dict[str, Any]:
    return {
        "family": candidate.family, "shape": [w.batch, w.heads, w.seq_q, w.head_dim],
        "kv_heads": w.kv_heads, "seq_k": w.seq_k, "causal": w.causal, "dtype": w.dtype,
        "ours_us": us, "sdpa_flash_us": flash, "sdpa_cudnn_us": cudnn,
        "tflops": w.flops() / us / 1e6, "params": candidate.params,
        "identity": candidate.identity,
    }


def _seeds(store: Store, domain: Domain, key: str) -> list[Point]:
    """Elites of other workloads on this target whose points this domain admits: good
    kernels for a neighbouring shape are likely good here, so they are tried first."""
    seeds: list[Point] = []
    for elite in store.elites(arch=domain.arch.name):
        if elite.workload_key == key or elite.rank > 2:
            continue
        point = domain.point(domain.identity(elite.family, elite.params)
                             if elite.family in domain.spaces else "")
        if point is not None and point not in seeds:
            seeds.append(point)
    return seeds


def _optuna_storage(url: str, config: SearchConfig) -> Any:
    """Optuna's storage on the store's database. Optuna creates its tables on first use
    without a lock, so workers starting together on a fresh database can collide (a
    duplicate ``alembic_version`` row): the losers try again, and then find the tables."""
    import optuna

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=config.heartbeat_s, grace_period=config.grace_s,
                engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite")
                else {})
        except (optuna.exceptions.StorageInternalError, sa_exc.SQLAlchemyError):
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _claim_study(study: Any, arch: Arch, w: Workload) -> None:
    """A study belongs to one (arch, workload): resuming it with another is refused."""
    mine = {"arch": arch.name, "workload": w.key()}
    attrs = study.user_attrs
    if "workload" not in attrs:
        for k, v in mine.items():
            study.set_user_attr(k, v)
    elif attrs.get("workload") != mine["workload"] or attrs.get("arch") != mine["arch"]:
        raise SearchError(f"study {study.study_name!r} searches {attrs.get('workload')} on "
                          f"{attrs.get('arch')}, not {mine['workload']} on {mine['arch']}; "
                          "pick another --study")


def _arch_of(info: DeviceInfo) -> Arch:
    from evoengine.arch import arch_of_capability

    try:
        return arch_of_capability(*info.capability)
    except ValueError:
        raise SearchError(f"no target known for {info.name} (compute capability "
                          f"{info.capability[0]}.{info.capability[1]})") from None


def _versions(info: DeviceInfo) -> dict[str, str]:
    return {"evoengine": __version__, "compiler": nvrtc_version(), "driver": info.driver,
            **info.versions}


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


def _tally_dict(t: Tally) -> dict[str, Any]:
    return {
        "evaluated": t.evaluated, "valid": t.valid, "compile_failed": t.compile_failed,
        "faults": t.faults, "answered_from_store": t.answered_from_store,
        "rejected": t.rejected, "cached_compiles": t.cached_compiles,
        "cold_compiles": t.cold_compiles, "evals_per_minute": t.evals_per_minute(),
        "gpu_waited_on_compiler_s": round(t.gpu_idle_s, 2),
        "claimed_elsewhere": t.claimed_elsewhere, "claims_released": t.released,
        "claims_lost": t.claims_lost, "gpus": _per_gpu(t),
        "wall_s": round(time.monotonic() - t.started, 2),
        "sdpa_flash_us": t.baseline.get("flash"), "sdpa_cudnn_us": t.baseline.get("cudnn"),
    }


def _per_gpu(t: Tally) -> dict[str, dict[str, float | int | None]]:
    """Evaluations and evaluations per minute of each GPU, over the same window as the
    overall rate (first evaluation to the end of the search loop)."""
    return {str(d): {"evaluated": n, "evals_per_minute": t.evals_per_minute(n)}
            for d, n in t.per_gpu.items()}
