"""Tests of evoengine.store on SQLite files under tmp_path; no GPU needed."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from evoengine import paths
from evoengine.store import LATEST_VERSION, Store, migrations, resolve_url
from evoengine.store.models import Base

# Deliberately not alphabetical: the store must keep the declared order.
PARAMS = {"BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 8, "STAGES": 2}
PROBLEM = {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": True}
WORKLOAD = {"batch": 2, "heads": 16, "seq_q": 4096, "head_dim": 128}


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection, as another program would open the file; commits, closes."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "evo.db"


@pytest.fixture
def store(db: Path) -> Iterator[Store]:
    with Store(url_of(db)) as s:
        yield s


def add(store: Store, identity: str, family: str = "mma", **params: int) -> int:
    return store.add_candidate(
        identity=identity,
        family=family,
        template_hash="t0",
        params=params or PARAMS,
        problem=PROBLEM,
        source=f"// {identity}\n__global__ void k() {{}}\n",
    )


def start(store: Store, arch: str = "sm_90a", workload_key: str = "w1") -> int:
    return store.start_run(arch=arch, workload=WORKLOAD, workload_key=workload_key)


def test_run_round_trip(store: Store) -> None:
    before = datetime.now(UTC)
    first = store.start_run(
        arch="sm_90a",
        workload=WORKLOAD,
        workload_key="w1",
        device="NVIDIA H100 80GB HBM3",
        versions={"torch": "2.4.1", "nvrtc": "13.0"},
        commit="abc1234",
        study="s1",
    )
    second = start(store, arch="sm_80")

    run = store.run(first)
    assert run is not None
    assert (run.id, run.status, run.arch, run.workload_key) == (first, "running", "sm_90a", "w1")
    assert run.device == "NVIDIA H100 80GB HBM3"
    assert run.versions == {"torch": "2.4.1", "nvrtc": "13.0"}
    assert (run.commit, run.study, run.workload) == ("abc1234", "s1", WORKLOAD)
    assert run.finished_at is None and run.notes is None
    assert run.created_at.tzinfo == UTC and run.created_at >= before.replace(microsecond=0)
    assert store.run(second).versions == {}  # type: ignore[union-attr]
    assert store.run(12345) is None

    store.finish_run(first, "interrupted")
    finished = store.run(first)
    assert finished is not None and finished.status == "interrupted"
    assert finished.finished_at is not None and finished.finished_at >= finished.created_at
    store.finish_run(second)
    assert store.run(second).status == "done"  # type: ignore[union-attr]

    assert [r.id for r in store.runs()] == [second, first]
    assert [r.id for r in store.runs(limit=1)] == [second]
    with pytest.raises(ValueError, match="'running'"):
        store.finish_run(first, "running")
    with pytest.raises(KeyError):
        store.finish_run(999)


def test_records_are_frozen_copies(store: Store) -> None:
    add(store, "a")
    record = store.candidate("a")
    assert record is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.family = "other"  # type: ignore[misc]
    record.params["BLOCK_M"] = 1
    assert store.candidate("a").params == PARAMS  # type: ignore[union-attr]


def test_add_candidate_is_idempotent(store: Store) -> None:
    first = add(store, "mma-t0-128x64")
    again = store.add_candidate(
        identity="mma-t0-128x64",
        family="changed",
        template_hash="changed",
        params={},
        problem={},
        source="",
    )
    assert again == first
    (record,) = store.candidates()
    assert record.id == first and record.family == "mma" and record.template_hash == "t0"
    assert list(record.params.items()) == list(PARAMS.items())
    assert record.problem == PROBLEM
    assert record.source.startswith("// mma-t0-128x64\n")
    assert record.compile_reports == {}
    assert store.candidate("missing") is None


def test_candidates_filter_and_limit(store: Store) -> None:
    add(store, "a", family="mma")
    add(store, "b", family="wmma")
    add(store, "c", family="mma")
    assert [c.identity for c in store.candidates()] == ["a", "b", "c"]
    assert [c.identity for c in store.candidates(family="mma")] == ["a", "c"]
    assert [c.identity for c in store.candidates(family="mma", limit=1)] == ["a"]
    assert store.candidates(family="none") == []


def test_compile_report_is_replaced_per_arch(store: Store) -> None:
    add(store, "a")
    store.set_compile_report(
        "a", arch="sm_90a", ok=True, registers=168, spill_bytes=0, smem_bytes=98304,
        compile_seconds=1.5, compiler="nvrtc 13.0",
    )  # fmt: skip
    store.set_compile_report("a", arch="sm_80", ok=True, registers=128)
    store.set_compile_report("a", arch="sm_90a", ok=False, error="ptxas: too many resources")

    reports = store.candidate("a").compile_reports  # type: ignore[union-attr]
    assert sorted(reports) == ["sm_80", "sm_90a"]
    replaced = reports["sm_90a"]
    assert replaced.ok is False and replaced.error == "ptxas: too many resources"
    assert (replaced.registers, replaced.smem_bytes, replaced.compiler) == (None, None, None)
    assert reports["sm_80"].registers == 128 and reports["sm_80"].ok is True
    assert store.candidates()[0].compile_reports == reports
    with pytest.raises(KeyError, match="nope"):
        store.set_compile_report("nope", arch="sm_80", ok=True)


def test_measurements_round_trip(store: Store, db: Path) -> None:
    add(store, "a")
    add(store, "b")
    run = start(store)
    other = start(store)
    good = store.add_measurement(
        run, "a", ok=True, median_us=412.5, spread_us=3.25, max_err=2e-4, tolerance=1e-3,
        tflops=512.0, extra={"iters": 100},
    )  # fmt: skip
    bad = store.add_measurement(run, "b", ok=False, reason="wrong answer: max err 3e-2 > tol 1e-3")
    store.add_measurement(other, "a", ok=False, reason="timeout")

    assert [m.id for m in store.measurements(run_id=run)] == [good, bad]
    first, second = store.measurements(run_id=run)
    assert (first.run_id, first.identity, first.ok) == (run, "a", True)
    assert (first.median_us, first.spread_us, first.max_err) == (412.5, 3.25, 2e-4)
    assert (first.tolerance, first.tflops, first.extra) == (1e-3, 512.0, {"iters": 100})
    assert first.reason is None and first.created_at.tzinfo == UTC
    assert (second.identity, second.ok, second.median_us) == ("b", False, None)
    assert second.reason == "wrong answer: max err 3e-2 > tol 1e-3" and second.extra is None
    assert [(m.run_id, m.reason) for m in store.measurements(identity="a")] == [
        (run, None),
        (other, "timeout"),
    ]
    assert [m.id for m in store.measurements(run_id=other, identity="b")] == []
    assert len(store.measurements()) == 3
    with raw(db) as conn:  # an absent document is SQL NULL, not the JSON text 'null'
        assert conn.execute("SELECT id FROM evo_measurements WHERE extra IS NULL").fetchall() == [
            (bad,),
            (bad + 1,),
        ]
    with pytest.raises(KeyError):
        store.add_measurement(999, "a", ok=True)
    with pytest.raises(KeyError):
        store.add_measurement(run, "nope", ok=True)


def test_measured_identities(store: Store) -> None:
    for identity in "abcd":
        add(store, identity)
    hopper = start(store, arch="sm_90a", workload_key="w1")
    hopper_again = start(store, arch="sm_90a", workload_key="w1")
    ampere = start(store, arch="sm_80", workload_key="w1")
    other_workload = start(store, arch="sm_90a", workload_key="w2")
    store.add_measurement(hopper, "a", ok=True, median_us=1.0)
    store.add_measurement(hopper_again, "b", ok=False, reason="fault: illegal address")
    store.add_measurement(hopper_again, "a", ok=True, median_us=1.1)
    store.add_measurement(ampere, "c", ok=True, median_us=2.0)
    store.add_measurement(other_workload, "d", ok=True, median_us=3.0)

    assert store.measured_identities(arch="sm_90a", workload_key="w1") == {"a", "b"}
    assert store.measured_identities(arch="sm_80", workload_key="w1") == {"c"}
    assert store.measured_identities(arch="sm_90a", workload_key="w2") == {"d"}
    assert store.measured_identities(arch="sm_89", workload_key="w1") == set()


def test_ranked_takes_each_candidates_fastest_valid_median(store: Store) -> None:
    for identity in "abcde":
        add(store, identity)
    run = start(store, arch="sm_90a", workload_key="w1")
    again = start(store, arch="sm_90a", workload_key="w1")
    other = start(store, arch="sm_90a", workload_key="w2")
    store.add_measurement(run, "a", ok=True, median_us=5.0)
    store.add_measurement(again, "a", ok=True, median_us=4.0)
    store.add_measurement(run, "b", ok=True, median_us=4.5)
    store.add_measurement(run, "c", ok=False, reason="wrong answer", median_us=1.0)
    store.add_measurement(run, "d", ok=False, reason="fault")
    store.add_measurement(other, "e", ok=True, median_us=0.5)

    assert store.ranked(arch="sm_90a", workload_key="w1") == [("a", 4.0), ("b", 4.5)]
    assert store.ranked(arch="sm_90a", workload_key="w1", limit=1) == [("a", 4.0)]
    assert store.ranked(arch="sm_80", workload_key="w1") == []


def test_elites_are_ranked_in_given_order_and_replaced(store: Store) -> None:
    for identity in "abcd":
        add(store, identity)
    add(store, "e", family="wmma", BLOCK_M=64)
    run = start(store)
    # Given order, not sorted by time: the caller decides the ranking.
    store.set_elites(
        arch="sm_90a", workload_key="w1", entries=[("b", 2.0), ("a", 1.0), ("c", 3.0)], run_id=run
    )
    store.set_elites(arch="sm_80", workload_key="w1", entries=[("d", 9.0)])

    hopper = store.elites(arch="sm_90a", workload_key="w1")
    assert [(e.rank, e.identity, e.median_us) for e in hopper] == [
        (1, "b", 2.0),
        (2, "a", 1.0),
        (3, "c", 3.0),
    ]
    assert all(e.run_id == run and e.family == "mma" and e.problem == PROBLEM for e in hopper)
    assert hopper[0].params == PARAMS and hopper[0].updated_at.tzinfo == UTC

    store.set_elites(arch="sm_90a", workload_key="w1", entries=[("e", 0.5), ("b", 2.0)])
    replaced = store.elites(arch="sm_90a")
    assert [(e.rank, e.identity, e.run_id) for e in replaced] == [(1, "e", None), (2, "b", None)]
    assert replaced[0].family == "wmma" and replaced[0].params == {"BLOCK_M": 64}
    assert [(e.arch, e.identity) for e in store.elites(workload_key="w1")] == [
        ("sm_80", "d"),
        ("sm_90a", "e"),
        ("sm_90a", "b"),
    ]

    with pytest.raises(KeyError):
        store.set_elites(arch="sm_90a", workload_key="w1", entries=[("a", 1.0), ("nope", 2.0)])
    with pytest.raises(ValueError, match="twice"):
        store.set_elites(arch="sm_90a", workload_key="w1", entries=[("a", 1.0), ("a", 2.0)])
    assert [e.identity for e in store.elites(arch="sm_90a")] == ["e", "b"]

    store.set_elites(arch="sm_90a", workload_key="w1", entries=[])
    assert [e.arch for e in store.elites()] == ["sm_80"]


def test_default_url_creates_runs_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Store() as store:
        start(store)
        assert store.url == url_of(tmp_path / "runs" / "evoengine.db")
    assert (tmp_path / "runs" / "evoengine.db").is_file()
    # The path was fixed when the store opened, not re-read from each new working directory.
    monkeypatch.chdir(tmp_path / "runs")
    with Store(url_of(tmp_path / "runs" / "evoengine.db")) as store:
        assert len(store.runs()) == 1


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("sqlite:runs/evo.db", "sqlite:runs/evo.db"),  # a scheme without '://' is no path
        ("://host/db", "://host/db"),
        ("postgresql://u@h:port/db", "postgresql://u@h:port/db"),
        ("nosuchdialect://host/db", "nosuchdialect://host/db"),
        ("sqlite:///{tmp}", "{tmp}"),  # a folder, not a database file
    ],
)
def test_bad_url_is_a_one_line_value_error(tmp_path: Path, url: str, shown: str) -> None:
    url, shown = url.format(tmp=tmp_path), shown.format(tmp=tmp_path)
    with pytest.raises(ValueError) as caught:
        Store(url)
    message = str(caught.value)
    assert shown in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("given", "url"),
    [
        (None, f"sqlite:///{paths.DEFAULT_STORE}"),
        ("runs/replay.db", "sqlite:///runs/replay.db"),
        (" runs/replay.db ", "sqlite:///runs/replay.db"),
        ("/abs/evo.db", "sqlite:////abs/evo.db"),
        (Path("runs/evo.db"), "sqlite:///runs/evo.db"),
        ("~/evo.db", f"sqlite:///{Path('~/evo.db').expanduser()}"),
        ("sqlite:///runs/evo.db", "sqlite:///runs/evo.db"),
        ("sqlite://", "sqlite://"),
        ("postgresql+psycopg://user:pw@host/evo", "postgresql+psycopg://user:pw@host/evo"),
    ],
)
def test_resolve_url_takes_paths_and_urls(given: str | Path | None, url: str) -> None:
    assert resolve_url(given) == url


def test_a_path_a_url_and_a_path_object_open_one_store(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Store("runs/replay.db") as store:
        start(store)
        assert store.url == url_of(tmp_path / "runs" / "replay.db")
    for name in (tmp_path / "runs" / "replay.db", "sqlite:///runs/replay.db", "runs/replay.db"):
        with Store(name, create=False) as store:
            assert len(store.runs()) == 1


def test_a_reader_never_creates_a_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("sqlite:///runs/typo/evo.db", "runs/typo/evo.db", None):
        with pytest.raises(FileNotFoundError) as caught:
            Store(name, create=False)
        assert str(caught.value).startswith("no store at ")
        assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no runs/, no runs/typo/, no file
    with pytest.raises(FileNotFoundError, match="in-memory"):
        Store("sqlite://", create=False)


def test_a_reader_refuses_a_database_evoengine_never_wrote(db: Path) -> None:
    with raw(db) as conn:
        conn.execute("CREATE TABLE trials (trial_id INTEGER PRIMARY KEY)")
    with pytest.raises(FileNotFoundError, match="holds no evoengine tables"):
        Store(db, create=False)
    with raw(db) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert tables == {"trials"}
    with Store(db) as store:  # a writer makes it a store; then readers open it
        start(store)
    with Store(db, create=False) as store:
        assert len(store.runs()) == 1


POSTGRES = os.environ.get("EVO_TEST_POSTGRES")


@pytest.mark.skipif(not POSTGRES, reason="EVO_TEST_POSTGRES is not set (.ci/run sets it)")
def test_a_missing_postgresql_database_is_one_line(tmp_path: Path) -> None:
    assert POSTGRES
    server = sa.make_url(POSTGRES)
    name = f"evo_test_{uuid.uuid4().hex[:12]}"
    missing = server.set(database=name).render_as_string(hide_password=False)
    for create in (False, True):  # the server creates no database either way
        with pytest.raises(ValueError) as caught:
            Store(missing, create=create)
        assert name in str(caught.value) and "\n" not in str(caught.value)
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        with pytest.raises(FileNotFoundError, match="holds no evoengine tables"):
            Store(missing, create=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_only_evo_tables_are_created_and_others_left_alone(db: Path) -> None:
    with raw(db) as conn:
        conn.execute("CREATE TABLE trials (trial_id INTEGER PRIMARY KEY, value REAL)")
        conn.execute("INSERT INTO trials VALUES (7, 0.25)")
    with Store(url_of(db)) as store:
        add(store, "a")
    with raw(db) as conn:
        tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        names = {name for (name,) in tables}
        assert conn.execute("SELECT * FROM trials").fetchall() == [(7, 0.25)]
    assert names - {"trials"} == {
        "evo_schema",
        "evo_runs",
        "evo_candidates",
        "evo_compile_reports",
        "evo_measurements",
        "evo_elites",
        "evo_claims",
    }


def test_upgrade_from_step_1_keeps_old_rows(db: Path) -> None:
    engine = sa.create_engine(url_of(db))
    assert migrations.upgrade(engine, target=1) == 1
    engine.dispose()
    with raw(db) as conn:
        assert conn.execute("SELECT version FROM evo_schema").fetchall() == [(1,)]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert "evo_elites" not in tables
        # As an evoengine of schema 1 wrote them: JSON as text, booleans as 0/1.
        conn.execute(
            'INSERT INTO evo_runs (id, created_at, finished_at, status, arch, device, versions,'
            ' "commit", workload, workload_key, study) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
            (1, "2024-05-01 12:00:00.000000", "2024-05-01 13:30:00.000000", "done", "sm_80",
             "A100", '{"torch": "2.3.0"}', "0ld", '{"batch": 1}', "w-old", None),
        )  # fmt: skip
        conn.execute(
            "INSERT INTO evo_candidates (id, identity, family, template_hash, params, problem,"
            " source, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (1, "old-cand", "mma", "t-old", '{"WARPS": 4, "BLOCK_M": 64}', '{"HEAD_DIM": 64}',
             "// old", "2024-05-01 12:01:00.000000"),
        )  # fmt: skip
        conn.execute(
            "INSERT INTO evo_compile_reports (candidate_id, arch, ok, registers, error,"
            " created_at) VALUES (1, 'sm_80', 1, 96, NULL, '2024-05-01 12:02:00.000000')"
        )
        conn.execute(
            "INSERT INTO evo_measurements (run_id, candidate_id, ok, reason, median_us,"
            " extra, created_at) VALUES (1, 1, 0, 'timeout', NULL, NULL,"
            " '2024-05-01 12:03:00.000000')"
        )

    with Store(url_of(db)) as store:
        assert store.schema_version == LATEST_VERSION == len(migrations.MIGRATIONS)
        run = store.run(1)
        assert run is not None
        assert (run.status, run.arch, run.device, run.commit) == ("done", "sm_80", "A100", "0ld")
        assert run.versions == {"torch": "2.3.0"} and run.workload == {"batch": 1}
        assert run.created_at == datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
        assert run.finished_at == datetime(2024, 5, 1, 13, 30, tzinfo=UTC)
        assert run.notes is None
        candidate = store.candidate("old-cand")
        assert candidate is not None
        assert list(candidate.params) == ["WARPS", "BLOCK_M"] and candidate.source == "// old"
        assert candidate.compile_reports["sm_80"].registers == 96
        assert candidate.compile_reports["sm_80"].ok is True
        (measurement,) = store.measurements(run_id=1)
        assert (measurement.identity, measurement.ok, measurement.reason) == (
            "old-cand",
            False,
            "timeout",
        )
        assert measurement.tflops is None
        assert store.measured_identities(arch="sm_80", workload_key="w-old") == {"old-cand"}
        # What step 2 added works on the old rows.
        store.set_elites(arch="sm_80", workload_key="w-old", entries=[("old-cand", 9.5)], run_id=1)
        assert [e.identity for e in store.elites()] == ["old-cand"]
        new = store.add_measurement(1, "old-cand", ok=True, median_us=9.5, tflops=80.0)
        assert store.measurements(identity="old-cand")[-1].id == new
        assert store.measurements(identity="old-cand")[-1].tflops == 80.0
        assert add(store, "old-cand") == 1


def test_a_failing_step_leaves_no_trace(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store(url_of(db)) as store:
        add(store, "a")

    def half_done(conn: sa.Connection) -> None:
        """Creates a table, then fails: the table must be rolled back with it."""
        conn.execute(sa.text("CREATE TABLE evo_half (id INTEGER PRIMARY KEY)"))
        conn.execute(sa.text("ALTER TABLE evo_candidates ADD COLUMN half INTEGER"))
        raise RuntimeError("step failed")

    monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, half_done))
    monkeypatch.setattr(migrations, "LATEST_VERSION", LATEST_VERSION + 1)
    with pytest.raises(RuntimeError, match="step failed"):
        Store(url_of(db))
    with raw(db) as conn:
        assert conn.execute("SELECT version FROM evo_schema").fetchall() == [(LATEST_VERSION,)]
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        columns = {row[1] for row in conn.execute("PRAGMA table_info(evo_candidates)")}
    assert "evo_half" not in names and "half" not in columns


def test_newer_schema_is_refused(db: Path) -> None:
    with Store(url_of(db)) as store:
        add(store, "a")
    with raw(db) as conn:
        conn.execute("UPDATE evo_schema SET version = ?", (LATEST_VERSION + 1,))
    with pytest.raises(RuntimeError, match=f"version {LATEST_VERSION + 1}, newer"):
        Store(url_of(db))
    with raw(db) as conn:
        assert conn.execute("SELECT version FROM evo_schema").fetchall() == [(LATEST_VERSION + 1,)]


def test_reopening_applies_nothing_twice(db: Path) -> None:
    with Store(url_of(db)) as store:
        add(store, "a")
    with Store(url_of(db)) as store:
        assert store.schema_version == LATEST_VERSION
        assert [c.identity for c in store.candidates()] == ["a"]
    with raw(db) as conn:
        assert conn.execute("SELECT version FROM evo_schema").fetchall() == [(LATEST_VERSION,)]


def test_sqlite_pragmas(store: Store, db: Path) -> None:
    with raw(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    # busy_timeout and foreign_keys hold per connection, so ask one of the store's own.
    with store._engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def _shape(inspector: sa.Inspector, table: str) -> dict[str, object]:
    return {
        "columns": {c["name"]: c["nullable"] for c in inspector.get_columns(table)},
        "unique": sorted(tuple(u["column_names"]) for u in inspector.get_unique_constraints(table)),
        "indexes": sorted(tuple(i["column_names"]) for i in inspector.get_indexes(table)),
        "foreign_keys": sorted(
            (tuple(f["constrained_columns"]), f["referred_table"])
            for f in inspector.get_foreign_keys(table)
        ),
    }


def test_migrations_build_the_schema_the_models_describe(tmp_path: Path) -> None:
    migrated = sa.create_engine(url_of(tmp_path / "migrated.db"))
    migrations.upgrade(migrated)
    modelled = sa.create_engine(url_of(tmp_path / "modelled.db"))
    Base.metadata.create_all(modelled)
    tables = sorted(Base.metadata.tables)
    assert set(sa.inspect(migrated).get_table_names()) == {*tables, "evo_schema"}
    for table in tables:
        assert _shape(sa.inspect(migrated), table) == _shape(sa.inspect(modelled), table), table
    migrated.dispose()
    modelled.dispose()


def test_migrations_render_for_postgresql() -> None:
    statements: list[str] = []

    def record(sql: sa.Executable, *args: object, **kwargs: object) -> None:
        statements.append(str(sql.compile(dialect=engine.dialect)).strip())

    engine = sa.create_mock_engine("postgresql+psycopg2://", record)
    for step in migrations.MIGRATIONS:
        step(engine)  # type: ignore[arg-type]
    assert "ALTER TABLE evo_measurements ADD COLUMN tflops FLOAT" in statements
    assert "ALTER TABLE evo_runs ADD COLUMN notes JSON" in statements
    assert all(" evo_" in s for s in statements)
    assert any("TIMESTAMP WITH TIME ZONE" in s for s in statements)
