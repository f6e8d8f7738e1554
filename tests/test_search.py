"""The search loop without a GPU: the domain, the samplers, the loop's bookkeeping, the
Optuna adapter, fault isolation in a worker process, interruption and resumption.

Candidates are "compiled" by a stub and "measured" by fake evaluators whose times are a
fixed function of the parameters, so the tests know the optimum and every outcome.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import optuna
import pytest

from evoengine import paths
from evoengine.arch import get_arch
from evoengine.compile import CompileResult
from evoengine.render import Candidate
from evoengine.search import (
    DeviceInfo,
    Domain,
    Evaluation,
    Evaluator,
    EvoSampler,
    Progress,
    SearchConfig,
    SearchError,
    WorkerEvaluator,
    search,
)
from evoengine.search.samplers import STRATEGIES
from evoengine.search.study import SearchStudy, open_storage, quiet_optuna
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload

SM90 = get_arch("sm_90a")
WORKLOAD = Workload(2, 8, 300, 64)
FAULT = {"BLOCK_N": 32, "STAGES": 1}
HANG = {"BLOCK_N": 64, "STAGES": 2}


def mma() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "mma.toml")


def small_space(tmp_path: Path, lazy: bool = True) -> SearchSpace:
    """mma with 6 points: BLOCK_N 32/64 x STAGES 1/2/3."""
    text = (paths.SPACES / "mma.toml").read_text()
    start, end = text.index("[parameters]"), text.index("[derived]")
    params = ('[parameters]\nBLOCK_M = [64]\nBLOCK_N = [32, 64]\nNUM_WARPS = [4]\n'
              'STAGES = [1, 2, 3]\nSWIZZLE = ["xor"]\nQ_IN_REGS = [true]\n'
              f'LAZY_RESCALE = [{str(lazy).lower()}]\nMIN_BLOCKS = [1]\nPIPELINE = ["split"]\n\n')
    path = tmp_path / "small.toml"
    path.write_text(text[:start] + params + text[end:])
    return SearchSpace.load(path)


def fake_time(params: dict[str, Any]) -> float:
    """A made-up landscape with one optimum."""
    t = 100.0 + abs(params["BLOCK_M"] - 128) / 4 + abs(params["BLOCK_N"] - 64) / 8
    t += 3 * abs(params["NUM_WARPS"] - 4) + 2 * (3 - params["STAGES"])
    t += {"none": 9, "pad": 4, "xor": 0}[params["SWIZZLE"]] + (0 if params["Q_IN_REGS"] else 1)
    t += (0 if params.get("LAZY_RESCALE", True) else 1.5) + 0.5 * (params.get("MIN_BLOCKS", 1) - 1)
    t += 0 if params.get("PIPELINE", "split") == "split" else 0.7
    return t


def stub_compile(candidate: Candidate, arch: str) -> CompileResult:
    """Compiles nothing; BLOCK_N 128 with 3 stages "fails", so compile errors are exercised."""
    if candidate.params.get("BLOCK_N") == 128 and candidate.params.get("STAGES") == 3:
        return CompileResult(candidate.identity, arch, False, error="error: planted")
    return CompileResult(candidate.identity, arch, True, registers=128, spill_stores=0,
                         spill_loads=0, smem_bytes=candidate.smem_bytes, cubin=b"stub")


class FakeEvaluator(Evaluator):
    def __init__(self, interrupt_after: int | None = None) -> None:
        self.evaluated: list[str] = []
        self.interrupt_after = interrupt_after
        self.final_calls = 0

    def start(self) -> DeviceInfo:
        return DeviceInfo("Fake H100", (9, 0), "0.0", {"torch": "fake"})

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        if self.interrupt_after is not None and len(self.evaluated) == self.interrupt_after:
            raise KeyboardInterrupt
        assert compiled.ok and compiled.identity == candidate.identity
        self.evaluated.append(candidate.identity)
        if candidate.params["SWIZZLE"] == "none" and candidate.params["STAGES"] == 1:
            return Evaluation(False, reason="wrong answer: planted", max_err=1.0,
                              tolerance=0.01)
        return Evaluation(True, median_us=fake_time(candidate.params), spread_us=0.5, reps=50,
                          graph=False, max_err=1e-3, tolerance=2e-3)

    def baseline(self) -> dict[str, float | None]:
        return {"flash": 110.0, "cudnn": 80.0}

    def final(self, entries: Any, rounds: int) -> dict[str, Any]:
        self.final_calls += 1
        return {"candidates": [{"median_us": fake_time(c.params), "spread_us": 0.1,
                                "rounds": rounds} for c, _ in entries],
                "flash": 110.0, "cudnn": 80.0}


def config(tmp_path: Path, **kw: Any) -> SearchConfig:
    base = dict(workload=WORKLOAD, spaces=[mma()], arch=SM90,
                store=f"sqlite:///{tmp_path / 'evo.db'}", trials=20, seed=1, compile_workers=2)
    return SearchConfig(**{**base, **kw})  # type: ignore[arg-type]


def run(cfg: SearchConfig, evaluator: Evaluator) -> Any:
    return search(cfg, evaluator=evaluator, progress=Progress(1.0, quiet=True),
                  compile_fn=stub_compile)


# ---- domain and sampler -------------------------------------------------------------------

def test_domain_holds_exactly_the_admitted_points() -> None:
    domain = Domain([mma()], WORKLOAD, SM90)
    admitted = mma().admitted(WORKLOAD.problem(), SM90)
    assert len(domain) == len(admitted) > 50
    for family, params in domain.all_points():
        assert family == "mma" and not domain.violations(family, params)
    study = optuna.create_study()
    trial = study.ask()
    family, params = domain.suggest(trial)
    assert trial.params == domain.to_trial_params(family, params)
    assert domain.from_trial_params(trial.params) == (family, params)


def test_domain_refuses_a_target_no_space_admits() -> None:
    with pytest.raises(ValueError, match="no search space admits"):
        Domain([mma()], Workload(1, 1, 64, 1000), SM90)  # head dim no kernel takes


@pytest.mark.parametrize("random_only", [False, True])
def test_sampler_walks_the_whole_domain_without_repeats(tmp_path: Path,
                                                        random_only: bool) -> None:
    domain = Domain([small_space(tmp_path)], WORKLOAD, SM90)
    blocked = {domain.identity(*domain.all_points()[0])}
    sampler = EvoSampler(domain, seed=0, blocked=lambda: blocked, random_only=random_only,
                         population=2)
    study = optuna.create_study(sampler=sampler)
    seen = []
    for _ in range(len(domain) - 1):
        trial = study.ask()
        point = domain.suggest(trial)
        seen.append(domain.identity(*point))
        study.tell(trial, fake_time(point[1]))
    assert len(set(seen)) == len(seen) == len(domain) - 1
    assert not set(seen) & blocked
    trials = study.get_trials(deepcopy=False)
    assert sampler.propose(trials, sampler.seen(trials)) is None


def test_sampler_tries_seeds_first_and_breeds_admitted_points() -> None:
    domain = Domain([mma()], WORKLOAD, SM90)
    points = domain.all_points()
    seeds = [points[5], points[9]]
    sampler = EvoSampler(domain, seed=3, seeds=seeds, population=8)
    study = optuna.create_study(sampler=sampler)
    got = []
    for _ in range(60):
        trial = study.ask()
        point = domain.suggest(trial)
        assert not domain.violations(*point)
        got.append(point)
        study.tell(trial, fake_time(point[1]))
    assert got[:2] == seeds
    ids = [domain.identity(*p) for p in got]
    assert len(set(ids)) == len(ids)


def test_evo_beats_random_on_a_smooth_landscape() -> None:
    """Median over seeds of the best found in 40 trials: the GA must do at least as well."""
    domain = Domain([mma()], WORKLOAD, SM90)
    optimum = min(fake_time(p) for _, p in domain.all_points())

    def best(random_only: bool, seed: int) -> float:
        study = optuna.create_study(sampler=EvoSampler(domain, seed=seed,
                                                       random_only=random_only))
        for _ in range(40):
            trial = study.ask()
            _, params = domain.suggest(trial)
            study.tell(trial, fake_time(params))
        return study.best_value - optimum

    evo = sorted(best(False, s) for s in range(9))[4]
    rnd = sorted(best(True, s) for s in range(9))[4]
    assert evo <= rnd


def test_evo_draws_random_points_evenly_over_families() -> None:
    """Mutation never changes a family, so the random points must reach the small ones."""
    from evoengine.space import default_spaces

    domain = Domain(default_spaces(), Workload(16, 16, 2048, 64), SM90)
    sizes = {f: len(p) for f, p in domain.points.items()}
    assert min(sizes.values()) * 10 < max(sizes.values())  # wmma is tiny next to the others
    # A random first population of 60: about 20 a family if balanced, against the 0-1 that
    # drawing points uniformly would give wmma (far from the bound, whatever the seed draws).
    study = optuna.create_study(sampler=EvoSampler(domain, seed=0, population=60))
    got = []
    for _ in range(60):
        trial = study.ask()
        got.append(domain.suggest(trial)[0])
        study.tell(trial, 1.0)
    counts = {f: got.count(f) for f in sizes}
    assert min(counts.values()) >= 10, counts


# ---- the loop -----------------------------------------------------------------------------

def test_search_records_everything_and_keeps_elites(tmp_path: Path) -> None:
    fake = FakeEvaluator()
    result = run(config(tmp_path), fake)
    assert result.status == "done" and fake.final_calls == 1
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ms = [m for m in store.measurements(run_id=result.run_id)
              if m.extra["phase"] == "search"]
        elites = store.elites(arch="sm_90a", workload_key=WORKLOAD.key())
        run_record = store.run(result.run_id)
    assert len(ms) == 20 == result.tally.finished
    assert len({m.identity for m in ms}) == 20  # nothing measured twice
    assert {m.identity for m in ms} >= set(fake.evaluated)
    valid = sorted((m.median_us, m.identity) for m in ms if m.ok)
    assert [e.identity for e in elites] == [i for _, i in valid[:5]]
    assert result.rows[0]["ours_us"] == valid[0][0]
    assert result.rows[0]["sdpa_flash_us"] == 110.0
    assert run_record is not None and run_record.status == "done"
    for m in ms:
        assert m.ok or m.reason  # every failure says why
    study = optuna.load_study(study_name=result.study, storage=f"sqlite:///{tmp_path / 'evo.db'}")
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    assert len(states) == 20
    doc = result.evidence()
    assert {"device", "driver", "torch", "commit", "date", "rows"} <= set(doc)
    assert {"family", "shape", "kv_heads", "seq_k", "causal", "dtype", "ours_us",
            "sdpa_flash_us", "sdpa_cudnn_us", "tflops", "params"} <= set(doc["rows"][0])


def test_resuming_a_study_never_measures_twice(tmp_path: Path) -> None:
    first = run(config(tmp_path, trials=12), FakeEvaluator())
    second_eval = FakeEvaluator()
    second = run(config(tmp_path, trials=12), second_eval)
    assert first.study == second.study
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ids = [m.identity for m in store.measurements() if m.extra["phase"] == "search"]
    assert len(ids) == 24 == len(set(ids))
    study = optuna.load_study(study_name=first.study, storage=f"sqlite:///{tmp_path / 'evo.db'}")
    assert len(study.trials) == 24


def test_a_study_is_tied_to_its_workload(tmp_path: Path) -> None:
    run(config(tmp_path, trials=2, study="mine"), FakeEvaluator())
    other = Workload(2, 8, 301, 64)
    with pytest.raises(SearchError, match="pick another --study"):
        run(config(tmp_path, trials=2, study="mine", workload=other), FakeEvaluator())


def test_arch_the_device_cannot_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SearchError, match="cannot run on this GPU"):
        run(config(tmp_path, arch=get_arch("sm_89")), FakeEvaluator())


def test_interrupt_keeps_what_was_measured_and_resumes(tmp_path: Path) -> None:
    result = run(config(tmp_path, trials=20), FakeEvaluator(interrupt_after=7))
    assert result.status == "interrupted"
    url = f"sqlite:///{tmp_path / 'evo.db'}"
    with Store(url) as store:
        assert store.run(result.run_id).status == "interrupted"  # type: ignore[union-attr]
        ms = store.measurements(run_id=result.run_id)
        assert store.elites(arch="sm_90a", workload_key=WORKLOAD.key())
    kept = {m.identity for m in ms}
    assert len([m for m in ms if not (m.reason or "").startswith("compile")]) == 7
    study = optuna.load_study(study_name=result.study, storage=url)
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)
    again = FakeEvaluator()
    run(config(tmp_path, trials=5), again)
    assert not set(again.evaluated) & kept


def slow_compile(candidate: Candidate, arch: str) -> CompileResult:
    """A compile that outlasts any test: what a Ctrl-C finds in flight."""
    time.sleep(600)
    return stub_compile(candidate, arch)


class InterruptWhileCompiling(Progress):
    """Ctrl-C, as the loop reports progress, once a compile has run for a second."""

    def __init__(self) -> None:
        super().__init__(1.0, quiet=True)
        self.since: float | None = None

    def update(self, t: Any, force: bool = False) -> None:
        if t.compiling and not force:
            self.since = self.since or time.monotonic()
            if time.monotonic() - self.since > 1.0:
                raise KeyboardInterrupt


def test_the_compilers_are_gone_when_a_search_returns(tmp_path: Path) -> None:
    """Its compile pool is joined before the final re-time and the store (never left closing
    its pipes beside them), whether the search drained it or a Ctrl-C found compiles running."""
    import multiprocessing as mp

    before = set(mp.active_children())  # whatever other tests left: not this search's
    result = run(config(tmp_path, trials=6), FakeEvaluator())
    assert result.status == "done" and set(mp.active_children()) <= before

    start = time.monotonic()
    result = search(config(tmp_path, trials=6, study="slow"), evaluator=FakeEvaluator(),
                    progress=InterruptWhileCompiling(), compile_fn=slow_compile)
    assert result.status == "interrupted"
    assert set(mp.active_children()) <= before  # the running compiles ended, not left asleep
    assert time.monotonic() - start < 60


def test_exhausting_the_domain_stops_the_search(tmp_path: Path) -> None:
    result = run(config(tmp_path, spaces=[small_space(tmp_path)], trials=50), FakeEvaluator())
    assert result.tally.finished == 6
    assert "every admitted candidate" in result.stopped_because


def test_elites_are_the_fastest_measured_when_a_search_stops_early(tmp_path: Path) -> None:
    result = run(config(tmp_path, trials=30), FakeEvaluator(interrupt_after=18))
    assert result.status == "interrupted"
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        elites = store.elites(arch="sm_90a", workload_key=WORKLOAD.key())
        ranked = store.ranked(arch="sm_90a", workload_key=WORKLOAD.key(), limit=5)
    assert [(e.identity, e.median_us) for e in elites] == ranked


@pytest.mark.parametrize("strategy", ["evo", "tpe"])
def test_trials_look_the_same_whichever_way_they_are_created(tmp_path: Path,
                                                             strategy: str) -> None:
    """Our samplers' trials are written in one transaction, Optuna's through ask and
    suggest: the study shows the same parameters, distributions and identity either way."""
    result = run(config(tmp_path, strategy=strategy, trials=8), FakeEvaluator())
    url = f"sqlite:///{tmp_path / 'evo.db'}"
    domain = Domain([mma()], WORKLOAD, SM90)
    dists = domain.distributions()
    with Store(url) as store:
        numbers = {m.identity: m.extra["trial"] for m in store.measurements(run_id=result.run_id)
                   if m.extra["phase"] == "search"}
    trials = optuna.load_study(study_name=result.study, storage=url).trials
    assert len(trials) >= 8
    for t in trials:
        point = domain.from_trial_params(t.params)
        assert point is not None and list(t.params) == list(domain.to_trial_params(*point))
        assert t.distributions == {n: dists[n] for n in t.params}
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert t.user_attrs["identity"] == domain.identity(*point)
            assert numbers[t.user_attrs["identity"]] == t.number
            assert t.datetime_start is not None and t.datetime_complete is not None


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "evo"])
def test_other_strategies_run_the_same_loop(tmp_path: Path, strategy: str) -> None:
    result = run(config(tmp_path, strategy=strategy, trials=15), FakeEvaluator())
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ids = [m.identity for m in store.measurements(run_id=result.run_id)
               if m.extra["phase"] == "search"]
    assert len(ids) == 15 == len(set(ids))


def test_a_target_stops_the_search_once_a_time_within_it_is_measured(tmp_path: Path) -> None:
    domain = Domain([mma()], WORKLOAD, SM90)
    times = sorted(fake_time(p) for _, p in domain.all_points())
    target = times[len(times) // 4]
    result = run(config(tmp_path, trials=200, target_us=target), FakeEvaluator())
    assert result.status == "done" and f"within {target:g} us" in result.stopped_because
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ms = [m for m in store.measurements(run_id=result.run_id)
              if m.extra["phase"] == "search"]
    first = next(i for i, m in enumerate(ms) if m.ok and m.median_us <= target)  # type: ignore[operator]
    assert first + 1 <= len(ms) <= first + 1 + 4  # then only the lookahead in flight
    assert len(ms) < 60


def pad_fails(candidate: Candidate, arch: str) -> CompileResult:
    """Every SWIZZLE=pad point "fails" (a third of the domain): the sampler's random first
    points draw some whatever the order compiles finish in (the planted BLOCK_N 128 x
    STAGES 3 failures of ``stub_compile`` sit far from the optimum, and a run under load once
    drew none of them in 60 trials)."""
    if candidate.params.get("SWIZZLE") == "pad":
        return CompileResult(candidate.identity, arch, False, error="error: planted")
    return stub_compile(candidate, arch)


def test_compile_errors_are_recorded_and_never_evaluated(tmp_path: Path) -> None:
    fake = FakeEvaluator()
    search(config(tmp_path, trials=60, seed=4), evaluator=fake,
           progress=Progress(1.0, quiet=True), compile_fn=pad_fails)
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        failed = [m for m in store.measurements() if m.reason and "compile" in m.reason]
        for m in failed:
            cand = store.candidate(m.identity)
            assert cand is not None and not cand.compile_reports["sm_90a"].ok
            assert m.identity not in fake.evaluated
    assert failed


# ---- the Optuna adapter -------------------------------------------------------------------

def test_the_optuna_adapter_holds_on_the_installed_optuna(tmp_path: Path) -> None:
    """``SearchStudy`` reads three private names of Optuna (``Study._storage``,
    ``Study._study_id``, ``Trial._trial_id``). Checked here through Optuna's public API on a
    storage of its own, so a release that changes them fails here, not in a search: trials
    are created holding their point and identity, end in the state and value written, and
    heartbeat (a silent one is failed as stale after the grace period)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    domain = Domain([small_space(tmp_path)], WORKLOAD, SM90)
    first, second = domain.all_points()[:2]
    with quiet_optuna():
        study = SearchStudy.open(open_storage(url, heartbeat_s=1, grace_s=1), "pinned",
                                 EvoSampler(domain, seed=0), domain)
        ours = study.create(*first, domain.identity(*first))
        asked, point = study.ask()  # Optuna's own path (our sampler proposes through it too)
        silent = study.create(*second, None)
        public = optuna.storages.RDBStorage(url)
    study_id = public.get_study_id_from_name("pinned")
    for trial in (ours, asked, silent):
        assert study.trial_id(trial) == public.get_trial_id_from_study_id_trial_number(
            study_id, trial.number)
    written = public.get_trial(study.trial_id(ours))
    assert written.state == optuna.trial.TrialState.RUNNING
    assert written.params == domain.to_trial_params(*first)
    assert written.distributions == {n: domain.distributions()[n] for n in written.params}
    assert written.user_attrs == {"identity": domain.identity(*first)}
    assert public.get_trial(study.trial_id(asked)).params == domain.to_trial_params(*point)

    study.complete(ours, 12.5)
    study.fail(asked, "planted")
    done, failed = (public.get_trial(study.trial_id(t)) for t in (ours, asked))
    assert done.state == optuna.trial.TrialState.COMPLETE and done.value == 12.5
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["reason"] == "planted"
    assert study.finished(study.trial_id(ours)) and not study.finished(study.trial_id(silent))
    study.complete(ours, 1.0)  # finished already: a no-op, as when another worker failed it
    assert public.get_trial(study.trial_id(ours)).value == 12.5

    deadline = time.monotonic() + 15
    while not study.finished(study.trial_id(silent)):
        assert time.monotonic() < deadline, "the silent trial was never failed as stale"
        time.sleep(0.25)
        with quiet_optuna():
            study.fail_stale()
    assert public.get_trial(study.trial_id(silent)).state == optuna.trial.TrialState.FAIL


