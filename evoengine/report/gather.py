"""What a report shows, read from a store: the runs a selection names, grouped by workload.

``Selection`` says which runs count (studies by name or prefix, a tune's studies, a target,
a problem kind); ``gather`` reads them, and per (arch, workload) their search's progression,
the final re-time with the anchors timed beside it, and the store's elites, into plain
records that the page and the plots draw without touching the store again.

Contract. Reading only: nothing here writes to the store. ``gather`` raises ``ValueError``
(one line, naming what the store holds) when the selection matches no run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evoengine.problems import (
    DEFAULT_KIND,
    Rate,
    problem_of,
    workload_from_dict,
    workload_from_key,
)
from evoengine.search.evidence import ANCHOR_KEYS
from evoengine.store import EliteRecord, MeasurementRecord, RunRecord, Store

# How the page names each anchor (the problems' anchors, keyed as ANCHOR_KEYS keys them).
ANCHOR_NAMES = {"flash": "SDPA flash", "cudnn": "SDPA cuDNN", "fa4": "FlashAttention-4",
                "flashinfer": "FlashInfer"}


@dataclass(frozen=True)
class Selection:
    """Which runs a report covers. ``studies``: names, or prefixes where one ends in ``*``;
    ``tunes``: tune names, each meaning every study named ``<tune>/...``. Studies and tunes
    are alternatives (a run matching any counts; none given: every run); ``arch`` and
    ``kind`` narrow the result."""

    studies: tuple[str, ...] = ()
    tunes: tuple[str, ...] = ()
    arch: str | None = None
    kind: str | None = None

    def matches(self, run: RunRecord) -> bool:
        if self.arch is not None and run.arch != self.arch:
            return False
        if self.kind is not None and run_kind(run) != self.kind:
            return False
        if not self.studies and not self.tunes:
            return True
        study = run.study or ""
        return (any(_name_matches(study, p) for p in self.studies)
                or any(study.startswith(f"{t}/") for t in self.tunes))

    def describe(self) -> str:
        """The selection as flags, e.g. ``--tune t1 --arch sm_90a``; ``every run`` if none."""
        flags = [f"--study {s}" for s in self.studies] + [f"--tune {t}" for t in self.tunes]
        flags += [f"--arch {self.arch}"] if self.arch else []
        flags += [f"--kind {self.kind}"] if self.kind else []
        return " ".join(flags) or "every run"


def _name_matches(name: str, pattern: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def run_kind(run: RunRecord) -> str:
    """The problem kind of a run's workload (rows from before kinds are forwards)."""
    return str((run.workload or {}).get("kind", DEFAULT_KIND))


@dataclass(frozen=True)
class Progression:
    """One study's search on one workload: after each evaluation (failed ones count), the
    fastest valid time so far (None until the first valid one)."""

    study: str
    best_us: tuple[float | None, ...]


@dataclass(frozen=True)
class FinalRetime:
    """The fastest point of one run's final re-time, and the anchors timed in that process,
    interleaved with it (``anchors_us``: anchor name to µs; None where one could not run)."""

    run: RunRecord
    identity: str
    ours_us: float
    rounds: int | None
    anchors_us: dict[str, float | None]


@dataclass(frozen=True)
class WorkloadReport:
    """Everything the page shows for one (arch, workload)."""

    arch: str
    key: str
    kind: str
    workload: Any | None  # the problem's workload object; None where it cannot be rebuilt
    runs: tuple[RunRecord, ...]
    studies: tuple[str, ...]  # in the order their first runs started
    progressions: tuple[Progression, ...]  # one per study, in that order
    final: FinalRetime | None
    elites: tuple[EliteRecord, ...]

    @property
    def anchor(self) -> str:
        """An HTML id for this workload's section."""
        return f"w-{self.arch}-{self.key}"

    def rate(self) -> Rate | None:
        """How this workload's times read as a rate (``Problem.rate``); None if unknown."""
        return None if self.workload is None else problem_of(self.workload).rate(self.workload)


@dataclass(frozen=True)
class Gathered:
    """The selected runs (oldest first), the workloads they searched, and the store's URL."""

    store: str
    runs: tuple[RunRecord, ...]
    workloads: tuple[WorkloadReport, ...]
    evaluations: dict[int, int]  # run id: search-phase measurements


def gather(store: Store, selection: Selection, shown_url: str) -> Gathered:
    """Read the runs ``selection`` names from ``store`` and group them by (arch, workload)."""
    every = sorted(store.runs(), key=lambda r: r.id)
    runs = [r for r in every if selection.matches(r)]
    if not runs:
        studies = sorted({r.study for r in every if r.study})
        have = (f"its studies: {', '.join(studies)}" if studies else
                "it holds no runs" if not every else "its runs name no study")
        raise ValueError(f"no run in {shown_url} matches {selection.describe()}; {have}")
    measured = {r.id: store.measurements(run_id=r.id) for r in runs}
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in runs:
        groups.setdefault((r.arch, r.workload_key), []).append(r)
    workloads = tuple(_workload_report(store, arch, key, rs, measured)
                      for (arch, key), rs in sorted(groups.items()))
    evaluations = {rid: sum(1 for m in ms if _phase(m) != "final") for rid, ms in measured.items()}
    return Gathered(shown_url, tuple(runs), workloads, evaluations)


def _workload_report(store: Store, arch: str, key: str, runs: list[RunRecord],
                     measured: dict[int, list[MeasurementRecord]]) -> WorkloadReport:
    studies = tuple(dict.fromkeys(r.study or "(no study)" for r in runs))
    progressions = []
    for study in studies:
        best: float | None = None
        trail: list[float | None] = []
        for r in runs:
            if (r.study or "(no study)") != study:
                continue
            for m in measured[r.id]:
                if _phase(m) == "final":
                    continue
                if m.ok and m.median_us is not None:
                    best = m.median_us if best is None else min(best, m.median_us)
                trail.append(best)
        progressions.append(Progression(study, tuple(trail)))
    return WorkloadReport(arch=arch, key=key, kind=run_kind(runs[-1]),
                          workload=_workload(runs[-1], key), runs=tuple(runs), studies=studies,
                          progressions=tuple(progressions), final=_final(runs, measured),
                          elites=tuple(store.elites(arch=arch, workload_key=key)))


def _phase(m: MeasurementRecord) -> str:
    return str((m.extra or {}).get("phase", "search"))


def _final(runs: list[RunRecord],
           measured: dict[int, list[MeasurementRecord]]) -> FinalRetime | None:
    """The final re-time whose fastest point is the fastest of any selected run: its anchors
    were timed in the same process, so only its own ratios are compared."""
    found: FinalRetime | None = None
    for r in runs:
        finals = [m for m in measured[r.id]
                  if _phase(m) == "final" and m.ok and m.median_us is not None]
        if not finals:
            continue
        m = min(finals, key=lambda m: m.median_us or 0.0)
        assert m.median_us is not None
        if found is None or m.median_us < found.ours_us:
            extra = m.extra or {}
            anchors = {a: extra[k] for a, k in ANCHOR_KEYS.items() if k in extra}
            found = FinalRetime(r, m.identity, m.median_us, extra.get("rounds"), anchors)
    return found


def _workload(run: RunRecord, key: str) -> Any | None:
    try:
        return workload_from_dict(run.workload)
    except (TypeError, ValueError):
        pass
    try:
        return workload_from_key(key)
    except ValueError:
        return None
