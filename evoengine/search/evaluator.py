"""Evaluators: validate and time compiled candidates for one workload.

The search talks to an ``Evaluator``. ``GpuEvaluator`` runs the GPU work in a separate
worker process (``evoengine.search._gpu``), so a candidate that faults (illegal address,
illegal instruction, trap) or hangs (a deadlocked barrier) costs one trial: the worker is
killed on a timeout or dies on a fault, the trial is recorded as failed with the reason, and
a fresh worker starts for the next candidate. The parent process never touches CUDA.
"""

from __future__ import annotations

import abc
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from evoengine.compile import CompileResult
from evoengine.render import Candidate
from evoengine.workload import Workload


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

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the device."""

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EvaluatorError(RuntimeError):
    """The device cannot be used at all (not one candidate's failure)."""


class WorkerEvaluator(Evaluator):
    """Runs ``target(conn, *args)`` in a spawned process and talks to it by messages.

    The worker answers ``("ready", DeviceInfo)`` once started, then one reply per request:
    ``("ok", result)``, or ``("fault", reason)`` after which it exits. No answer within the
    timeout means a hang: the worker is killed. Either way the next request starts a new
    worker. ``restarts`` counts the workers replaced.
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], *,
                 timeout_s: float = 30.0, start_timeout_s: float = 300.0) -> None:
        self._target = target
        self._args = args
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._proc: Any = None
        self._conn: Any = None
        self.info: DeviceInfo | None = None
        self.restarts = 0
        self._started_once = False

    def start(self) -> DeviceInfo:
        if self._proc is not None and self._proc.is_alive():
            assert self.info is not None
            return self.info
        if self._started_once:
            self.restarts += 1
        self._started_once = True
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=self._target, args=(child, *self._args),
                                       daemon=True, name="evoengine-gpu-worker")
        self._proc.start()
        child.close()
        self._conn = parent
        status, payload = self._receive(self.start_timeout_s, "starting")
        if status != "ready":
            self._stop()
            raise EvaluatorError(f"the GPU worker could not start: {payload}")
        self.info = payload
        return payload

    def request(self, op: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """Send one request; ``("ok", result)``, ``("fault", reason)`` or
        ``("timeout", reason)``. After anything but ok the worker is gone."""
        self.start()
        try:
            self._conn.send((op, payload))
        except (BrokenPipeError, OSError) as e:
            self._stop()
            return "fault", f"fault: the worker went away ({e})"
        status, result = self._receive(timeout_s, op)
        if status != "ok":
            self._stop()
        return status, result

    def _receive(self, timeout_s: float, what: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", (f"timeout: no answer {what} in {timeout_s:.0f} s "
                                   "(a hang?); worker killed")
            try:
                if self._conn.poll(min(left, 0.5)):
                    return self._conn.recv()
            except (EOFError, OSError):
                return "fault", self._death()
            if not self._proc.is_alive() and not self._conn.poll(0):
                return "fault", self._death()

    def _death(self) -> str:
        self._proc.join(5)
        code = self._proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"fault: the worker died ({how})"

    def _stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)
        self._conn.close()
        self._proc = None
        self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
                self._proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self._stop()

    # ---- the Evaluator interface --------------------------------------------------------

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        start = time.perf_counter()
        status, result = self.request("evaluate", (candidate, compiled), self.timeout_s)
        seconds = time.perf_counter() - start
        if status == "ok":
            return Evaluation(**{**result, "seconds": seconds})
        return Evaluation(False, reason=str(result), seconds=seconds, fault=True)

    def baseline(self) -> dict[str, float | None]:
        status, result = self.request("baseline", None, self.start_timeout_s)
        if status != "ok":
            return {"flash": None, "cudnn": None}
        return result

    def final(self, entries: Sequence[tuple[Candidate, CompileResult]],
              rounds: int) -> dict[str, Any]:
        budget = self.timeout_s * (len(entries) + 2) * max(1, rounds)
        status, result = self.request("final", (list(entries), rounds), budget)
        if status != "ok":
            return {"candidates": [{"error": result}] * len(entries), "flash": None,
                    "cudnn": None}
        return result


class GpuEvaluator(WorkerEvaluator):
    """Evaluates on CUDA device ``device`` in a worker process (see module docstring)."""

    def __init__(self, workload: Workload, *, device: int = 0, timeout_s: float = 30.0,
                 start_timeout_s: float = 300.0) -> None:
        from evoengine.search import _gpu

        super().__init__(_gpu.serve, (workload.to_dict(), device), timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s)