# ---- fault isolation ----------------------------------------------------------------------

def planted_worker(conn: Any, _workload: dict[str, Any], _device: int) -> None:
    """A worker that dies on FAULT points and never answers on HANG points."""
    conn.send(("ready", DeviceInfo("Fake H100", (9, 0), "0.0")))
    while True:
        op, payload = conn.recv()
        if op == "stop":
            return
        if op == "baseline":
            conn.send(("ok", {"flash": 100.0, "cudnn": 90.0}))
            continue
        if op == "final":
            entries, rounds = payload
            conn.send(("ok", {"candidates": [{"median_us": fake_time(c.params),
                                              "spread_us": 0.0, "rounds": rounds}
                                             for c, _ in entries],
                              "flash": 100.0, "cudnn": 90.0}))
            continue
        candidate, _ = payload
        picked = {k: candidate.params[k] for k in FAULT}
        if picked == FAULT:
            os.abort()  # as a kernel fault takes the process down
        if picked == HANG:
            time.sleep(3600)
        conn.send(("ok", {"ok": True, "median_us": fake_time(candidate.params),
                          "spread_us": 0.1, "reps": 50, "graph": False}))


def test_a_fault_and_a_hang_each_cost_one_trial(tmp_path: Path) -> None:
    evaluator = WorkerEvaluator(planted_worker, ({}, 0), timeout_s=3.0, start_timeout_s=60)
    try:
        result = run(config(tmp_path, spaces=[small_space(tmp_path)], trials=6), evaluator)
    finally:
        evaluator.close()
    assert result.status == "done"
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ms = [m for m in store.measurements(run_id=result.run_id)
              if m.extra["phase"] == "search"]
    failed = {m.reason.split(":")[0] for m in ms if not m.ok}  # type: ignore[union-attr]
    assert len(ms) == 6 and sum(m.ok for m in ms) == 4
    assert failed == {"fault", "timeout"}
    assert result.tally.faults == 2 and evaluator.restarts == 2
    assert len(result.rows) == 4  # the final re-time ran on a fresh worker


