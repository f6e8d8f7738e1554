"""Replay: search on recorded measurements instead of a GPU, as Kernel Tuner's simulation
mode does, so strategies and scheduling can be tested (and compared) in CI.

A **record** is one sweep of one (arch, workload): every point measured, its median or its
failure. ``record_from_store`` builds one from the search-phase measurements of a store;
``save_record`` / ``load_record`` write and read it as gzip'd JSON (plain JSON is read too).
``ReplayEvaluator`` answers ``evaluate`` from the record, ``replay_compile`` answers the
compiler (reproducing recorded compile errors, running no NVRTC) and ``replay_domain`` is the
``Domain`` of the recorded points only, so no sampler can propose a point the record lacks.
``evoengine search --replay FILE`` runs the normal loop on the three.

Points are keyed by (family, parameters), not by identity: the identity carries the
template's hash, which changes with every template edit, while a record stays valid for a
family whose parameters it names. The record carries each family's search space as swept
(its TOML), and a replay uses that, so a record outlives later edits of the spaces (a new
parameter, a changed constraint). A replay given other spaces explicitly refuses a record
whose parameter lists differ from theirs, as Kernel Tuner's cache refuses another parameter
list.

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
"""

from __future__ import annotations

import datetime
import functools
import gzip
import hashlib
import json
import math
import statistics
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evoengine.arch import Arch, get_arch
from evoengine.compile import CompileResult
from evoengine.render import Candidate
from evoengine.search.domain import Domain
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator
from evoengine.space import SearchSpace, default_spaces
from evoengine.workload import Workload

FORMAT = 1
NOT_RECORDED = "not in the replay record"
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
            workload = Workload.from_dict(dict(data["workload"]))
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
        with gzip.open(path, "wt", encoding="utf-8") as f:  # mtime 0: same content, same bytes
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


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int) -> Record:
    return load_record(path)


# ---- from a store -------------------------------------------------------------------------

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
    return Record(arch=arch, workload=Workload.from_dict(last.workload),
                  device=str(last.device), points=tuple(points.values()), families=families,
                  driver=versions.get("driver"),
                  date=_utc(runs[0].created_at).isoformat(timespec="seconds"),
                  commit=last.commit, versions=versions, note=note,
                  synthetic=last.device == SYNTHETIC_DEVICE,
                  runs=tuple(r.id for r in runs), sdpa=sdpa)


def _utc(t: datetime.datetime) -> datetime.datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=datetime.UTC)


# ---- the domain, the evaluator, the compiler ----------------------------------------------

class RecordedDomain(Domain):
    """The admitted points of the spaces that the record holds; any other point is
    rejected with "not in the replay record", so samplers and the loop never build it.

    ``skipped`` lists recorded points the spaces no longer admit (a changed constraint).
    """

    renders = False  # the templates may have moved on since the sweep; replay needs no source

    def __init__(self, spaces: Iterable[SearchSpace] | None, record: Record) -> None:
        spaces = recorded_spaces(record) if spaces is None else list(spaces)
        arch = get_arch(record.arch)
        super().__init__(spaces, record.workload, arch)
        for family, info in record.families.items():
            if family in self.spaces and list(self.spaces[family].parameters) != list(
                    info["parameters"]):
                raise RecordError(
                    f"{record.path or 'the record'}: {family} parameters "
                    f"{info['parameters']} differ from the search space's "
                    f"{list(self.spaces[family].parameters)}; record the sweep again")
        self.record = record
        admitted = {point_key(f, p) for f, pts in self.points.items() for p in pts}
        self.skipped = [p for p in record.points if point_key(p.family, p.params) not in admitted]
        for family in list(self.points):
            kept = [p for p in self.points[family] if record.lookup(family, p) is not None]
            if kept:
                self.points[family] = kept
            else:
                del self.points[family]
                del self.spaces[family]
        if not self.points:
            raise RecordError(f"{record.path or 'the record'}: none of its points is admitted "
                              "by the search spaces")
        self._identities = {self.identity(f, p): (f, p)
                            for f, pts in self.points.items() for p in pts}

    def violations(self, family: str, params: Mapping[str, Any]) -> list[str]:
        bad = super().violations(family, params)
        if not bad and self.record.lookup(family, params) is None:
            bad = [NOT_RECORDED]
        return bad


