"""ORM models of the latest store schema.

These classes describe the schema as it is after the last step in ``migrations.py``; they
never create tables themselves. Changing a column here therefore means appending a
migration step that makes the same change, and ``tests/test_store.py`` checks that the two
agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

RUN_STATUSES = ("running", "done", "interrupted", "failed")


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC: the only kind of time the store holds."""
    return datetime.now(UTC)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite keeps no zone and would silently drop it, so values are converted to UTC
    before they are written and read back as UTC.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store holds UTC-aware times only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# SQL NULL, not the JSON text 'null', for an absent optional document.
_NULLABLE_JSON = sa.JSON(none_as_null=True)


class Base(DeclarativeBase):
    """Declarative base of the evoengine tables; every table name starts with ``evo_``."""


class Run(Base):
    """One invocation of the search on one device for one workload."""

    __tablename__ = "evo_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(sa.String, default="running")
    arch: Mapped[str] = mapped_column(sa.String)
    device: Mapped[str | None] = mapped_column(sa.String)
    versions: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    commit: Mapped[str | None] = mapped_column(sa.String)
    workload: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    workload_key: Mapped[str] = mapped_column(sa.String, index=True)
    study: Mapped[str | None] = mapped_column(sa.String)
    notes: Mapped[Any | None] = mapped_column(_NULLABLE_JSON)


class Candidate(Base):
    """One rendered kernel; ``identity`` also names its compile cache entry and source file."""

    __tablename__ = "evo_candidates"
    __table_args__ = (sa.UniqueConstraint("identity", name="uq_evo_candidates_identity"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    identity: Mapped[str] = mapped_column(sa.String)
    family: Mapped[str] = mapped_column(sa.String)
    template_hash: Mapped[str] = mapped_column(sa.String)
    params: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    problem: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    source: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    compile_reports: Mapped[list[CompileReport]] = relationship(
        back_populates="candidate", order_by="CompileReport.arch"
    )


class CompileReport(Base):
    """The outcome of compiling one candidate for one architecture; one per pair."""

    __tablename__ = "evo_compile_reports"
    __table_args__ = (
        sa.UniqueConstraint("candidate_id", "arch", name="uq_evo_compile_reports_candidate_arch"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    candidate_id: Mapped[int] = mapped_column(sa.ForeignKey("evo_candidates.id"))
    arch: Mapped[str] = mapped_column(sa.String)
    ok: Mapped[bool] = mapped_column(sa.Boolean)
    registers: Mapped[int | None] = mapped_column(sa.Integer)
    spill_bytes: Mapped[int | None] = mapped_column(sa.Integer)
    smem_bytes: Mapped[int | None] = mapped_column(sa.Integer)
    compile_seconds: Mapped[float | None] = mapped_column(sa.Float)
    error: Mapped[str | None] = mapped_column(sa.Text)
    compiler: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    candidate: Mapped[Candidate] = relationship(back_populates="compile_reports")


class Measurement(Base):
    """One candidate timed (or failed) within one run; a failure keeps its reason."""

    __tablename__ = "evo_measurements"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("evo_runs.id"), index=True)
    candidate_id: Mapped[int] = mapped_column(sa.ForeignKey("evo_candidates.id"), index=True)
    ok: Mapped[bool] = mapped_column(sa.Boolean)
    reason: Mapped[str | None] = mapped_column(sa.Text)
    median_us: Mapped[float | None] = mapped_column(sa.Float)
    spread_us: Mapped[float | None] = mapped_column(sa.Float)
    max_err: Mapped[float | None] = mapped_column(sa.Float)
    tolerance: Mapped[float | None] = mapped_column(sa.Float)
    tflops: Mapped[float | None] = mapped_column(sa.Float)
    extra: Mapped[Any | None] = mapped_column(_NULLABLE_JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    candidate: Mapped[Candidate] = relationship()


class Elite(Base):
    """The best candidates found so far for one (arch, workload); rank 1 is the fastest."""

    __tablename__ = "evo_elites"
    __table_args__ = (
        sa.UniqueConstraint(
            "arch", "workload_key", "rank", name="uq_evo_elites_arch_workload_rank"
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    arch: Mapped[str] = mapped_column(sa.String)
    workload_key: Mapped[str] = mapped_column(sa.String)
    rank: Mapped[int] = mapped_column(sa.Integer)
    candidate_id: Mapped[int] = mapped_column(sa.ForeignKey("evo_candidates.id"))
    median_us: Mapped[float] = mapped_column(sa.Float)
    run_id: Mapped[int | None] = mapped_column(sa.ForeignKey("evo_runs.id"))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    candidate: Mapped[Candidate] = relationship()


class Claim(Base):
    """A candidate taken by one search worker for one (arch, workload): inserted before it
    is compiled, so no two workers (processes or hosts) evaluate the same point. It stays
    once the candidate is measured; it is deleted when its trial ends unmeasured (stopped,
    or failed by a stale heartbeat), so another worker may take the point again."""

    __tablename__ = "evo_claims"
    __table_args__ = (
        sa.UniqueConstraint(
            "arch", "workload_key", "identity", name="uq_evo_claims_arch_workload_identity"
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    arch: Mapped[str] = mapped_column(sa.String)
    workload_key: Mapped[str] = mapped_column(sa.String)
    identity: Mapped[str] = mapped_column(sa.String)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("evo_runs.id"))
    trial_id: Mapped[int | None] = mapped_column(sa.Integer)  # Optuna's trial id
    owner: Mapped[str | None] = mapped_column(sa.String)  # host:pid
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Set with the measurement, in its transaction; a claim with it set is never released.
    measured_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
