"""What the store hands out: plain frozen records, detached from any database session.

Each record is a copy taken inside the session that read it, so it stays valid after the
session closes and changing its dicts never changes the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class RunRecord:
    """One search run: where it ran, with which software, on which workload."""

    id: int
    created_at: datetime
    finished_at: datetime | None
    status: str
    arch: str
    device: str | None
    versions: dict[str, Any]
    commit: str | None
    workload: dict[str, Any]
    workload_key: str
    study: str | None
    notes: Any | None


@dataclass(frozen=True)
class CompileReportRecord:
    """How compiling one candidate for one architecture went."""

    arch: str
    ok: bool
    registers: int | None
    spill_bytes: int | None
    smem_bytes: int | None
    compile_seconds: float | None
    error: str | None
    compiler: str | None
    created_at: datetime


@dataclass(frozen=True)
class CandidateRecord:
    """One rendered kernel with its compile reports, keyed by architecture."""

    id: int
    identity: str
    family: str
    template_hash: str
    params: dict[str, Any]
    problem: dict[str, Any]
    source: str
    created_at: datetime
    compile_reports: dict[str, CompileReportRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class MeasurementRecord:
    """One candidate measured in one run; ``reason`` says why when ``ok`` is false."""

    id: int
    run_id: int
    identity: str
    ok: bool
    reason: str | None
    median_us: float | None
    spread_us: float | None
    max_err: float | None
    tolerance: float | None
    tflops: float | None
    extra: Any | None
    created_at: datetime


@dataclass(frozen=True)
class EliteRecord:
    """One of the best candidates for an (arch, workload); rank 1 is the fastest."""

    arch: str
    workload_key: str
    rank: int
    identity: str
    family: str
    params: dict[str, Any]
    problem: dict[str, Any]
    median_us: float
    run_id: int | None
    updated_at: datetime
