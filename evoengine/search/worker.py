"""The GPU worker protocol: a search's process and its GPU worker process, both ends.

The search's own process never touches CUDA. ``GpuEvaluator`` starts ``serve`` in a spawned
process and talks to it by messages over a pipe, so a candidate that faults (illegal address,
illegal instruction, trap) or hangs (a deadlocked barrier) costs one trial: the worker dies on
a fault or is killed on a timeout, the trial is recorded as failed with the reason, and a
fresh worker starts for the next candidate. The messages, each a pickled tuple::

    worker -> parent, once   ("ready", DeviceInfo)  or  ("error", "why it cannot start")
    parent -> worker         ("evaluate", (Candidate, CompileResult))
                             ("baseline", None)
                             ("final", ([(Candidate, CompileResult), ...], rounds))
                             ("final_on", (workload dict, [(Candidate, CompileResult), ...],
                                           rounds))
                             ("stop", None)
    worker -> parent         ("ok", result)  or  ("fault", "fault: ...") and the worker exits

``WorkerEvaluator`` is the parent's end for any ``target(conn, *args)`` that speaks this
protocol (tests plant workers that fault and hang); ``GpuEvaluator`` is it with ``serve``.
``GpuWorker`` is what ``serve`` answers with: it is public so that a tool can validate and
time in its own process exactly as a search does (``benchmarks/retime.py``).

Contract. ``WorkerEvaluator`` never raises for a worker's fault or hang: ``evaluate``
returns a failed ``Evaluation`` (``fault=True``), ``baseline`` None times, ``final`` an error
per entry; only ``start`` raises, ``EvaluatorError``, when the worker cannot start.
``GpuWorker``'s methods raise whatever CUDA or the candidate raises; ``serve`` answers that
as a fault and exits at once, since a CUDA error can leave the context unusable. Neither end
mutates the candidates or compile results it is sent.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from evoengine.compile import CompileResult
from evoengine.problems import Workload, problem_of, workload_from_dict
from evoengine.render import Candidate
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator, EvaluatorError

# ---- the parent's end -------------------------------------------------------------------


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

    def final_on(self, workload: Workload, entries: Sequence[tuple[Candidate, CompileResult]],
                 rounds: int) -> dict[str, Any]:
        budget = self.timeout_s * (len(entries) + 2) * max(1, rounds) + self.start_timeout_s
        status, result = self.request("final_on", (workload.to_dict(), list(entries), rounds),
                                      budget)
        if status != "ok":
            return {"candidates": [{"error": result}] * len(entries), "flash": None,
                    "cudnn": None}
        return result


class GpuEvaluator(WorkerEvaluator):
    """Evaluates on CUDA device ``device`` in a worker process running ``serve``."""

    def __init__(self, workload: Workload, *, device: int = 0, timeout_s: float = 30.0,
                 start_timeout_s: float = 300.0) -> None:
        super().__init__(serve, (workload.to_dict(), device), timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s)


# ---- the worker's end -------------------------------------------------------------------

def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def serve(conn: Any, workload_dict: dict[str, Any], device: int) -> None:
    """The worker process: start a ``GpuWorker`` and answer requests until ``stop`` (or the
    parent goes away); a request that raises is answered as a fault and the process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        worker = GpuWorker(workload_from_dict(workload_dict), device)
    except Exception as e:  # noqa: BLE001 (reported to the parent, which raises)
        conn.send(("error", f"{type(e).__name__}: {_first_line(e)}"))
        return
    conn.send(("ready", worker.info))
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):
            return
        if op == "stop":
            return
        try:
            result = _answer(worker, op, payload)
        except Exception as e:  # noqa: BLE001
            where = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("fault", f"fault: {type(e).__name__}: {_first_line(e)} "
                                f"[{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]"))
            conn.close()
            os._exit(3)  # no destructors on a context a fault may have broken
        conn.send(("ok", result))


