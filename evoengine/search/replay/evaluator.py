"""The replay's evaluator and compiler: recorded outcomes instead of a GPU and NVRTC.

``ReplayEvaluator`` answers ``evaluate`` with the recorded median or failure;
``replay_compile`` gives the ``compile_fn`` that reproduces recorded compile errors and runs
no NVRTC. With ``replay_domain``, ``evoengine search --replay FILE`` runs the normal loop on
them.

Contract. Neither raises for a point: one the record lacks is a failed evaluation, or a
failed compile, with the reason ``NOT_RECORDED``. ``replay_compile`` raises ``ValueError`` for
a record that was never saved to a file (the compiler processes read it from there, cached
by path and modification time). Neither mutates the record, candidates or compile results.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evoengine.arch import Arch, get_arch
from evoengine.compile import CompileResult
from evoengine.render import Candidate
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator
from evoengine.search.replay.record import NOT_RECORDED, Record, load_record


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



@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int) -> Record:
    return load_record(path)

