"""Persistence of runs, candidates, compile reports, measurements and elites.

``Store(url)`` opens (and migrates) the database, ``Store(url, create=False)`` only one
that exists; ``resolve_url`` is how every command names a store (a path or a SQLAlchemy
URL). Everything a store returns is a frozen record from ``records``. The schema lives in
``models`` and evolves through ``migrations``.
"""

from __future__ import annotations

from evoengine.store._sql import DEFAULT_URL, ClaimLost, Store, resolve_url
from evoengine.store.migrations import LATEST_VERSION
from evoengine.store.records import (
    CandidateRecord,
    CompileReportRecord,
    EliteRecord,
    MeasurementRecord,
    RunRecord,
)

__all__ = [
    "DEFAULT_URL",
    "LATEST_VERSION",
    "CandidateRecord",
    "ClaimLost",
    "CompileReportRecord",
    "EliteRecord",
    "MeasurementRecord",
    "RunRecord",
    "Store",
    "resolve_url",
]