def _answer(worker: GpuWorker, op: str, payload: Any) -> Any:
    if op == "evaluate":
        return worker.evaluate(*payload)
    if op == "baseline":
        return worker.baseline()
    if op == "final":
        return worker.final(*payload)
    if op == "final_on":  # another workload of the problem: its own inputs, this process
        data, entries, rounds = payload
        return GpuWorker(workload_from_dict(data), worker.device).final(entries, rounds)
    raise ValueError(f"unknown request {op!r}")


class GpuWorker:
    """Validates and times candidates of ``workload`` on CUDA device ``device``, in this
    process, as the workload's problem (``evoengine.problems``) says: its criterion on the
    shapes it plans, then ``measure.time_calls`` on its inputs, rotated past L2 (graph replay
    where the problem says so), next to its anchors (SDPA's backends).

    Raises ``RuntimeError`` when no CUDA GPU is visible. Its methods answer the protocol's
    requests: ``evaluate`` the fields of an ``Evaluation``, ``baseline`` the anchors' times,
    ``final`` the interleaved re-time (``Evaluator.final``'s format).
    """

    def __init__(self, workload: Workload, device: int = 0) -> None:
        import cupy
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible to torch")
        if not 0 <= device < torch.cuda.device_count():
            raise RuntimeError(f"no CUDA device {device} is visible to torch (devices 0 to "
                               f"{torch.cuda.device_count() - 1} are)")
        torch.cuda.set_device(device)
        self.device = device
        self.workload = workload
        self.problem = problem_of(workload)
        props = torch.cuda.get_device_properties(device)
        self.info = DeviceInfo(
            name=props.name, capability=(props.major, props.minor), driver=_driver(),
            versions={"torch": torch.__version__, "cupy": cupy.__version__,
                      "cuda": str(torch.version.cuda)})
        self.sets = self.problem.inputs(self.workload, f"cuda:{device}")
        self.graph = self.problem.graph_for(self.workload)

    def _timer(self, candidate: Candidate, compiled: CompileResult) -> Any:
        kernel = self.problem.load(candidate, compiled)
        return kernel, self.problem.timed_call(kernel, self.workload, self.sets)

    def _anchor(self, anchor: str) -> float | None:
        t = self.problem.time_anchor(anchor, self.workload, self.sets, graph=self.graph)
        return None if t is None else t.median_us

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> dict[str, Any]:
        from evoengine import measure

        kernel, call = self._timer(candidate, compiled)
        verdict = self.problem.check(kernel, self.workload, device=f"cuda:{self.device}")
        if not verdict.ok:
            return {"ok": False, "reason": verdict.reason, "max_err": _finite(verdict.max_err),
                    "tolerance": verdict.tolerance}
        t = measure.time_calls(call, len(self.sets), graph=self.graph)
        return {"ok": True, "median_us": t.median_us, "spread_us": t.spread_us, "reps": t.reps,
                "graph": t.graph, "max_err": verdict.max_err, "tolerance": verdict.tolerance}

    def baseline(self) -> dict[str, float | None]:
        return {anchor: self._anchor(anchor) for anchor in self.problem.anchors}

    def final(self, entries: Sequence[tuple[Candidate, CompileResult]],
              rounds: int) -> dict[str, Any]:
        """Interleave: each round times every entry, then each SDPA backend."""
        import torch

        from evoengine import measure

        calls = [self._timer(c, r)[1] for c, r in entries]
        samples: list[list[float]] = [[] for _ in calls]
        anchors: dict[str, list[float]] = {a: [] for a in self.problem.anchors}
        for _ in range(rounds):
            for i, call in enumerate(calls):
                samples[i].append(measure.time_calls(call, len(self.sets),
                                                     graph=self.graph).median_us)
            for anchor, times in anchors.items():
                us = self._anchor(anchor)
                if us is not None:
                    times.append(us)
        torch.cuda.synchronize()
        return {
            "candidates": [{"median_us": statistics.median(s), "spread_us": max(s) - min(s),
                            "rounds": len(s)} for s in samples],
            **{a: (statistics.median(v) if v else None) for a, v in anchors.items()},
        }


def _first_line(e: BaseException) -> str:
    """An exception's message up to its first line break: CUDA's errors through torch go on
    for lines of debugging advice, and the parent prints the reason as one line."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
