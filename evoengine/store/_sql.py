"""The store: runs, candidates, compile reports, measurements and elites in one SQL database."""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError
from sqlalchemy.orm import Session, contains_eager, selectinload, sessionmaker

from evoengine import paths
from evoengine.store import migrations
from evoengine.store.models import (
    RUN_STATUSES,
    Candidate,
    Claim,
    CompileReport,
    Elite,
    Measurement,
    Run,
    utcnow,
)
from evoengine.store.records import (
    CandidateRecord,
    CompileReportRecord,
    EliteRecord,
    MeasurementRecord,
    RunRecord,
)

DEFAULT_URL = f"sqlite:///{paths.DEFAULT_STORE}"
_FINISHED_STATUSES = tuple(status for status in RUN_STATUSES if status != "running")


def _first_line(exc: BaseException) -> str:
    """An exception's message without SQLAlchemy's trailing background-link lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# A URL's scheme ("sqlite:", "postgresql+psycopg:"): text that starts with one is never a path.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def resolve_url(store: str | os.PathLike[str] | None = None) -> str:
    """The SQLAlchemy URL of a store, named any way a user may name one.

    ``None`` is the default store (``paths.DEFAULT_STORE``); a path (``runs/replay.db``,
    ``~/evo.db``, a ``pathlib.Path``) is a SQLite file; text with ``://`` is a SQLAlchemy URL
    (``sqlite:///runs/evo.db``, ``postgresql+psycopg://user@host/db``) and is returned as
    given. Every command, ``Store`` and ``evoengine.load`` name stores through this one
    function. Raises a one-line ``ValueError`` for text that is neither, e.g. ``sqlite:x.db``.
    """
    if store is None:
        return f"sqlite:///{paths.DEFAULT_STORE}"
    if isinstance(store, os.PathLike):
        return f"sqlite:///{Path(store).expanduser()}"
    text = store.strip()
    if not text:
        raise ValueError("empty store URL; give a path to a SQLite file or a SQLAlchemy URL")
    if "://" in text:
        try:
            sa.make_url(text)
        except (ArgumentError, ValueError) as exc:
            raise ValueError(f"invalid store URL {text!r}: {_first_line(exc)}") from None
        return text
    if _SCHEME.match(text):
        raise ValueError(f"invalid store URL {text!r}: a URL has '://' (sqlite:///runs/evo.db, "
                         "postgresql://host/db); a SQLite file is named by its path alone")
    return f"sqlite:///{Path(text).expanduser()}"


def _resolve_sqlite_path(url: URL, create: bool) -> URL:
    """Make a file database's path absolute and, when ``create``, create its folder.

    A relative path would otherwise be resolved again, against whatever the working
    directory is, each time the pool opens a connection. Without ``create`` a missing file
    is a ``FileNotFoundError``: SQLite would otherwise create it, empty.
    """
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        if not create and database in ("", ":memory:"):
            raise FileNotFoundError("no store in an in-memory SQLite database: it starts empty")
        return url
    path = Path(database).expanduser().resolve()
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.is_file():
        raise FileNotFoundError(f"no store at {path}")
    return url.set(database=str(path))


def _configure_sqlite(engine: Engine) -> None:
    """WAL, a 30 s busy wait, enforced foreign keys, and real transactions.

    ``sqlite3`` on its own neither BEGINs before DDL (so a migration step would not be
    atomic) nor before SELECT. Emitting ``BEGIN IMMEDIATE`` ourselves takes the write lock
    up front: a transaction that read first and wrote second could otherwise fail at once
    with SQLITE_BUSY when another process wrote in between, busy timeout or not. Reads
    take the lock too, so store calls from several processes queue for the milliseconds a
    transaction lasts; under WAL other programs' readers are never blocked.
    """

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _open_engine(url: str, create: bool) -> Engine:
    """An engine for ``url``, checked by connecting once.

    A URL that cannot be parsed or opened is a one-line ``ValueError``; without ``create``, a
    SQLite file that does not exist is a ``FileNotFoundError`` (a server's missing database
    is the server's error, a ``ValueError``).
    """
    parsed = sa.make_url(url)  # resolve_url has parsed it once already
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite":
        try:
            parsed = _resolve_sqlite_path(parsed, create)
        except FileNotFoundError:
            raise
        except OSError as exc:  # a folder that cannot be created
            raise ValueError(f"invalid store URL {shown!r}: {_first_line(exc)}") from None
    try:
        engine = sa.create_engine(parsed)
    except (ArgumentError, ImportError, OSError) as exc:
        raise ValueError(f"invalid store URL {shown!r}: {_first_line(exc)}") from None
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    try:
        with engine.connect():
            pass
    except DBAPIError as exc:
        engine.dispose()
        raise ValueError(f"cannot open store URL {shown!r}: {_first_line(exc)}") from None
    return engine


def _run_record(row: Run) -> RunRecord:
    return RunRecord(
        id=row.id,
        created_at=row.created_at,
        finished_at=row.finished_at,
        status=row.status,
        arch=row.arch,
        device=row.device,
        versions=row.versions,
        commit=row.commit,
        workload=row.workload,
        workload_key=row.workload_key,
        study=row.study,
        notes=row.notes,
    )


def _compile_report_record(row: CompileReport) -> CompileReportRecord:
    return CompileReportRecord(
        arch=row.arch,
        ok=row.ok,
        registers=row.registers,
        spill_bytes=row.spill_bytes,
        smem_bytes=row.smem_bytes,
        compile_seconds=row.compile_seconds,
        error=row.error,
        compiler=row.compiler,
        created_at=row.created_at,
    )


def _candidate_record(row: Candidate) -> CandidateRecord:
    return CandidateRecord(
        id=row.id,
        identity=row.identity,
        family=row.family,
        template_hash=row.template_hash,
        params=row.params,
        problem=row.problem,
        source=row.source,
        created_at=row.created_at,
        compile_reports={r.arch: _compile_report_record(r) for r in row.compile_reports},
    )


def _measurement_record(row: Measurement) -> MeasurementRecord:
    return MeasurementRecord(
        id=row.id,
        run_id=row.run_id,
        identity=row.candidate.identity,
        ok=row.ok,
        reason=row.reason,
        median_us=row.median_us,
        spread_us=row.spread_us,
        max_err=row.max_err,
        tolerance=row.tolerance,
        tflops=row.tflops,
        extra=row.extra,
        created_at=row.created_at,
    )


def _elite_record(row: Elite) -> EliteRecord:
    return EliteRecord(
        arch=row.arch,
        workload_key=row.workload_key,
        rank=row.rank,
        identity=row.candidate.identity,
        family=row.candidate.family,
        params=row.candidate.params,
        problem=row.candidate.problem,
        median_us=row.median_us,
        run_id=row.run_id,
        updated_at=row.updated_at,
    )


class ClaimLost(RuntimeError):
    """A measurement's trial no longer holds the claim on its candidate: another worker
    took the candidate after this trial was failed as stale. Nothing was written."""


class Store:
    """Everything the search records, in the SQL database named by ``url``.

    ``url`` is what ``resolve_url`` takes: ``None`` for ``runs/evoengine.db`` under the
    current directory, a path to a SQLite file, or any SQLAlchemy URL. The schema is
    written for SQLite and PostgreSQL (only SQLite runs in the tests; PostgreSQL's DDL is
    rendered there). Opening applies any missing schema migrations. Only tables named
    ``evo_*`` are ever touched, so Optuna can share the database. Methods return frozen
    records, never live ORM objects.

    ``create=False`` is for readers: a store that does not exist yet (no such SQLite file, or
    a database evoengine never wrote to) raises ``FileNotFoundError`` naming it instead of
    being created empty, folders and all, so a mistyped URL cannot pass for an empty store.
    An existing store of an older schema is still upgraded, as on every open.

    Raises ``ValueError`` for a URL that cannot be parsed or opened, ``RuntimeError`` for a
    database written by a newer evoengine, and ``KeyError`` when a method is given a run id
    or candidate identity that is not stored.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None, *, create: bool = True) -> None:
        self._engine = _open_engine(resolve_url(url), create)
        # The URL actually opened (a SQLite path made absolute), e.g. for Optuna to share.
        self.url: str = self._engine.url.render_as_string(hide_password=False)
        try:
            if not create:
                with self._engine.connect() as conn:
                    if migrations.current_version(conn) == 0:
                        shown = self._engine.url.render_as_string(hide_password=True)
                        raise FileNotFoundError(f"no store at {shown}: the database holds "
                                                "no evoengine tables")
            migrations.upgrade(self._engine)
        except BaseException:
            self._engine.dispose()
            raise
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    def __repr__(self) -> str:
        return f"Store({self._engine.url.render_as_string(hide_password=True)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections; call it when done, or use the store in a ``with``."""
        self._engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """The one place a session is opened: commit on success, roll back on error, close."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @property
    def schema_version(self) -> int:
        """The schema version of the database, as recorded in ``evo_schema``."""
        with self._session() as session:
            return migrations.current_version(session.connection())

    # Runs

    def start_run(
        self,
        *,
        arch: str,
        workload: dict[str, Any],
        workload_key: str,
        device: str | None = None,
        versions: dict[str, Any] | None = None,
        commit: str | None = None,
        study: str | None = None,
    ) -> int:
        """Record a run as started now, with status ``"running"``; returns its id."""
        run = Run(
            status="running",
            arch=arch,
            device=device,
            versions=dict(versions or {}),
            commit=commit,
            workload=dict(workload),
            workload_key=workload_key,
            study=study,
        )
        with self._session() as session:
            session.add(run)
            session.flush()
            return run.id

    def finish_run(self, run_id: int, status: str = "done") -> None:
        """Mark a run finished now with ``status`` (``"done"``, ``"interrupted"``, ``"failed"``)."""
        if status not in _FINISHED_STATUSES:
            raise ValueError(f"a run finishes as one of {_FINISHED_STATUSES}, got {status!r}")
        with self._session() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise KeyError(f"no run {run_id}")
            run.status = status
            run.finished_at = utcnow()

    def run(self, run_id: int) -> RunRecord | None:
        """The run with this id, or ``None``."""
        with self._session() as session:
            row = session.get(Run, run_id)
            return None if row is None else _run_record(row)

    def runs(self, *, limit: int | None = None) -> list[RunRecord]:
        """Runs newest first, so ``limit=n`` gives the last ``n``."""
        with self._session() as session:
            rows = session.scalars(sa.select(Run).order_by(Run.id.desc()).limit(limit))
            return [_run_record(row) for row in rows]

    # Candidates and compile reports

    def add_candidate(
        self,
        *,
        identity: str,
        family: str,
        template_hash: str,
        params: dict[str, Any],
        problem: dict[str, Any],
        source: str,
    ) -> int:
        """Store a rendered candidate once; returns its id, the existing one on a repeat.

        The identity is derived from everything else given here, so a repeat is the same
        candidate and its stored fields are left as they are.
        """
        with self._session() as session:
            existing = self._candidate_id(session, identity)
            if existing is not None:
                return existing
            row = Candidate(
                identity=identity,
                family=family,
                template_hash=template_hash,
                params=dict(params),
                problem=dict(problem),
                source=source,
            )
            try:
                # A concurrent writer may insert the same identity first (PostgreSQL; on
                # SQLite the write lock already excludes it): then use that row.
                with session.begin_nested():
                    session.add(row)
            except IntegrityError:
                existing = self._candidate_id(session, identity)
                if existing is None:
                    raise
                return existing
            return row.id

    def set_compile_report(
        self,
        identity: str,
        *,
        arch: str,
        ok: bool,
        registers: int | None = None,
        spill_bytes: int | None = None,
        smem_bytes: int | None = None,
        compile_seconds: float | None = None,
        error: str | None = None,
        compiler: str | None = None,
    ) -> None:
        """Record how compiling ``identity`` for ``arch`` went, replacing any earlier report."""
        fields = {
            "ok": ok,
            "registers": registers,
            "spill_bytes": spill_bytes,
            "smem_bytes": smem_bytes,
            "compile_seconds": compile_seconds,
            "error": error,
            "compiler": compiler,
            "created_at": utcnow(),
        }
        with self._session() as session:
            candidate_id = self._require_candidate_id(session, identity)
            report = session.scalar(
                sa.select(CompileReport).where(
                    CompileReport.candidate_id == candidate_id, CompileReport.arch == arch
                )
            )
            if report is None:
                session.add(CompileReport(candidate_id=candidate_id, arch=arch, **fields))
            else:
                for name, value in fields.items():
                    setattr(report, name, value)

    def candidate(self, identity: str) -> CandidateRecord | None:
        """The candidate with this identity, with its compile reports, or ``None``."""
        with self._session() as session:
            row = session.scalar(
                sa.select(Candidate)
                .where(Candidate.identity == identity)
                .options(selectinload(Candidate.compile_reports))
            )
            return None if row is None else _candidate_record(row)

    def candidates(
        self, *, family: str | None = None, limit: int | None = None
    ) -> list[CandidateRecord]:
        """Candidates in the order they were added, optionally of one family only."""
        query = sa.select(Candidate).options(selectinload(Candidate.compile_reports))
        if family is not None:
            query = query.where(Candidate.family == family)
        with self._session() as session:
            rows = session.scalars(query.order_by(Candidate.id).limit(limit))
            return [_candidate_record(row) for row in rows]

    # Measurements

    def add_measurement(
        self,
        run_id: int,
        identity: str,
        *,
        ok: bool,
        reason: str | None = None,
        median_us: float | None = None,
        spread_us: float | None = None,
        max_err: float | None = None,
        tolerance: float | None = None,
        tflops: float | None = None,
        extra: Any | None = None,
        trial_id: int | None = None,
    ) -> int:
        """Record one measurement (or failure, with its ``reason``); returns its id.

        With ``trial_id`` (the search's Optuna trial), the same transaction settles that
        trial's claim on the candidate for the run's target (see ``claim``), taking it
        afresh if it was released meanwhile; when another trial holds it now, nothing is
        written and ``ClaimLost`` is raised, so a candidate is never measured twice.
        """
        with self._session() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise KeyError(f"no run {run_id}")
            if trial_id is not None:
                self._settle_claim(session, run, identity, trial_id)
            row = Measurement(
                run_id=run_id,
                candidate_id=self._require_candidate_id(session, identity),
                ok=ok,
                reason=reason,
                median_us=median_us,
                spread_us=spread_us,
                max_err=max_err,
                tolerance=tolerance,
                tflops=tflops,
                extra=extra,
            )
            session.add(row)
            session.flush()
            return row.id

    def measurements(
        self, *, run_id: int | None = None, identity: str | None = None
    ) -> list[MeasurementRecord]:
        """Measurements in the order they were taken, filtered by run and/or candidate."""
        query = (
            sa.select(Measurement)
            .join(Measurement.candidate)
            .options(contains_eager(Measurement.candidate))
        )
        if run_id is not None:
            query = query.where(Measurement.run_id == run_id)
        if identity is not None:
            query = query.where(Candidate.identity == identity)
        with self._session() as session:
            rows = session.scalars(query.order_by(Measurement.id))
            return [_measurement_record(row) for row in rows]

    def measured_identities(self, *, arch: str, workload_key: str) -> set[str]:
        """Identities with any measurement, failed ones included, in runs on this target.

        A failure is a result too, so the search need not try those candidates again.
        """
        query = (
            sa.select(Candidate.identity)
            .join(Measurement, Measurement.candidate_id == Candidate.id)
            .join(Run, Measurement.run_id == Run.id)
            .where(Run.arch == arch, Run.workload_key == workload_key)
            .distinct()
        )
        with self._session() as session:
            return set(session.scalars(query))

    @staticmethod
    def _measured(arch: str, workload_key: str) -> sa.Select[tuple[str]]:
        """Identities with a measurement in runs on this target, as a subquery."""
        return (
            sa.select(Candidate.identity)
            .join(Measurement, Measurement.candidate_id == Candidate.id)
            .join(Run, Measurement.run_id == Run.id)
            .where(Run.arch == arch, Run.workload_key == workload_key)
        )

    # Claims: which worker takes which candidate (see ``models.Claim``)

    def claim(self, *, arch: str, workload_key: str, identity: str, run_id: int,
              trial_id: int | None = None, owner: str | None = None) -> bool:
        """Take ``identity`` for this target, atomically across processes and hosts.

        True when this call inserted the claim; False when another worker (or an earlier
        trial) holds it. One transaction of its own, so the claim is visible to every other
        worker before the candidate is compiled.
        """
        try:
            with self._session() as session:
                session.add(Claim(arch=arch, workload_key=workload_key, identity=identity,
                                  run_id=run_id, trial_id=trial_id, owner=owner))
        except IntegrityError:
            return False
        return True

    def release_claims(self, *, arch: str, workload_key: str, identities: list[str]) -> int:
        """Give back claims on candidates that were never measured on this target (a measured
        candidate keeps its claim); returns how many were released."""
        if not identities:
            return 0
        with self._session() as session:
            done = session.execute(
                sa.delete(Claim).where(
                    Claim.arch == arch, Claim.workload_key == workload_key,
                    Claim.identity.in_(identities), Claim.measured_at.is_(None),
                    Claim.identity.not_in(self._measured(arch, workload_key)),
                )
            )
            return int(done.rowcount or 0)  # type: ignore[attr-defined]

    def open_claims(self, *, arch: str, workload_key: str) -> dict[str, int | None]:
        """``{identity: trial id}`` of the claims on this target not yet measured: the
        candidates some worker is compiling or evaluating now (or was, when it died)."""
        query = sa.select(Claim.identity, Claim.trial_id).where(
            Claim.arch == arch, Claim.workload_key == workload_key, Claim.measured_at.is_(None),
        )
        with self._session() as session:
            return {identity: trial_id for identity, trial_id in session.execute(query)}

    def taken_identities(self, *, arch: str, workload_key: str) -> set[str]:
        """Identities measured or claimed on this target: what no worker should propose."""
        query = sa.union(
            self._measured(arch, workload_key),
            sa.select(Claim.identity).where(Claim.arch == arch,
                                            Claim.workload_key == workload_key),
        )
        with self._session() as session:
            return set(session.scalars(query))

    def ranked(self, *, arch: str, workload_key: str,
               limit: int | None = None) -> list[tuple[str, float]]:
        """``(identity, median_us)`` of every candidate with a valid measurement in runs on
        this target, fastest first, each at its fastest valid median."""
        with self._session() as session:
            return self._ranked(session, arch, workload_key, limit)

    @staticmethod
    def _ranked(session: Session, arch: str, workload_key: str,
                limit: int | None) -> list[tuple[str, float]]:
        best = sa.func.min(Measurement.median_us)
        query = (
            sa.select(Candidate.identity, best)
            .join(Measurement, Measurement.candidate_id == Candidate.id)
            .join(Run, Measurement.run_id == Run.id)
            .where(Run.arch == arch, Run.workload_key == workload_key,
                   Measurement.ok.is_(True), Measurement.median_us.is_not(None))
            .group_by(Candidate.identity)
            .order_by(best, Candidate.identity)
            .limit(limit)
        )
        return [(identity, float(us)) for identity, us in session.execute(query)]

    def update_elites(self, *, arch: str, workload_key: str, limit: int,
                      run_id: int | None = None) -> list[tuple[str, float]]:
        """Make the elites of (arch, workload_key) the ``limit`` fastest of ``ranked``, read
        and written in one transaction under the elites' lock, so concurrent workers never
        write back a ranking older than the one they replace. Returns the new elites."""
        with self._session() as session:
            self._lock_elites(session, arch, workload_key)
            top = self._ranked(session, arch, workload_key, limit)
            self._replace_elites(session, arch, workload_key, top, run_id)
            return top

    # Elites

    def set_elites(
        self,
        *,
        arch: str,
        workload_key: str,
        entries: list[tuple[str, float]],
        run_id: int | None = None,
    ) -> None:
        """Replace the elites of (arch, workload_key) with ``entries`` ranked 1, 2, ... in order.

        ``entries`` holds ``(identity, median_us)``; an empty list clears the elites.
        """
        identities = [identity for identity, _ in entries]
        if len(set(identities)) != len(identities):
            raise ValueError(f"elites of {arch}/{workload_key} name a candidate twice")
        with self._session() as session:
            self._lock_elites(session, arch, workload_key)
            self._replace_elites(session, arch, workload_key, entries, run_id)

    @staticmethod
    def _lock_elites(session: Session, arch: str, workload_key: str) -> None:
        """Serialise replacing one target's elites: on PostgreSQL two workers' delete-then-
        insert would otherwise collide on the rank; SQLite's write lock does it already."""
        if session.get_bind().dialect.name == "postgresql":
            key = zlib.crc32(f"evo_elites {arch} {workload_key}".encode())
            session.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})

    def _replace_elites(self, session: Session, arch: str, workload_key: str,
                        entries: list[tuple[str, float]], run_id: int | None) -> None:
        now = utcnow()
        if run_id is not None and session.get(Run, run_id) is None:
            raise KeyError(f"no run {run_id}")
        rows = [
            Elite(
                arch=arch,
                workload_key=workload_key,
                rank=rank,
                candidate_id=self._require_candidate_id(session, identity),
                median_us=median_us,
                run_id=run_id,
                updated_at=now,
            )
            for rank, (identity, median_us) in enumerate(entries, start=1)
        ]
        session.execute(
            sa.delete(Elite).where(Elite.arch == arch, Elite.workload_key == workload_key)
        )
        session.add_all(rows)

    def elites(
        self, *, arch: str | None = None, workload_key: str | None = None
    ) -> list[EliteRecord]:
        """Elites ordered by arch, workload and rank, optionally of one arch and/or workload."""
        query = sa.select(Elite).options(selectinload(Elite.candidate))
        if arch is not None:
            query = query.where(Elite.arch == arch)
        if workload_key is not None:
            query = query.where(Elite.workload_key == workload_key)
        query = query.order_by(Elite.arch, Elite.workload_key, Elite.rank)
        with self._session() as session:
            return [_elite_record(row) for row in session.scalars(query)]

    # Helpers, called inside an open session

    @staticmethod
    def _settle_claim(session: Session, run: Run, identity: str, trial_id: int) -> None:
        """Mark ``trial_id``'s claim measured, under a row lock (PostgreSQL re-checks a
        concurrent ``release_claims`` against the updated row, so it keeps it)."""
        claim = session.scalar(
            sa.select(Claim)
            .where(Claim.arch == run.arch, Claim.workload_key == run.workload_key,
                   Claim.identity == identity)
            .with_for_update()
        )
        if claim is None:  # released (its trial was failed as stale): take it again
            claim = Claim(arch=run.arch, workload_key=run.workload_key, identity=identity,
                          run_id=run.id, trial_id=trial_id)
            try:
                with session.begin_nested():
                    session.add(claim)
            except IntegrityError:
                raise ClaimLost(f"{identity} was claimed again by another worker") from None
        elif claim.trial_id != trial_id:
            raise ClaimLost(f"{identity} is claimed by trial {claim.trial_id}, "
                            f"not {trial_id}")
        claim.measured_at = utcnow()

    @staticmethod
    def _candidate_id(session: Session, identity: str) -> int | None:
        return session.scalar(sa.select(Candidate.id).where(Candidate.identity == identity))

    @staticmethod
    def _require_candidate_id(session: Session, identity: str) -> int:
        candidate_id = Store._candidate_id(session, identity)
        if candidate_id is None:
            raise KeyError(f"no candidate {identity!r}")
        return candidate_id
