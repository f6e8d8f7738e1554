"""The search spread over GPUs, processes and hosts: claims make every candidate measured at
most once, a worker killed with SIGKILL loses nothing, SQLite takes several writers.

Workers are separate OS processes running ``evoengine search --replay`` on 36 points of the
H100 sweep shipped in tests/data (the replay evaluator, with a delay per evaluation standing
in for the GPU), as separate hosts would be. The same tests run on PostgreSQL when
``EVO_TEST_POSTGRES`` names a server (``.ci/run`` starts one): each test gets a database of
its own there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa

from evoengine import paths
from evoengine.search import Progress, SearchConfig, search
from evoengine.search.replay import load_record, replay_domain, save_record
from evoengine.space import SearchSpace
from evoengine.store import Store
from tests.dist_worker import DelayEvaluator
from tests.test_search import SM90, WORKLOAD, stub_compile

ROOT = Path(__file__).resolve().parent.parent
POSTGRES = os.environ.get("EVO_TEST_POSTGRES")
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(
    not POSTGRES, reason="EVO_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server "
    "and sets it; locally: EVO_TEST_POSTGRES=postgresql+psycopg://user@127.0.0.1:PORT/db)"))]


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store: a SQLite file, or a new database on the PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'evo.db'}"
        return
    assert POSTGRES
    server = sa.make_url(POSTGRES)
    name = f"evo_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def space36(tmp_path: Path) -> Path:
    """mma with 36 admitted points: small enough for a few workers to exhaust."""
    text = (paths.SPACES / "mma.toml").read_text()
    start, end = text.index("[parameters]"), text.index("[derived]")
    params = ('[parameters]\nBLOCK_M = [64, 128]\nBLOCK_N = [32, 64]\nNUM_WARPS = [4, 8]\n'
              'STAGES = [1, 2, 3]\nSWIZZLE = ["pad", "xor"]\nQ_IN_REGS = [true]\n'
              'LAZY_RESCALE = [true]\nMIN_BLOCKS = [1]\nPIPELINE = ["split"]\n\n')
    path = tmp_path / "space36.toml"
    path.write_text(text[:start] + params + text[end:])
    return path


SHIPPED = ROOT / "tests" / "data" / "sweep-sm_90a-b16-h16-kv16-sq2048-sk2048-d64-full-fp16.json.gz"
REPLAY_KEY = load_record(SHIPPED).workload.key()


def record36(tmp_path: Path) -> Path:
    """36 mma points of the shipped H100 sweep (their measured times and outcomes): few
    enough for a few workers to exhaust."""
    rec = load_record(SHIPPED)
    points = tuple(p for p in rec.points if p.family == "mma")[:36]
    return save_record(replace(rec, points=points), tmp_path / "sweep36.json.gz")


def domain_identities(record: Path) -> set[str]:
    return {i for i, _ in replay_domain(load_record(record)).items()}


def start_worker(url: str, record: Path, tmp_path: Path, i: int, *, delay: float,
                 trials: int = 100) -> subprocess.Popen[str]:
    """One search worker process: ``evoengine search --replay``, ``delay`` seconds per
    evaluation. Heartbeat 2 s, grace 6 s: SQLite's clock (Optuna's heartbeat) has
    one-second steps and a busy store stalls a writer for over a second."""
    cmd = [sys.executable, "-m", "evoengine", "search", "--replay", str(record),
           "--replay-delay", str(delay), "--workers", "1",
           "--store", url, "--trials", str(trials), "--seed", str(i),
           "--heartbeat", "2", "--json", str(tmp_path / f"worker{i}.json")]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def check_study(url: str, expected: set[str]) -> dict[str, Any]:
    """The invariants after every worker stopped: each expected identity measured exactly
    once in the search phase, nothing else; no trial RUNNING; trials agree with the
    measurements; no open claim left."""
    with Store(url) as store:
        ms = [m for m in store.measurements() if m.extra["phase"] == "search"]
        open_claims = store.open_claims(arch=SM90.name, workload_key=REPLAY_KEY)
        runs = {r.id: r for r in store.runs()}
    counts = Counter(m.identity for m in ms)
    assert [i for i, n in counts.items() if n > 1] == []  # nothing measured twice
    assert set(counts) == expected  # nothing lost: the domain was exhausted
    assert open_claims == {}
    study = optuna.load_study(study_name=runs[min(runs)].study, storage=url)
    trials = study.get_trials(deepcopy=False)
    states = Counter(t.state for t in trials)
    assert states[optuna.trial.TrialState.RUNNING] == 0
    complete = {t.user_attrs["identity"] for t in trials
                if t.state == optuna.trial.TrialState.COMPLETE}
    stale = [t for t in trials if t.state == optuna.trial.TrialState.FAIL
             and "reason" not in t.user_attrs]
    measured_ok = {m.identity for m in ms if m.ok}
    assert complete <= measured_ok  # no trial completed from nowhere
    # Every valid measurement was told to its trial, unless that trial had been failed as
    # stale first (its worker killed, or stalled past the grace period).
    assert measured_ok - complete <= {t.user_attrs.get("identity") for t in stale}
    # Every measurement belongs to one trial of the study.
    assert len({(m.run_id, m.extra["trial"]) for m in ms}) == len(ms)
    # Our sampler proposes only admitted, recorded points: a worker with nothing fresh left
    # waits or stops, it does not churn through Optuna's proposals (once 500 trials each).
    reasons = Counter(str(t.user_attrs.get("reason", ""))[:40] for t in trials)
    assert not any(r.startswith("rejected by the search space") for r in reasons), reasons
    return {"measurements": ms, "runs": runs, "stale": stale, "trials": trials}


# ---- claims -------------------------------------------------------------------------------

def _claim_all(url: str, run_id: int, identities: list[str], start: float) -> list[str]:
    with Store(url) as store:
        while time.time() < start:
            time.sleep(0.001)
        return [i for i in identities
                if store.claim(arch="sm_90a", workload_key="k", identity=i, run_id=run_id,
                               owner=str(os.getpid()))]


def test_claims_are_unique_under_races(url: str) -> None:
    identities = [f"cand-{i}" for i in range(60)]
    with Store(url) as store:
        run_id = store.start_run(arch="sm_90a", workload={}, workload_key="k")
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        start = time.time() + 2.0  # all four claim the same list at the same moment
        got = pool.starmap(_claim_all, [(url, run_id, identities, start)] * 4)
    claimed = [i for g in got for i in g]
    assert sorted(claimed) == sorted(identities)  # each exactly once, none refused wrongly
    with Store(url) as store:
        assert store.taken_identities(arch="sm_90a", workload_key="k") == set(identities)
        assert not store.claim(arch="sm_90a", workload_key="k", identity="cand-0",
                               run_id=run_id)
        assert store.release_claims(arch="sm_90a", workload_key="k",
                                    identities=identities[:3]) == 3
        assert store.claim(arch="sm_90a", workload_key="k", identity="cand-0", run_id=run_id)


# ---- worker processes ---------------------------------------------------------------------

def test_concurrent_workers_share_a_study(url: str, tmp_path: Path) -> None:
    """Four processes write the loop's pattern to one store at once: none fails, and the
    36 points are measured once each."""
    record = record36(tmp_path)
    procs = [start_worker(url, record, tmp_path, i, delay=0.02) for i in range(4)]
    outs = [finish(p) for p in procs]
    assert not any("Traceback" in o or "locked" in o for o in outs)
    seen = check_study(url, domain_identities(record))
    assert len(seen["runs"]) == 4


def test_a_killed_worker_loses_and_duplicates_nothing(url: str, tmp_path: Path) -> None:
    """SIGKILL one of three workers while it holds claims: its RUNNING trials stop
    heartbeating, a surviving worker fails them (grace 6 s) and releases their claims,
    and the points are measured by a survivor, once."""
    record = record36(tmp_path)
    victim = start_worker(url, record, tmp_path, 0, delay=0.3)
    owner = f"{socket.gethostname()}:{victim.pid}"
    survivors = [start_worker(url, record, tmp_path, i, delay=0.3) for i in (1, 2)]
    held: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and victim.poll() is None:
        held = _claims_of(url, owner)
        if sum(m is not None for m in held.values()) >= 2 and None in held.values():
            break  # it has measured some and holds a claim it has not measured yet
        time.sleep(0.05)
    assert victim.poll() is None, "the victim finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    held = _claims_of(url, owner)
    orphaned = {i for i, measured_at in held.items() if measured_at is None}
    assert orphaned
    for p in survivors:
        finish(p)
    # The survivors waited for the victim's trials to go stale (a trial it had asked for
    # but not claimed yet included) and failed them. Fail any left, as the next worker to
    # start would, so the study has no RUNNING trial.
    time.sleep(max(0.0, killed_at + 6 + 2 - time.monotonic()))
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=2, grace_period=6)
    with Store(url) as store:
        study_name = store.runs()[-1].study
    optuna.storages.fail_stale_trials(optuna.load_study(study_name=study_name,
                                                        storage=storage))
    seen = check_study(url, domain_identities(record))
    assert seen["stale"]  # the victim's trials, failed by the heartbeat check
    by = {m.identity: m.run_id for m in seen["measurements"]}
    assert all(by[i] not in _runs_of(url, owner) for i in orphaned)  # retried elsewhere
    import json

    released = sum(json.loads((tmp_path / f"worker{i}.json").read_text())["search"]
                   ["claims_released"] for i in (1, 2))
    assert released >= len(orphaned)


@pytest.mark.parametrize("beat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_a_worker_killed_between_asking_and_claiming_loses_nothing(tmp_path: Path,
                                                                   beat: bool) -> None:
    """A trial another worker asked for, holding its point, whose worker died before it
    claimed the point: a survivor with nothing else fresh waits for the trial to go stale
    and then measures the point, rather than stopping with the point unmeasured or waiting
    for ever. Killed before the trial's first heartbeat, the trial is one Optuna's stale
    check never fails: the survivor fails it once it is older than the grace period."""
    from evoengine.search.domain import Domain

    space = SearchSpace.load(space36(tmp_path))
    url = f"sqlite:///{tmp_path / 'evo.db'}"
    cfg = SearchConfig(workload=WORKLOAD, spaces=[space], arch=SM90, store=url, trials=4,
                       seed=1, compile_workers=1, heartbeat_s=1, grace_s=3)
    search(cfg, evaluator=DelayEvaluator(0.0), progress=Progress(1.0, quiet=True),
           compile_fn=stub_compile)
    domain = {i for i, _ in Domain([space], WORKLOAD, SM90).items()}
    with Store(url) as store:
        measured = store.measured_identities(arch=SM90.name, workload_key=WORKLOAD.key())
        study_name = store.runs()[-1].study
    orphan = sorted(domain - measured)[0]
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=3)
    dead = optuna.load_study(study_name=study_name, storage=storage).ask()
    dead.set_user_attr("identity", orphan)  # asked, holding its point, never claimed
    if beat:
        storage.record_heartbeat(dead._trial_id)
    survivor = DelayEvaluator(0.0)
    search(replace(cfg, trials=100), evaluator=survivor, progress=Progress(1.0, quiet=True),
           compile_fn=stub_compile)
    assert orphan in survivor.evaluated
    with Store(url) as store:
        assert store.measured_identities(arch=SM90.name, workload_key=WORKLOAD.key()) == domain
    assert storage.get_trial(dead._trial_id).state == optuna.trial.TrialState.FAIL


def _claims_of(url: str, owner: str) -> dict[str, Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            try:
                rows = conn.execute(sa.text("SELECT identity, measured_at FROM evo_claims "
                                            "WHERE owner = :o"), {"o": owner})
                return dict(rows.all())  # type: ignore[arg-type]
            except sa.exc.DBAPIError:  # not created yet
                return {}
    finally:
        engine.dispose()


def _runs_of(url: str, owner: str) -> set[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT DISTINCT run_id FROM evo_claims "
                                        "WHERE owner = :o"), {"o": owner})
            return {r for (r,) in rows}
    finally:
        engine.dispose()


# ---- several GPUs in one process ----------------------------------------------------------

def _gpus_run(tmp_path: Path, n: int, trials: int, delay: float) -> tuple[Any, list[Any]]:
    fakes = [DelayEvaluator(delay) for _ in range(n)]
    cfg = SearchConfig(workload=WORKLOAD, spaces=[SearchSpace.load(space36(tmp_path))],
                       arch=SM90, store=f"sqlite:///{tmp_path / f'gpus{n}.db'}", trials=trials,
                       seed=1, compile_workers=1, gpus=list(range(n)))
    result = search(cfg, evaluator=fakes, progress=Progress(1.0, quiet=True),
                    compile_fn=stub_compile)
    return result, fakes


def test_gpus_share_the_work_and_evaluate_each_point_once(tmp_path: Path) -> None:
    one, _ = _gpus_run(tmp_path, 1, 16, delay=0.25)
    two, fakes = _gpus_run(tmp_path, 2, 36, delay=0.25)
    evaluated = [i for f in fakes for i in f.evaluated]
    assert len(evaluated) == len(set(evaluated)) == 36
    assert min(len(f.evaluated) for f in fakes) >= 12  # both GPUs did a share
    assert two.tally.per_gpu == {0: len(fakes[0].evaluated), 1: len(fakes[1].evaluated)}
    doc = two.evidence()["search"]
    assert set(doc["gpus"]) == {"0", "1"}
    rates = [g["evals_per_minute"] for g in doc["gpus"].values()]
    assert abs(sum(rates) - doc["evals_per_minute"]) < 1e-6 * doc["evals_per_minute"]
    # The fake GPUs are the bottleneck, so two should give nearly twice the rate of one.
    assert doc["evals_per_minute"] >= 1.6 * one.tally.evals_per_minute()


def test_gpus_and_device_conflict() -> None:
    from evoengine.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["search", "--shape", "1,8,512,64", "--gpus", "0,1", "--device", "1"])
    assert exited.value.code == 2
