"""The record format: one sweep of one (arch, workload), as gzip'd JSON.

A **record** holds every point measured in the sweep, its median or its failure, with the
provenance of the runs. Points are keyed by (family, parameters), not by identity: the
identity carries the template's hash, which changes with every template edit, while a record
stays valid for a family whose parameters it names.

Format 1 (``sweep-<arch>-<workload key>.json.gz``)::

    {"format": 1,
     "arch": "sm_90a",
     "workload": {Workload.to_dict()},
     "device": "NVIDIA H100 80GB HBM3", "driver": "...", "date": "ISO 8601 (first run)",
     "commit": "git commit of the sweep", "versions": {"torch": ..., "compiler": ...},
     "note": "free text: how the sweep was run",
     "synthetic": false,            # true: made by a cost model, not measured
     "runs": [run ids of the source store],
     "sdpa": {"flash": us | null, "cudnn": us | null},
     "families": {"mma": {"template_hash": "...", "parameters": ["BLOCK_M", ...],
                          "space": "the search space's TOML as swept"}, ...},
     "points": [{"family": "mma", "params": {...},
                 "compiled": true,  # false: a compile error (reason holds it)
                 "ok": true,        # valid and timed
                 "median_us": 123.4, "spread_us": 0.8, "reason": null,
                 "registers": 168, "spill_bytes": 0, "smem_bytes": 49152,
                 "seconds": 1.9}]}  # evaluation wall time in the sweep, if known

Every point appears once. ``median_us`` is set exactly when ``ok``; ``reason`` exactly when
not ``ok``.

Contract. A ``Record`` is frozen and checked when it is made: anything malformed raises
``RecordError``, whose message says where. ``load_record`` raises ``FileNotFoundError`` for a
missing file and ``RecordError`` for anything else it cannot read; ``save_record`` writes
only the path it is given (creating its folder).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evoengine.arch import get_arch
from evoengine.problems import Workload, workload_from_dict

FORMAT = 1
NOT_RECORDED = "not in the replay record"  # the reason given for a point the record lacks
SYNTHETIC_DEVICE = "SYNTHETIC (cost model, not measured)"  # the device of synthetic records
_TOP_KEYS = {"format", "arch", "workload", "device", "points", "families"}


class RecordError(ValueError):
    """A record is malformed or does not fit the search spaces; the message says where."""


def point_key(family: str, params: Mapping[str, Any]) -> tuple[str, str]:
    """The key of a point in a record: exact in type, so ``True`` is not ``1``."""
    return family, json.dumps(dict(params), sort_keys=True)


@dataclass(frozen=True)
class RecordedPoint:
    family: str
    params: dict[str, Any]
    ok: bool
    median_us: float | None = None
    spread_us: float | None = None
    reason: str | None = None
    compiled: bool = True
    registers: int | None = None
    spill_bytes: int | None = None
    smem_bytes: int | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class Record:
    """One sweep of one (arch, workload); see the module docstring for the file format."""

    arch: str
    workload: Workload
    device: str
    points: tuple[RecordedPoint, ...]
    families: dict[str, dict[str, Any]]
    driver: str | None = None
    date: str | None = None
    commit: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    synthetic: bool = False
    runs: tuple[int, ...] = ()
    sdpa: dict[str, float | None] = field(default_factory=dict)
    path: str | None = field(default=None, compare=False)  # the file it was loaded from

    def __post_init__(self) -> None:
        index: dict[tuple[str, str], RecordedPoint] = {}
        for i, p in enumerate(self.points):
            where = f"point {i} ({p.family} {json.dumps(p.params)})"
            if p.family not in self.families:
                raise RecordError(f"{where}: family {p.family!r} is not listed in 'families'")
            names = list(self.families[p.family]["parameters"])
            if list(p.params) != names:
                raise RecordError(f"{where}: parameters {list(p.params)} are not the family's "
                                  f"declared {names}")
            if p.ok != (p.median_us is not None and math.isfinite(p.median_us)
                        and p.median_us > 0):
                raise RecordError(f"{where}: ok={p.ok} but median_us={p.median_us}")
            if not p.ok and not p.reason:
                raise RecordError(f"{where}: a failed point must say why ('reason')")
            if not p.compiled and p.ok:
                raise RecordError(f"{where}: a point that did not compile cannot be ok")
            key = point_key(p.family, p.params)
            if key in index:
                raise RecordError(f"{where}: recorded twice")
            index[key] = p
        if not index:
            raise RecordError("the record holds no points")
        object.__setattr__(self, "_index", index)

    def lookup(self, family: str, params: Mapping[str, Any]) -> RecordedPoint | None:
        return self._index.get(point_key(family, params))  # type: ignore[attr-defined]

    def optimum(self) -> RecordedPoint:
        """The fastest valid point; ``RecordError`` if none is valid."""
        valid = [p for p in self.points if p.ok]
        if not valid:
            raise RecordError("the record holds no valid point")
        return min(valid, key=lambda p: p.median_us)  # type: ignore[arg-type,return-value]

    def key(self) -> str:
        return f"{self.arch}-{self.workload.key()}"

    def describe(self) -> str:
        ok = sum(p.ok for p in self.points)
        kind = "SYNTHETIC " if self.synthetic else ""
        return (f"{kind}record {self.key()}: {len(self.points)} points ({ok} valid), "
                f"{self.device}, {self.date or 'undated'}, commit {self.commit or '?'}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "arch": self.arch, "workload": self.workload.to_dict(),
            "device": self.device, "driver": self.driver, "date": self.date,
            "commit": self.commit, "versions": self.versions, "note": self.note,
            "synthetic": self.synthetic, "runs": list(self.runs), "sdpa": self.sdpa,
            "families": self.families,
            "points": [{k: v for k, v in asdict(p).items()} for p in self.points],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str | None = None) -> Record:
        where = path or "record"
        if not isinstance(data, Mapping):
            raise RecordError(f"{where}: not a JSON object")
        missing = _TOP_KEYS - set(data)
        if missing:
            raise RecordError(f"{where}: missing {', '.join(sorted(missing))}")
        if data["format"] != FORMAT:
            raise RecordError(f"{where}: format {data['format']!r}; this evoengine reads "
                              f"format {FORMAT}")
        try:
            arch = get_arch(str(data["arch"])).name
            workload = workload_from_dict(dict(data["workload"]))
            families = {str(f): {"template_hash": info.get("template_hash"),
                                 "parameters": list(info["parameters"]),
                                 **({"space": str(info["space"])} if info.get("space") else {})}
                        for f, info in dict(data["families"]).items()}
            points = tuple(_point(p) for p in data["points"])
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None
        except (TypeError, KeyError, ValueError) as e:
            raise RecordError(f"{where}: malformed ({type(e).__name__}: {e})") from None
        try:
            return cls(arch=arch, workload=workload, device=str(data["device"]), points=points,
                       families=families, driver=data.get("driver"), date=data.get("date"),
                       commit=data.get("commit"), versions=dict(data.get("versions") or {}),
                       note=str(data.get("note") or ""),
                       synthetic=bool(data.get("synthetic", False)),
                       runs=tuple(data.get("runs") or ()), sdpa=dict(data.get("sdpa") or {}),
                       path=path)
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None


def _point(p: Any) -> RecordedPoint:
    if not isinstance(p, Mapping) or "family" not in p or "params" not in p or "ok" not in p:
        raise RecordError(f"a point needs 'family', 'params' and 'ok': {p!r:.200}")
    known = RecordedPoint.__dataclass_fields__
    unknown = set(p) - set(known)
    if unknown:
        raise RecordError(f"a point has unknown fields {sorted(unknown)}")
    return RecordedPoint(**{**p, "params": dict(p["params"]), "ok": bool(p["ok"])})


def save_record(record: Record, path: str | Path) -> Path:
    """Write ``record`` as JSON, gzip'd when the name ends in ``.gz``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record.to_dict(), indent=None, separators=(",", ":")) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def load_record(path: str | Path) -> Record:
    """Read a record written by ``save_record``; ``RecordError`` if it is malformed."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        else:
            data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: not a JSON record ({e})") from None
    return Record.from_dict(data, str(path))