def recorded_spaces(record: Record) -> list[SearchSpace]:
    """The search spaces the record was swept with (the project's for a family whose record
    carries none)."""
    current = {sp.family: sp for sp in default_spaces()}
    out = []
    for family, info in record.families.items():
        if "space" in info:
            try:
                out.append(SearchSpace.from_dict(tomllib.loads(info["space"])))
            except (tomllib.TOMLDecodeError, ValueError) as e:
                raise RecordError(f"{record.path or 'the record'}: {family}'s space: {e}") from None
        elif family in current:
            out.append(current[family])
    return out


def replay_domain(record: Record, spaces: Iterable[SearchSpace] | None = None) -> Domain:
    """The ``Domain`` of the recorded points that ``spaces`` (default: the record's own)
    admit."""
    return RecordedDomain(spaces, record)


class ReplayEvaluator(Evaluator):
    """Answers from a record instead of a GPU.

    ``delay_s`` is slept per evaluation, plus ``time_scale`` times the evaluation's recorded
    wall time, so scheduling tests can simulate a GPU's pace. ``evaluated`` lists the points
    asked for, in order.
    """

    def __init__(self, record: Record, *, delay_s: float = 0.0, time_scale: float = 0.0) -> None:
        self.record = record
        self.delay_s = delay_s
        self.time_scale = time_scale
        self.evaluated: list[tuple[str, dict[str, Any]]] = []

    def start(self) -> DeviceInfo:
        arch = get_arch(self.record.arch)
        versions = {k: str(v) for k, v in self.record.versions.items()
                    if k not in ("driver", "evoengine", "compiler")}
        return DeviceInfo(self.record.device, _capability(arch), self.record.driver or "replay",
                          {**versions, "replay": self.record.path or "in memory"})

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        self.evaluated.append((candidate.family, dict(candidate.params)))
        p = self.record.lookup(candidate.family, candidate.params)
        if p is None:
            return Evaluation(False, reason=NOT_RECORDED)
        seconds = self.delay_s + self.time_scale * (p.seconds or 0.0)
        if seconds > 0:
            time.sleep(seconds)
        if not p.ok:
            reason = p.reason or "failed"
            return Evaluation(False, reason=reason, seconds=seconds,
                              fault=reason.startswith(("fault", "timeout")))
        return Evaluation(True, median_us=p.median_us, spread_us=p.spread_us, seconds=seconds)

    def baseline(self) -> dict[str, float | None]:
        return {"flash": self.record.sdpa.get("flash"), "cudnn": self.record.sdpa.get("cudnn")}

    def final(self, entries: Sequence[tuple[Candidate, CompileResult]],
              rounds: int) -> dict[str, Any]:
        out = []
        for candidate, _ in entries:
            p = self.record.lookup(candidate.family, candidate.params)
            if p is None or not p.ok:
                out.append({"error": NOT_RECORDED if p is None else p.reason})
            else:
                out.append({"median_us": p.median_us, "spread_us": p.spread_us or 0.0,
                            "rounds": rounds})
        return {"candidates": out, **self.baseline()}


def _capability(arch: Arch) -> tuple[int, int]:
    return divmod(arch.sm, 10)