def test_worker_evaluator_reports_a_worker_that_cannot_start() -> None:
    from evoengine.search import EvaluatorError

    evaluator = WorkerEvaluator(broken_worker, (), timeout_s=1.0, start_timeout_s=30)
    with pytest.raises(EvaluatorError, match="could not start: no GPU here"):
        evaluator.start()


def broken_worker(conn: Any) -> None:
    conn.send(("error", "no GPU here"))


def test_a_worker_that_cannot_start_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's errors through torch run on for lines of advice; the reason the parent prints
    keeps the first. A device index past the visible ones is named before CUDA is asked."""
    import multiprocessing as mp

    import torch

    from evoengine.search import worker

    def cuda_error(*args: Any) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal\nCUDA kernel errors might be "
                           "asynchronously reported\nFor debugging consider passing "
                           "CUDA_LAUNCH_BLOCKING=1")

    parent, child = mp.Pipe()
    monkeypatch.setattr(worker, "GpuWorker", cuda_error)
    monkeypatch.setattr(worker.signal, "signal", lambda *args: None)  # serve's SIGINT: not ours
    worker.serve(child, WORKLOAD.to_dict(), 0)
    assert parent.recv() == ("error", "RuntimeError: CUDA error: invalid device ordinal")

    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"^no CUDA device 4 is visible to torch \(devices 0 "
                                           r"to 1 are\)$"):
        worker.GpuWorker(WORKLOAD, 4)


def test_random_landscape_sanity() -> None:
    """fake_time has a unique optimum among admitted points (the tests above rely on it)."""
    domain = Domain([mma()], WORKLOAD, SM90)
    times = sorted(fake_time(p) for _, p in domain.all_points())
    assert times[0] < times[1]
