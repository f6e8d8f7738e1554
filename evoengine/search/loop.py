"""The search loop: propose, compile ahead in worker processes, evaluate on the GPU worker,
record, repeat; then re-time the elites next to SDPA.

The store is the state. Optuna's study lives in the same database (its own tables beside
the ``evo_*`` ones), every measurement is written as it is taken, and the elites are
rewritten whenever they change, so an interrupted search loses at most the trials that were
still compiling, and running the same study again resumes it.
"""

from __future__ import annotations

import collections
import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from evoengine import __version__, paths
from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate, is_cached, nvrtc_version
from evoengine.render import Candidate, render
from evoengine.search.domain import Domain, Point
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator, GpuEvaluator
from evoengine.search.progress import Progress, Tally
from evoengine.search.samplers import (
    IDENTITY_ATTR,
    NOT_EVALUATED,
    REASON_ATTR,
    make_sampler,
    proposes_only_fresh,
)
from evoengine.space import SearchSpace
from evoengine.store import Store
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
    elites: int = ELITES
    final_rounds: int = FINAL_ROUNDS


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
            "torch": self.device.versions.get("torch"), "commit": _commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "study": self.study, "run_id": self.run_id,
            "method": "CUDA events, 10 warm-up calls, median of 50 (graph replay of 64 calls, "
                      "for every contender, when the workload is under 15 GFLOP), inputs "
                      "rotated over >=256 MB; elites re-timed interleaved with SDPA flash and "
                      "cuDNN, median of the rounds' medians",
            "search": _tally_dict(self.tally),
            "rows": self.rows,
        }


@dataclass
class _Pending:
    trial: Any  # optuna.Trial
    family: str
    params: dict[str, Any]
    candidate: Candidate
    cached: bool


def default_study(arch: Arch, workload: Workload) -> str:
    return f"{arch.name}-{workload.key()}"


