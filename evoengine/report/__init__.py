"""``evoengine report``: one self-contained HTML page of what a store's searches found.

``write_report(store, selection, output)`` reads the runs ``selection`` names
(``gather``), the parameter importances of their Optuna studies (``importance``), draws
the plots (``plots``, matplotlib as inline SVG) and writes the page (``page``). Per
workload: the best time against evaluations, ours next to the anchors of the final
re-time, the elites, the importances; then the runs (devices, commits, dates).

Contract. Reads the store and writes nothing to it (opening it upgrades an older schema, as
every command does); never creates one: a store that does not exist is a
``FileNotFoundError``. A selection that matches no run is a one-line ``ValueError``.
Writes only ``output`` (creating its folder).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from evoengine import paths
from evoengine.report.gather import Gathered, Selection, gather
from evoengine.report.importance import StudyImportance, study_importances
from evoengine.search.cross import is_cross_study
from evoengine.store import Store

__all__ = ["Report", "Selection", "write_report"]


@dataclass(frozen=True)
class Report:
    """A written report: where, and how much it covers."""

    path: Path
    runs: int
    workloads: int

    def summary(self) -> str:
        return f"report of {self.runs} runs on {self.workloads} workloads written to {self.path}"


def write_report(store: str | os.PathLike[str] | None, selection: Selection,
                 output: str | os.PathLike[str]) -> Report:
    """Write the report of ``selection``'s runs in ``store`` to ``output``."""
    from evoengine.report.page import render

    path = paths.output_file(output, "report")
    with Store(store, create=False) as s:
        shown = sa.make_url(s.url).render_as_string(hide_password=True)
        gathered: Gathered = gather(s, selection, shown)
        url = s.url
    importances: dict[str, StudyImportance] = {}
    for r in gathered.runs:
        if r.study and r.study not in importances:
            importances[r.study] = (
                StudyImportance(r.study, notes=(
                    "a tune's cross re-time: it times other searches' elites, so it has no "
                    "trials of its own to read importances from",))
                if is_cross_study(r.study) else study_importances(url, r.study))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(gathered, importances, selection.describe()), encoding="utf-8")
    return Report(path, len(gathered.runs), len(gathered.workloads))
