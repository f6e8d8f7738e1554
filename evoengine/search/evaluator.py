"""Evaluators: what the search asks of a device, for one workload.

The search talks to an ``Evaluator`` only. ``GpuEvaluator`` (``evoengine.search.worker``)
runs the GPU work in a worker process; ``ReplayEvaluator`` (``evoengine.search.replay``)
answers from a recorded sweep; tests plant their own.

Contract of every ``Evaluator``: ``evaluate`` never raises for anything a candidate does
(wrong answers, faults, hangs): it returns ``Evaluation(ok=False, reason=...)``. Any method
may raise ``EvaluatorError`` when the device itself cannot be used; nothing else is expected
to escape, and the search stops on anything that does. An evaluator never mutates the
candidates or compile results it is given. This module imports no other module of the search.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from evoengine.compile import CompileResult
from evoengine.render import Candidate


@dataclass(frozen=True)
class Evaluation:
    """What evaluating one candidate gave. ``ok`` means valid and timed."""

    ok: bool
    reason: str | None = None
    median_us: float | None = None
    spread_us: float | None = None
    reps: int | None = None
    graph: bool | None = None
    max_err: float | None = None
    tolerance: float | None = None
    seconds: float = 0.0
    fault: bool = False  # the worker died or hung and was replaced

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    driver: str
    versions: dict[str, str] = field(default_factory=dict)


class Evaluator(abc.ABC):
    """Measures candidates of one workload on one device.

    Contract: ``evaluate`` never raises for anything the candidate does (wrong answers,
    faults, hangs); it returns ``Evaluation(ok=False, reason=...)``. It may raise
    ``EvaluatorError`` when the device itself cannot be used.
    """

    @abc.abstractmethod
    def start(self) -> DeviceInfo:
        """Bring the device up (idempotent); what it is."""

    @abc.abstractmethod
    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        """Validate with the criterion, then time on the workload."""

    @abc.abstractmethod
    def baseline(self) -> dict[str, float | None]:
        """Median µs of SDPA's backends (``flash``, ``cudnn``) on the workload; None where
        a backend cannot run it."""

    @abc.abstractmethod
    def final(self, entries: Sequence[tuple[Candidate, CompileResult]],
              rounds: int) -> dict[str, Any]:
        """Re-time ``entries`` interleaved with SDPA's backends in one process, ``rounds``
        times round-robin: ``{"candidates": [{"median_us", "spread_us"} | {"error"}],
        "flash": us | None, "cudnn": us | None}``, medians over the rounds."""

    def final_on(self, workload: Any, entries: Sequence[tuple[Candidate, CompileResult]],
                 rounds: int) -> dict[str, Any]:
        """``final`` on another workload of the same problem (``evoengine.search.cross``
        times an entry's neighbours across the lengths it serves). Optional: an evaluator
        that times only its own workload raises ``EvaluatorError``."""
        raise EvaluatorError(f"{type(self).__name__} times only its own workload")

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the device."""

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EvaluatorError(RuntimeError):
    """The device cannot be used at all (not one candidate's failure)."""