@dataclass(frozen=True)
class ReplayCompiler:
    """A ``compile_fn`` for ``search``: the recorded compile outcome, no NVRTC. It carries
    only the record's path (it is pickled to the compiler processes, once per candidate)."""

    path: str

    def __call__(self, candidate: Candidate, arch: str) -> CompileResult:
        p = Path(self.path)
        point = _load_cached(str(p.resolve()), p.stat().st_mtime_ns).lookup(
            candidate.family, candidate.params)
        if point is None:
            return CompileResult(candidate.identity, arch, False, error=NOT_RECORDED)
        if not point.compiled:
            error = (point.reason or "compile error").removeprefix("compile error: ")
            return CompileResult(candidate.identity, arch, False, error=error)
        spill = point.spill_bytes
        return CompileResult(candidate.identity, arch, True, registers=point.registers,
                             spill_stores=spill, spill_loads=0 if spill is not None else None,
                             smem_bytes=point.smem_bytes if point.smem_bytes is not None
                             else candidate.smem_bytes, cubin=b"replay")


def replay_compile(record: Record | str | Path) -> ReplayCompiler:
    """The ``compile_fn`` replaying ``record`` (a loaded record must have come from a file)."""
    path = record.path if isinstance(record, Record) else str(record)
    if path is None:
        raise ValueError("replay_compile needs a record saved to a file (save_record)")
    return ReplayCompiler(str(Path(path).resolve()))


# ---- a synthetic record, for development only ---------------------------------------------

SYNTHETIC_DEVICE = "SYNTHETIC (cost model, not measured)"


def synthetic_record(workload: Workload, arch: str = "sm_90a", *,
                     spaces: Iterable[SearchSpace] | None = None, seed: int = 0) -> Record:
    """A record made by a deterministic cost model over the real domain of ``workload``:
    for developing and testing the replay and the strategies benchmark, never evidence.

    The model is a product of per-parameter factors (each a bowl over an ordered domain or a
    fixed penalty per categorical value), a family factor, pairwise interactions and a few
    percent of hashed noise; about 4% of points fail to compile and 3% give wrong answers.
    """
    domain = Domain(default_spaces() if spaces is None else spaces, workload, get_arch(arch))

    def u(*parts: object) -> float:  # a deterministic uniform in [0, 1)
        h = hashlib.sha256(json.dumps([seed, *parts], default=str).encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    family_base = {f: 60.0 * (1.0 + 0.8 * u("family", f)) for f in domain.families}
    points = []
    for family, params in domain.all_points():
        names = list(domain.spaces[family].parameters)
        t = family_base[family]
        for name in names:
            values = list(domain.spaces[family].parameters[name])
            i = next(k for k, v in enumerate(values) if type(v) is type(params[name])
                     and v == params[name])
            if len(values) > 1 and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in values):
                best = u("best", family, name) * (len(values) - 1)
                t *= 1.0 + 0.25 * u("width", family, name) * ((i - best) / (len(values) - 1)) ** 2
            else:
                t *= 1.0 + 0.12 * u("value", family, name, i)
        for a, b in zip(names, names[1:], strict=False):
            t *= 1.0 + 0.04 * u("pair", family, a, b, params[a], params[b])
        t *= 1.0 + 0.03 * u("noise", family, params)
        r = u("fail", family, params)
        ok, compiled, reason = True, True, None
        if r < 0.04:
            ok, compiled, reason = False, False, "compile error: synthetic failure"
        elif r < 0.07:
            ok, reason = False, "wrong answer: synthetic failure"
        points.append(RecordedPoint(
            family=family, params=dict(params), ok=ok, median_us=round(t, 3) if ok else None,
            spread_us=round(0.01 * t, 3) if ok else None, reason=reason, compiled=compiled,
            registers=128 if compiled else None, spill_bytes=0 if compiled else None,
            smem_bytes=None, seconds=0.5))
    times = [p.median_us for p in points if p.ok]
    return Record(
        arch=domain.arch.name, workload=workload, device=SYNTHETIC_DEVICE,
        points=tuple(points),
        families={f: {"template_hash": None, "parameters": list(s.parameters)}
                  for f, s in domain.spaces.items()},
        driver=None, date=None, commit=None, versions={},
        note=f"SYNTHETIC: evoengine.search.replay.synthetic_record(seed={seed}); not measured",
        synthetic=True, sdpa={"flash": round(statistics.median(times), 3), "cudnn": None})