def search(config: SearchConfig, *, evaluator: Evaluator | None = None,
           progress: Progress | None = None,
           compile_fn: Callable[[Candidate, str], CompileResult] = compile_candidate,
           domain: Domain | None = None) -> SearchResult:
    """Run (or resume) a search; see the module docstring. Ctrl-C stops it cleanly.

    ``evaluator`` defaults to a ``GpuEvaluator`` on ``config.device``; ``compile_fn`` (run in
    the compiler processes, so a module-level function or a picklable object) defaults to
    NVRTC with the disk cache. ``domain`` defaults to every admitted point of
    ``config.spaces``; it must be of ``config.workload`` and the search's arch. Tests and the
    replay (``search.replay``) replace all three to run the loop without a GPU.
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
    own_evaluator = evaluator is None
    evaluator = evaluator or GpuEvaluator(w, device=config.device,
                                          timeout_s=config.eval_timeout_s)
    store = Store(config.store)
    try:
        info = evaluator.start()
        arch = config.arch or _arch_of(info)
        if not arch.runs_on(*info.capability):
            raise SearchError(f"--arch {arch.name} cannot run on this GPU ({info.name}, "
                              f"compute capability {info.capability[0]}.{info.capability[1]})")
        if domain is None:
            domain = Domain(config.spaces, w, arch)
        elif domain.workload != w or domain.arch != arch:
            raise SearchError(f"the domain is of {domain.workload.key()} on {domain.arch.name}, "
                              f"the search of {w.key()} on {arch.name}")
        study_name = config.study or default_study(arch, w)
        key = w.key()
        measured = store.measured_identities(arch=arch.name, workload_key=key)
        storage = optuna.storages.RDBStorage(
            store.url, heartbeat_interval=60, grace_period=180,
            engine_kwargs={"connect_args": {"timeout": 60}} if store.url.startswith("sqlite")
            else {})
        sampler = make_sampler(config.strategy, domain, seed=config.seed,
                               blocked=lambda: measured, seeds=_seeds(store, domain, key))
        study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                    direction="minimize", load_if_exists=True)
        _claim_study(study, arch, w)
        optuna.storages.fail_stale_trials(study)
        run_id = store.start_run(arch=arch.name, workload=w.to_dict(), workload_key=key,
                                 device=info.name, versions=_versions(info), commit=_commit(),
                                 study=study_name)
        tally = Tally(planned=config.trials)
        if config.timeout_s is not None:
            tally.deadline = time.monotonic() + config.timeout_s
        tally.baseline = evaluator.baseline()
        progress = progress or Progress(w.flops())
        ranked = store.ranked(arch=arch.name, workload_key=key, limit=1)
        if ranked:
            tally.best_us, tally.best_identity = ranked[0][1], ranked[0][0]
        loop = _Loop(config, domain, study, store, evaluator, run_id, tally, progress, measured,
                     compile_fn)
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
                rows = _final(config, domain, store, evaluator, run_id, tally, compile_fn)
            except KeyboardInterrupt:
                status = "interrupted"
        if not rows:
            rows = _rows_from_store(store, domain, arch, key, config.elites, tally)
        store.finish_run(run_id, status)
        return SearchResult(run_id, study_name, arch.name, w, info, tally, status, rows,
                            loop.stopped_because)
    finally:
        if own_evaluator:
            evaluator.close()
        store.close()


class _Loop:
    def __init__(self, config: SearchConfig, domain: Domain, study: Any, store: Store,
                 evaluator: Evaluator, run_id: int, tally: Tally, progress: Progress,
                 measured: set[str],
                 compile_fn: Callable[[Candidate, str], CompileResult]) -> None:
        self.config = config
        self.compile_fn = compile_fn
        self.domain = domain
        self.study = study
        self.store = store
        self.evaluator = evaluator
        self.run_id = run_id
        self.tally = tally
        self.progress = progress
        self.measured = measured  # shared with the sampler: identities not to propose again
        self.key = domain.workload.key()
        self.arch = domain.arch
        self.workers = config.compile_workers or max(1, (os.cpu_count() or 2) - 1)
        self.lookahead = min(max(4, 2 * self.workers), 32)
        self.inflight: dict[Future[CompileResult], _Pending] = {}
        self.ready: collections.deque[tuple[_Pending, CompileResult]] = collections.deque()
        self.started = 0
        self.exhausted = False
        self.stopped_because = ""
        self._pool: ProcessPoolExecutor | None = None
        self._fresh_only = proposes_only_fresh(study.sampler)
        self._last_beat = time.monotonic()

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
                                         initializer=_ignore_sigint)
        try:
            while True:
                while self._may_start() and len(self.inflight) + len(self.ready) < self.lookahead:
                    self._start_one()
                self.tally.compiling = len(self.inflight)
                if self.ready:
                    self._evaluate(*self.ready[0])
                    self.ready.popleft()
                elif self.inflight:
                    waited = time.monotonic()
                    done, _ = wait(list(self.inflight), timeout=5.0, return_when=FIRST_COMPLETED)
                    self.tally.gpu_idle_s += time.monotonic() - waited
                    for future in done:
                        self._compiled(future)
                else:
                    break
                self._heartbeat()
                self.progress.update(self.tally)
        finally:
            self.progress.update(self.tally, force=True)

    def _start_one(self) -> None:
        """Ask for one fresh, admitted point and send it to the compiler."""
        for _ in range(MAX_IDLE_PROPOSALS):
            if self._fresh_only and not self._fresh_left():
                break
            trial = self.study.ask()
            family, params = self.domain.suggest(trial)
            bad = self.domain.violations(family, params)
            if bad:
                self.tally.rejected += 1
                self._tell_fail(trial, "rejected by the search space: " + "; ".join(bad))
                continue
            identity = self.domain.identity(family, params)
            trial.set_user_attr(IDENTITY_ATTR, identity)
            if identity in self.measured or self._in_flight(identity):
                self._answer_from_store(trial, identity)
                continue
            candidate = self.domain.candidate(family, params)
            cached = is_cached(candidate, self.arch)
            assert self._pool is not None
            future = self._pool.submit(self.compile_fn, candidate, self.arch.name)
            self.inflight[future] = _Pending(trial, family, params, candidate, cached)
            self.started += 1
            return
        self.exhausted = True
        self.stopped_because = self.stopped_because or (
            "every admitted candidate has been measured" if self._fresh_only
            else f"{MAX_IDLE_PROPOSALS} proposals in a row were rejected or already measured")

    def _fresh_left(self) -> bool:
        """Whether some admitted point is neither measured nor on its way."""
        taken = {p.candidate.identity for p in self.inflight.values()}
        taken |= {p.candidate.identity for p, _ in self.ready}
        return any(i not in self.measured and i not in taken for i, _ in self.domain.items())

    def _in_flight(self, identity: str) -> bool:
        return any(p.candidate.identity == identity for p in self.inflight.values()) or any(
            p.candidate.identity == identity for p, _ in self.ready)

    def _answer_from_store(self, trial: Any, identity: str) -> None:
        """A point measured before (or being measured): tell the sampler what is known."""
        self.tally.answered_from_store += 1
        ranked = dict(self.store.ranked(arch=self.arch.name, workload_key=self.key))
        if identity in ranked:
            self.study.tell(trial, ranked[identity])
        else:
            self._tell_fail(trial, "measured before: failed or in flight (see the store)")

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

    def _evaluate(self, pending: _Pending, compiled: CompileResult) -> None:
        if self.tally.first_eval is None:
            self.tally.first_eval = time.monotonic()
        evaluation = self.evaluator.evaluate(pending.candidate, compiled)
        self.tally.evaluated += 1
        if evaluation.fault:
            self.tally.faults += 1
        self._record(pending, evaluation)

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

    def _record(self, pending: _Pending, e: Evaluation) -> None:
        """Write the measurement first, then tell Optuna: a crash between the two leaves a
        measured point that the next run will not measure again."""
        identity = pending.candidate.identity
        tflops = self.domain.workload.flops() / e.median_us / 1e6 if e.ok and e.median_us else None
        self.store.add_measurement(
            self.run_id, identity, ok=e.ok, reason=e.reason, median_us=e.median_us,
            spread_us=e.spread_us, max_err=e.max_err, tolerance=e.tolerance, tflops=tflops,
            extra={"phase": "search", "trial": pending.trial.number, "reps": e.reps,
                   "graph": e.graph, "seconds": round(e.seconds, 3), "fault": e.fault})
        self.measured.add(identity)
        if e.ok and e.median_us is not None:
            self.tally.valid += 1
            self.study.tell(pending.trial, e.median_us)
            if self.tally.best_us is None or e.median_us < self.tally.best_us:
                self.tally.best_us, self.tally.best_identity = e.median_us, identity
            self._update_elites()
        else:
            self._tell_fail(pending.trial, e.reason or "failed")

    def _update_elites(self) -> None:
        top = self.store.ranked(arch=self.arch.name, workload_key=self.key,
                                limit=self.config.elites)
        self.store.set_elites(arch=self.arch.name, workload_key=self.key, entries=top,
                              run_id=self.run_id)

    def _tell_fail(self, trial: Any, reason: str) -> None:
        import optuna

        trial.set_user_attr(REASON_ATTR, reason[:1000])
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_beat < 20:
            return
        self._last_beat = time.monotonic()
        storage = self.study._storage
        for p in [*self.inflight.values(), *(p for p, _ in self.ready)]:
            storage.record_heartbeat(p.trial._trial_id)

    def abandon(self) -> None:
        """Fail the trials that never reached the GPU (interrupted): nothing was measured, so
        a later run may propose them again."""
        pending = [*self.inflight.values(), *(p for p, _ in self.ready)]
        self.inflight.clear()
        self.ready.clear()
        for p in pending:
            try:
                self._tell_fail(p.trial, f"{NOT_EVALUATED}: the search stopped first")
            except Exception:  # noqa: BLE001 (best effort while stopping)
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


def _commit() -> str | None:
    if os.environ.get("EVO_COMMIT"):
        return os.environ["EVO_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(paths.ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tally_dict(t: Tally) -> dict[str, Any]:
    return {
        "evaluated": t.evaluated, "valid": t.valid, "compile_failed": t.compile_failed,
        "faults": t.faults, "answered_from_store": t.answered_from_store,
        "rejected": t.rejected, "cached_compiles": t.cached_compiles,
        "cold_compiles": t.cold_compiles, "evals_per_minute": t.evals_per_minute(),
        "gpu_waited_on_compiler_s": round(t.gpu_idle_s, 2),
        "wall_s": round(time.monotonic() - t.started, 2),
        "sdpa_flash_us": t.baseline.get("flash"), "sdpa_cudnn_us": t.baseline.get("cudnn"),
    }
