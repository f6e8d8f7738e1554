"""The replay (``evoengine.search.replay``) without a GPU: the record format, the exporter
from a store, the evaluator, the recorded domain and ``evoengine search --replay``.

Records here are SYNTHETIC (a cost model over the mma domain of one workload), made in
fixtures; no test reads them as measurements.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from evoengine import paths
from evoengine.cli import main
from evoengine.search import Progress, SearchConfig, search
from evoengine.search.replay import (
    NOT_RECORDED,
    Record,
    RecordError,
    ReplayEvaluator,
    load_record,
    point_key,
    record_from_store,
    replay_compile,
    replay_domain,
    save_record,
    synthetic_record,
)
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload
from tests.test_search import SM90, WORKLOAD, FakeEvaluator, fake_time, mma, stub_compile

KEY = WORKLOAD.key()


@pytest.fixture(scope="module")
def record() -> Record:
    return synthetic_record(WORKLOAD, spaces=[mma()], seed=3)


@pytest.fixture(scope="module")
def small(record: Record) -> Record:
    """56 points of the record, every outcome among them, to replay quickly."""
    ok = [p for p in record.points if p.ok]
    wrong = [p for p in record.points if not p.ok and p.compiled]
    broken = [p for p in record.points if not p.compiled]
    return replace(record, points=tuple(ok[:50] + wrong[:3] + broken[:3]))


@pytest.fixture
def record_file(tmp_path: Path, small: Record) -> Path:
    return save_record(small, tmp_path / "sweep.json.gz")


def wgmma_legacy() -> dict[str, object]:
    """The values the wgmma space fills into a point recorded before its later parameters."""
    return dict(SearchSpace.load(paths.SPACES / "wgmma.toml").legacy)


def replay(tmp_path: Path, rec: Record, **kw: Any) -> tuple[Any, ReplayEvaluator]:
    evaluator = ReplayEvaluator(rec)
    cfg = SearchConfig(**{"workload": rec.workload, "spaces": [mma()], "arch": SM90,
                          "store": f"sqlite:///{tmp_path / 'replay.db'}", "trials": 20,
                          "seed": 1, "compile_workers": 2, **kw})
    result = search(cfg, evaluator=evaluator, progress=Progress(1.0, quiet=True),
                    compile_fn=replay_compile(rec), domain=replay_domain(rec, cfg.spaces))
    return result, evaluator


def search_measurements(tmp_path: Path, run_id: int) -> list[Any]:
    with Store(f"sqlite:///{tmp_path / 'replay.db'}") as store:
        return [(m, store.candidate(m.identity)) for m in store.measurements(run_id=run_id)
                if m.extra["phase"] == "search"]


# ---- the format ---------------------------------------------------------------------------

def test_a_record_round_trips_through_its_file(tmp_path: Path, record: Record) -> None:
    path = save_record(record, tmp_path / "r.json.gz")
    again = load_record(path)
    assert again == record and again.path == str(path)
    plain = load_record(save_record(record, tmp_path / "r.json"))
    assert plain == record
    assert again.synthetic and "SYNTHETIC" in again.describe()
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert doc["format"] == 1 and doc["workload"] == WORKLOAD.to_dict()
    assert doc["families"]["mma"]["parameters"] == list(mma().parameters)
    kinds = {(p["ok"], p["compiled"]) for p in doc["points"]}
    assert kinds == {(True, True), (False, True), (False, False)}  # all outcomes exercised


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("points"), "missing points"),
    (lambda d: d.update(format=2), "format 2"),
    (lambda d: d.update(arch="sm_99"), "malformed"),
    (lambda d: d["points"].append(dict(d["points"][0])), "recorded twice"),
    (lambda d: d["points"][0].update(ok=True, median_us=None), "ok=True but median_us=None"),
    (lambda d: d["points"][0]["params"].pop("STAGES"), "not the family's declared"),
    (lambda d: d["points"][0].update(family="wgmma"), "not listed in 'families'"),
    (lambda d: d["points"][0].update(colour="red"), "unknown fields"),
    (lambda d: d.update(points=[]), "no points"),
])
def test_malformed_records_are_refused_clearly(tmp_path: Path, record: Record, change: Any,
                                               message: str) -> None:
    doc = record.to_dict()
    change(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RecordError, match=message) as err:
        load_record(path)
    assert str(path) in str(err.value)


def test_a_file_that_is_not_a_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json.gz"
    path.write_bytes(b"not gzip")
    with pytest.raises(RecordError, match="not a JSON record"):
        load_record(path)


def test_a_record_of_other_parameters_is_refused(record: Record) -> None:
    families = {"mma": {**record.families["mma"],
                        "parameters": [*record.families["mma"]["parameters"], "EXTRA"]}}
    points = tuple(replace(p, params={**p.params, "EXTRA": 1}) for p in record.points)
    other = replace(record, families=families, points=points)
    with pytest.raises(RecordError, match="differ from the search space"):
        replay_domain(other, [mma()])


# ---- the domain and the evaluator ---------------------------------------------------------

def test_the_replay_domain_holds_exactly_the_recorded_points(record: Record) -> None:
    half = replace(record, points=record.points[::2])
    domain = replay_domain(half, [mma()])
    assert len(domain) == len(half.points) < len(record.points)
    assert {point_key(f, p) for f, p in domain.all_points()} == {
        point_key(p.family, p.params) for p in half.points}
    missing = record.points[1]
    assert domain.violations(missing.family, missing.params) == [NOT_RECORDED]
    assert domain.violations(*domain.all_points()[0]) == []


def test_replay_reproduces_recorded_values_and_failures(tmp_path: Path,
                                                        record_file: Path) -> None:
    rec = load_record(record_file)
    result, evaluator = replay(tmp_path, rec, trials=len(rec.points) + 5)
    assert "every admitted candidate" in result.stopped_because
    rows = search_measurements(tmp_path, result.run_id)
    assert len(rows) == len(rec.points)
    for m, cand in rows:
        p = rec.lookup(cand.family, cand.params)
        assert p is not None and m.ok == p.ok
        if p.ok:
            assert (m.median_us, m.spread_us) == (p.median_us, p.spread_us)
        elif not p.compiled:
            assert m.reason == p.reason  # "compile error: ..." as the loop words it
            assert not cand.compile_reports["sm_90a"].ok
            assert (cand.family, cand.params) not in evaluator.evaluated
        else:
            assert m.reason == p.reason and (cand.family, cand.params) in evaluator.evaluated
    assert result.rows[0]["ours_us"] == rec.optimum().median_us
    assert result.tally.baseline["flash"] == rec.sdpa["flash"]
    assert result.device.name == rec.device


@pytest.mark.parametrize("strategy", ["evo", "tpe"])
def test_a_replayed_search_never_builds_an_unrecorded_point(tmp_path: Path, record: Record,
                                                            strategy: str) -> None:
    kept = tuple(p for i, p in enumerate(record.points) if i % 4)  # a quarter unrecorded
    rec = load_record(save_record(replace(record, points=kept), tmp_path / "part.json.gz"))
    result, evaluator = replay(tmp_path, rec, trials=20, strategy=strategy)
    rows = search_measurements(tmp_path, result.run_id)
    assert len(rows) == 20
    for _, cand in rows:
        assert rec.lookup(cand.family, cand.params) is not None
    assert all(rec.lookup(f, p) is not None for f, p in evaluator.evaluated)
    if strategy == "tpe":  # Optuna's proposals of unrecorded points are refused unbuilt
        study = optuna.load_study(study_name=result.study,
                                  storage=f"sqlite:///{tmp_path / 'replay.db'}")
        reasons = [t.user_attrs.get("reason", "") for t in study.trials]
        assert any(NOT_RECORDED in r for r in reasons)


def test_replay_delay_simulates_gpu_time(record: Record) -> None:
    import time

    domain = replay_domain(record, [mma()])
    candidate = domain.candidate(*domain.all_points()[0])
    slow = ReplayEvaluator(record, delay_s=0.05)
    start = time.perf_counter()
    slow.evaluate(candidate, stub_compile(candidate, "sm_90a"))
    assert time.perf_counter() - start >= 0.05


# ---- the exporter -------------------------------------------------------------------------

def test_the_exporter_round_trips_a_search(tmp_path: Path) -> None:
    from tests.test_search import config, run

    fake = FakeEvaluator()
    result = run(config(tmp_path, trials=30, seed=4), fake)
    url = f"sqlite:///{tmp_path / 'evo.db'}"
    with Store(url) as store:
        rec = record_from_store(store, "sm_90a", KEY, note="fake")
        ms = [m for m in store.measurements(run_id=result.run_id) if m.extra["phase"] == "search"]
        cands = {m.identity: store.candidate(m.identity) for m in ms}
    assert rec.device == "Fake H100" and rec.runs == (result.run_id,) and rec.note == "fake"
    assert rec.sdpa == {"flash": 110.0, "cudnn": 80.0} and rec.commit == result.evidence()[
        "commit"]
    assert len(rec.points) == len(ms) == 30
    compile_errors = 0
    for m in ms:
        c = cands[m.identity]
        p = rec.lookup(c.family, c.params)
        assert p is not None and p.ok == m.ok and p.median_us == m.median_us
        if p.ok:
            assert p.median_us == fake_time(c.params)
        else:
            assert p.reason == m.reason
        compile_errors += not p.compiled
        assert p.compiled == c.compile_reports["sm_90a"].ok
    assert compile_errors == sum("compile" in (m.reason or "") for m in ms)
    # and the record replays to the same measurements
    path = save_record(rec, tmp_path / "exported.json.gz")
    again, _ = replay(tmp_path, load_record(path), trials=40)
    replayed = search_measurements(tmp_path, again.run_id)
    assert len(replayed) == 30  # only the recorded points exist
    assert {(c.identity, m.ok, m.median_us) for m, c in replayed} == {
        (i, m.ok, m.median_us) for i, m in ((m.identity, m) for m in ms)}


def test_the_exporter_refuses_what_it_cannot_record(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'empty.db'}") as store:
        with pytest.raises(RecordError, match="no run of"):
            record_from_store(store, "sm_90a", KEY)
        run_id = store.start_run(arch="sm_90a", workload=WORKLOAD.to_dict(), workload_key=KEY,
                                 device="Fake")
        with pytest.raises(RecordError, match="hold no search-phase measurement"):
            record_from_store(store, "sm_90a", KEY)
        with pytest.raises(RecordError, match="are not runs of"):
            record_from_store(store, "sm_90a", KEY, run_ids=[run_id, run_id + 1])


# ---- the command line ---------------------------------------------------------------------

def test_cli_search_replay_and_record(tmp_path: Path, record_file: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from evoengine import paths

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    space = str(paths.SPACES / "mma.toml")
    assert main(["search", "--replay", str(record_file), "--space", space, "--trials", "12",
                 "--store", url, "--workers", "1", "--seed", "2"]) == 0
    err = capsys.readouterr().err
    assert "SYNTHETIC" in err and "12 trials done" in err
    out = tmp_path / "again.json.gz"
    assert main(["record", "--store", url, "--shape", "2,8,300,64", "-o", str(out)]) == 0
    again = load_record(out)
    assert len(again.points) == 12 and again.synthetic
    assert main(["search", "--replay", str(record_file), "--shape", "2,8,301,64",
                 "--store", url]) == 2
    assert "records b2-h8-kv8-sq300" in capsys.readouterr().err
    assert main(["search", "--replay", str(record_file), "--arch", "sm_89",
                 "--store", url]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["search", "--replay", str(bad), "--store", url]) == 2
    assert "missing" in capsys.readouterr().err


# ---- the recorded sweeps shipped in tests/data ---------------------------------------------

RECORDS = sorted((Path(__file__).parent / "data").glob("sweep-*.json.gz"))


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_the_shipped_sweeps_replay_with_the_spaces_they_were_swept_with(tmp_path: Path,
                                                                        path: Path) -> None:
    rec = load_record(path)
    assert not rec.synthetic and rec.device.startswith("NVIDIA") and rec.commit and rec.date
    assert all("space" in info for info in rec.families.values())
    domain = replay_domain(rec)  # the record's own spaces: today's may have new parameters
    assert domain.skipped == [] and len(domain) == len(rec.points)
    result = search(SearchConfig(workload=rec.workload, arch=domain.arch, trials=20, seed=1,
                                 store=f"sqlite:///{tmp_path / 'r.db'}", compile_workers=2,
                                 spaces=list(domain.spaces.values())),
                    evaluator=ReplayEvaluator(rec), compile_fn=replay_compile(path),
                    domain=domain, progress=Progress(1.0, quiet=True))
    assert result.tally.evaluated == 20 and result.status == "done"
    assert min(r["ours_us"] for r in result.rows) >= rec.optimum().median_us


# ---- a store written by a replay outlives the spaces it was searched with -------------------

SWEEP = Path(__file__).parent / "data" / (
    "sweep-sm_90a-b8-h16-kv16-sq4096-sk4096-d128-causal-fp16.json.gz")


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The store of ``evoengine search --replay`` of a shipped sweep: its points in the layout
    they were swept with, before TILE_ORDER and SCHEDULER were added to wgmma."""
    url = f"sqlite:///{tmp_path_factory.mktemp('replayed') / 'replay.db'}"
    assert main(["search", "--replay", str(SWEEP), "--trials", "30", "--seed", "1",
                 "--workers", "1", "--store", url]) == 0
    with Store(url) as store:
        elites = store.elites(arch="sm_90a")
    # The sweep's best mma point (1496.5 us) is slower than its median wgmma one (1347.8 us).
    assert [e.family for e in elites[:2]] == ["wgmma", "wgmma"]
    assert all("TILE_ORDER" not in e.params and "SCHEDULER" not in e.params
               for e in elites if e.family == "wgmma")
    return url


