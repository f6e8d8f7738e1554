"""Versioned schema of the store, built and upgraded by numbered steps.

``evo_schema`` holds one integer: how many steps of ``MIGRATIONS`` the database has had.
Step ``n`` is ``MIGRATIONS[n - 1]``. A fresh database goes through every step, so there is
exactly one path to the latest schema and it is the one old databases take too.

Rules for a step: append only, never edit or reorder a released one; describe its tables
with Core objects frozen inside the step (never the ORM models, which follow the latest
schema); keep it portable across SQLite and PostgreSQL; touch only ``evo_`` tables, since
Optuna keeps its own tables in the same database.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

SCHEMA_TABLE = "evo_schema"

_schema_metadata = sa.MetaData()
_schema = sa.Table(SCHEMA_TABLE, _schema_metadata, sa.Column("version", sa.Integer, nullable=False))

# Serialises concurrent upgrades on PostgreSQL; SQLite gets the same from BEGIN IMMEDIATE.
_PG_LOCK_KEY = zlib.crc32(SCHEMA_TABLE.encode())


def _add_column(conn: Connection, table: str, column: sa.Column[Any]) -> None:
    """``ALTER TABLE ... ADD COLUMN`` with the type spelled the way this backend spells it."""
    quote = conn.dialect.identifier_preparer.quote
    type_sql = column.type.compile(dialect=conn.dialect)
    conn.execute(sa.text(f"ALTER TABLE {quote(table)} ADD COLUMN {quote(column.name)} {type_sql}"))


def create_initial_tables(conn: Connection) -> None:
    """Step 1: runs, candidates, compile reports and measurements, as first released."""
    md = sa.MetaData()
    sa.Table(
        "evo_runs",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String, nullable=False),
        sa.Column("arch", sa.String, nullable=False),
        sa.Column("device", sa.String, nullable=True),
        sa.Column("versions", sa.JSON, nullable=False),
        sa.Column("commit", sa.String, nullable=True),
        sa.Column("workload", sa.JSON, nullable=False),
        sa.Column("workload_key", sa.String, nullable=False),
        sa.Column("study", sa.String, nullable=True),
        sa.Index("ix_evo_runs_workload_key", "workload_key"),
    )
    sa.Table(
        "evo_candidates",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("identity", sa.String, nullable=False),
        sa.Column("family", sa.String, nullable=False),
        sa.Column("template_hash", sa.String, nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("problem", sa.JSON, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("identity", name="uq_evo_candidates_identity"),
    )
    sa.Table(
        "evo_compile_reports",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("candidate_id", sa.Integer, sa.ForeignKey("evo_candidates.id"), nullable=False),
        sa.Column("arch", sa.String, nullable=False),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("registers", sa.Integer, nullable=True),
        sa.Column("spill_bytes", sa.Integer, nullable=True),
        sa.Column("smem_bytes", sa.Integer, nullable=True),
        sa.Column("compile_seconds", sa.Float, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("compiler", sa.String, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("candidate_id", "arch", name="uq_evo_compile_reports_candidate_arch"),
    )
    sa.Table(
        "evo_measurements",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("evo_runs.id"), nullable=False),
        sa.Column("candidate_id", sa.Integer, sa.ForeignKey("evo_candidates.id"), nullable=False),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("median_us", sa.Float, nullable=True),
        sa.Column("spread_us", sa.Float, nullable=True),
        sa.Column("max_err", sa.Float, nullable=True),
        sa.Column("tolerance", sa.Float, nullable=True),
        sa.Column("extra", sa.JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Index("ix_evo_measurements_run_id", "run_id"),
        sa.Index("ix_evo_measurements_candidate_id", "candidate_id"),
    )
    md.create_all(conn, checkfirst=False)


def add_elites_tflops_and_notes(conn: Connection) -> None:
    """Step 2: the elites table, ``evo_measurements.tflops`` and ``evo_runs.notes``."""
    md = sa.MetaData()
    # Stand-ins so the foreign keys resolve; they are not created here.
    sa.Table("evo_candidates", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("evo_runs", md, sa.Column("id", sa.Integer, primary_key=True))
    elites = sa.Table(
        "evo_elites",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("arch", sa.String, nullable=False),
        sa.Column("workload_key", sa.String, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("candidate_id", sa.Integer, sa.ForeignKey("evo_candidates.id"), nullable=False),
        sa.Column("median_us", sa.Float, nullable=False),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("evo_runs.id"), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint(
            "arch", "workload_key", "rank", name="uq_evo_elites_arch_workload_rank"
        ),
    )
    elites.create(conn, checkfirst=False)
    _add_column(conn, "evo_measurements", sa.Column("tflops", sa.Float))
    _add_column(conn, "evo_runs", sa.Column("notes", sa.JSON))


def add_claims(conn: Connection) -> None:
    """Step 3: ``evo_claims``, one row per candidate a search worker has taken for a target.

    The unique constraint is what makes a claim atomic across processes and hosts: the
    second worker to insert the same (arch, workload, identity) gets an integrity error.
    ``measured_at`` is set in the transaction that writes the measurement.
    """
    md = sa.MetaData()
    sa.Table("evo_runs", md, sa.Column("id", sa.Integer, primary_key=True))
    claims = sa.Table(
        "evo_claims",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("arch", sa.String, nullable=False),
        sa.Column("workload_key", sa.String, nullable=False),
        sa.Column("identity", sa.String, nullable=False),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("evo_runs.id"), nullable=False),
        sa.Column("trial_id", sa.Integer, nullable=True),
        sa.Column("owner", sa.String, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint(
            "arch", "workload_key", "identity", name="uq_evo_claims_arch_workload_identity"
        ),
    )
    claims.create(conn, checkfirst=False)


MIGRATIONS: tuple[Callable[[Connection], None], ...] = (
    create_initial_tables,
    add_elites_tflops_and_notes,
    add_claims,
)
LATEST_VERSION = len(MIGRATIONS)


def current_version(conn: Connection) -> int:
    """The schema version of the database; 0 where evoengine has never written to it."""
    if not sa.inspect(conn).has_table(SCHEMA_TABLE):
        return 0
    return conn.execute(sa.select(_schema.c.version)).scalar_one_or_none() or 0


def _newer_than_known(engine: Engine, version: int) -> RuntimeError:
    url = engine.url.render_as_string(hide_password=True)
    return RuntimeError(
        f"store {url} has schema version {version}, newer than the {LATEST_VERSION} this "
        "evoengine knows; upgrade evoengine to open it"
    )


def upgrade(engine: Engine, *, target: int | None = None) -> int:
    """Apply the missing steps up to ``target`` (default: all), one transaction each.

    Returns the version the database is at afterwards. Never downgrades: a database
    already at or past ``target`` is left as it is, and one newer than this code knows
    raises ``RuntimeError`` before anything is written. The version is re-read inside each
    step's transaction, under a lock, so concurrent openers apply each step once.
    """
    target = LATEST_VERSION if target is None else target
    if not 0 <= target <= LATEST_VERSION:
        raise ValueError(f"target version must be in 0..{LATEST_VERSION}, got {target}")
    with engine.connect() as conn:
        version = current_version(conn)
    if version > LATEST_VERSION:
        raise _newer_than_known(engine, version)
    while version < target:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
            _schema.create(conn, checkfirst=True)
            version = current_version(conn)
            if version > LATEST_VERSION:
                raise _newer_than_known(engine, version)
            if version >= target:
                break
            MIGRATIONS[version](conn)
            version += 1
            conn.execute(_schema.delete())
            conn.execute(_schema.insert().values(version=version))
    return version
