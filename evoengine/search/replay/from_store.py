"""A record from a store: the search-phase measurements of one (arch, workload).

``evoengine record`` writes one from the store of a sweep (``evoengine search --sampler
random`` until every point is measured), for ``evoengine search --replay`` and the strategies
benchmark to replay.

Contract. ``record_from_store`` only reads the store. It raises ``RecordError`` when the
runs cannot make one record: none match, several devices, two template versions of a
family, no search-phase measurement, or no search-space file declaring a family's measured
parameters; the message says which, and how to pick runs that do.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

from evoengine.arch import get_arch
from evoengine.problems import workload_from_dict
from evoengine.search.replay.record import (
    SYNTHETIC_DEVICE,
    Record,
    RecordedPoint,
    RecordError,
    point_key,
)
from evoengine.space import SearchSpace, default_spaces


def record_from_store(store: Any, arch: str, workload_key: str, *,
                      run_ids: Sequence[int] | None = None, note: str = "",
                      spaces: Iterable[SearchSpace] | None = None) -> Record:
    """The record of the search-phase measurements of ``workload_key`` on ``arch`` in
    ``store`` (an ``evoengine.store.Store``), from the runs ``run_ids`` or all such runs.

    One point per (family, parameters): the first measurement taken (a search never measures
    a point twice; another run of the same study does not either). Compile errors are
    points with ``compiled: false``. The runs must share one device; the date is the first
    run's start, the commit and versions the last run's. SDPA times come from the last final
    re-time that holds them. Each family's search space (``spaces``, default the project's)
    is kept in the record as TOML; it must declare the measured parameters, and a point
    stored before a parameter was added is recorded with its legacy value.
    """
    arch = get_arch(arch).name
    space_of = {sp.family: sp for sp in (default_spaces() if spaces is None else spaces)}
    runs = [r for r in reversed(store.runs())
            if r.arch == arch and r.workload_key == workload_key
            and (run_ids is None or r.id in run_ids)]
    if run_ids is not None and {r.id for r in runs} != set(run_ids):
        raise RecordError(f"runs {sorted(set(run_ids) - {r.id for r in runs})} are not runs of "
                          f"{workload_key} on {arch} in {store.url}")
    if not runs:
        raise RecordError(f"no run of {workload_key} on {arch} in {store.url}")
    devices = {r.device for r in runs}
    if len(devices) != 1:
        raise RecordError(f"the runs measured on several devices ({sorted(map(str, devices))}); "
                          "pick runs of one device with run_ids")
    candidates = {c.identity: c for c in store.candidates()}
    points: dict[tuple[str, str], RecordedPoint] = {}
    families: dict[str, dict[str, Any]] = {}
    sdpa: dict[str, float | None] = {}
    for run in runs:
        for m in store.measurements(run_id=run.id):
            phase = (m.extra or {}).get("phase")
            if phase == "final":
                if (m.extra or {}).get("sdpa_flash_us") is not None or (
                        m.extra or {}).get("sdpa_cudnn_us") is not None:
                    sdpa = {"flash": m.extra.get("sdpa_flash_us"),
                            "cudnn": m.extra.get("sdpa_cudnn_us")}
                continue
            if phase != "search":
                continue
            c = candidates[m.identity]
            # A point stored before a parameter was added takes its legacy value (space.py).
            space = space_of.get(c.family)
            params = space.complete(c.params) if space is not None else dict(c.params)
            info = families.setdefault(c.family, {"template_hash": c.template_hash,
                                                  "parameters": list(params)})
            if info["template_hash"] != c.template_hash:
                raise RecordError(f"{c.family} was measured with two template versions "
                                  f"({info['template_hash']}, {c.template_hash}); pick runs of "
                                  "one version with run_ids")
            key = point_key(c.family, params)
            if key in points:
                continue
            report = c.compile_reports.get(arch)
            compiled = report.ok if report is not None else True
            ok = bool(m.ok and m.median_us is not None)
            points[key] = RecordedPoint(
                family=c.family, params=params, ok=ok,
                median_us=m.median_us if ok else None, spread_us=m.spread_us if ok else None,
                reason=None if ok else (m.reason or "failed"), compiled=compiled,
                registers=report.registers if report else None,
                spill_bytes=report.spill_bytes if report else None,
                smem_bytes=report.smem_bytes if report else None,
                seconds=(m.extra or {}).get("seconds"))
    if not points:
        raise RecordError(f"the runs {[r.id for r in runs]} hold no search-phase measurement")
    for family, info in families.items():
        space = space_of.get(family)
        if space is None or space.path is None or list(space.parameters) != info["parameters"]:
            raise RecordError(f"no search-space file declares {family}'s measured parameters "
                              f"{info['parameters']}; pass the spaces the sweep used")
        info["space"] = space.path.read_text()
    last = runs[-1]
    versions = dict(last.versions)
    return Record(arch=arch, workload=workload_from_dict(last.workload),
                  device=str(last.device), points=tuple(points.values()), families=families,
                  driver=versions.get("driver"),
                  date=_utc(runs[0].created_at).isoformat(timespec="seconds"),
                  commit=last.commit, versions=versions, note=note,
                  synthetic=last.device == SYNTHETIC_DEVICE,
                  runs=tuple(r.id for r in runs), sdpa=sdpa)


def _utc(t: datetime.datetime) -> datetime.datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=datetime.UTC)