def test_a_replayed_store_exports_with_the_legacy_values(
        replayed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #15: ``export best`` of a replay's store failed with "missing parameters
    ['SCHEDULER', 'TILE_ORDER']"."""
    from evoengine.space import SearchSpace
    from tests.test_export import import_path

    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tuned.py"
    assert main(["export", "best", "--store", replayed, "--arch", "sm_90a", "-o", str(out)]) == 0
    with Store(replayed) as store:
        (elite,) = [e for e in store.elites(arch="sm_90a") if e.rank == 1]
    (spec,) = import_path(out, "tuned_attention_replayed")._KERNEL_SPECS
    assert spec["params"] == {**elite.params, **wgmma_legacy()}
    wgmma = SearchSpace.load(paths.SPACES / "wgmma.toml")
    assert list(spec["params"]) == list(wgmma.parameters)


def test_a_replayed_store_records_in_todays_layout(replayed: str) -> None:
    from evoengine.space import default_spaces

    with Store(replayed) as store:
        (run,) = store.runs()
        rec = record_from_store(store, "sm_90a", run.workload_key)
        stored = {(c.family, json.dumps(c.params, sort_keys=True)) for c in store.candidates()}
    wgmma = {s.family: s for s in default_spaces()}["wgmma"]
    assert rec.families["wgmma"]["parameters"] == list(wgmma.parameters)
    assert rec.families["wgmma"]["space"] == wgmma.path.read_text()  # type: ignore[union-attr]
    points = [p for p in rec.points if p.family == "wgmma"]
    assert points and all(p.params["TILE_ORDER"] == "head" and p.params["SCHEDULER"] == "static"
                          for p in points)
    swept = load_record(SWEEP)
    for p in points:  # each the swept point, with the legacy values filled in
        before = {k: v for k, v in p.params.items() if k not in wgmma.legacy}
        assert ("wgmma", json.dumps(before, sort_keys=True)) in stored
        assert swept.lookup("wgmma", before).median_us == p.median_us  # type: ignore[union-attr]


def builds(candidate: Any, arch: str) -> Any:
    """Compiles nothing and fails nothing."""
    from evoengine.compile import CompileResult

    return CompileResult(candidate.identity, arch, True, registers=128, spill_stores=0,
                         spill_loads=0, smem_bytes=candidate.smem_bytes, cubin=b"stub")


class Steady(FakeEvaluator):
    """Every point valid and equally fast, whatever its family."""

    def evaluate(self, candidate: Any, compiled: Any) -> Any:
        from evoengine.search.evaluator import Evaluation

        self.evaluated.append(candidate.identity)
        return Evaluation(True, median_us=500.0, spread_us=0.5, reps=50, graph=False,
                          max_err=1e-3, tolerance=2e-3)

    def final(self, entries: Any, rounds: int) -> dict[str, Any]:
        return {"candidates": [{"median_us": 500.0, "spread_us": 0.1, "rounds": rounds}
                               for _ in entries], "flash": 110.0, "cudnn": 80.0}


def test_a_search_on_todays_spaces_seeds_from_a_replayed_stores_elites(replayed: str) -> None:
    """The elites of another workload seed the sampler: those stored before TILE_ORDER and
    SCHEDULER existed are tried first as their legacy points."""
    from evoengine.search.domain import Domain
    from evoengine.space import default_spaces

    wgmma = [s for s in default_spaces() if s.family == "wgmma"]
    other = Workload(2, 16, 1024, 128, causal=True)
    with Store(replayed) as store:
        seeds = [e for e in store.elites(arch="sm_90a") if e.rank <= 2]
    domain = Domain(wgmma, other, SM90)
    want = {domain.identity("wgmma", {**e.params, **wgmma_legacy()}) for e in seeds}
    result = search(SearchConfig(workload=other, spaces=wgmma, arch=SM90, store=replayed,
                                 trials=4, seed=1, compile_workers=1),
                    evaluator=Steady(), progress=Progress(1.0, quiet=True), compile_fn=builds)
    trials = optuna.load_study(study_name=result.study, storage=replayed).get_trials()
    proposed = [domain.identity(*domain.from_trial_params(t.params))  # type: ignore[misc]
                for t in sorted(trials, key=lambda t: t.number)]
    assert len(want) == 2 and set(proposed[:2]) == want

