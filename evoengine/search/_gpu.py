"""The GPU worker process: loads candidates, validates, times (see ``evaluator``).

It is the only process of a search that uses CUDA. Any exception while a candidate runs is
answered as a fault and the worker exits, since a CUDA error can leave the context unusable;
the parent starts a fresh worker for the next candidate.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import traceback
from typing import Any

from evoengine.search.evaluator import DeviceInfo


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def serve(conn: Any, workload_dict: dict[str, Any], device: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        worker = _Worker(workload_dict, device)
    except Exception as e:  # noqa: BLE001 (reported to the parent, which raises)
        conn.send(("error", f"{type(e).__name__}: {e}"))
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
            result = getattr(worker, op)(payload)
        except Exception as e:  # noqa: BLE001
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            where = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("fault", f"fault: {type(e).__name__}: {first} "
                                f"[{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]"))
            conn.close()
            os._exit(3)  # no destructors on a context a fault may have broken
        conn.send(("ok", result))


class _Worker:
    def __init__(self, workload_dict: dict[str, Any], device: int) -> None:
        import cupy
        import torch

        from evoengine import measure
        from evoengine.workload import Workload

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible to torch")
        torch.cuda.set_device(device)
        self.device = device
        self.workload = Workload.from_dict(workload_dict)
        props = torch.cuda.get_device_properties(device)
        self.info = DeviceInfo(
            name=props.name, capability=(props.major, props.minor), driver=_driver(),
            versions={"torch": torch.__version__, "cupy": cupy.__version__,
                      "cuda": str(torch.version.cuda)})
        self.sets = measure.workload_inputs(self.workload, f"cuda:{device}")
        self.scale = 1.0 / math.sqrt(self.workload.head_dim)
        self.graph = measure.graph_for(self.workload)

    def _timer(self, candidate: Any, compiled: Any) -> Any:
        from evoengine import measure
        from evoengine.runtime import Kernel

        kernel = Kernel(candidate, compiled)
        return kernel, measure.kernel_call(kernel, self.sets, self.scale)

    def evaluate(self, payload: Any) -> dict[str, Any]:
        from evoengine import measure, validate

        candidate, compiled = payload
        kernel, call = self._timer(candidate, compiled)
        verdict = validate.check_workload(kernel, self.workload, device=f"cuda:{self.device}")
        if not verdict.ok:
            return {"ok": False, "reason": verdict.reason, "max_err": _finite(verdict.max_err),
                    "tolerance": verdict.tolerance}
        t = measure.time_calls(call, len(self.sets), graph=self.graph)
        return {"ok": True, "median_us": t.median_us, "spread_us": t.spread_us, "reps": t.reps,
                "graph": t.graph, "max_err": verdict.max_err, "tolerance": verdict.tolerance}

    def baseline(self, _payload: Any) -> dict[str, float | None]:
        from evoengine import measure

        out = {}
        for backend in measure.SDPA_BACKENDS:
            t = measure.time_sdpa(self.workload, self.sets, backend, graph=self.graph)
            out[backend] = None if t is None else t.median_us
        return out

    def final(self, payload: Any) -> dict[str, Any]:
        """Interleave: each round times every entry, then each SDPA backend."""
        import torch

        from evoengine import measure

        entries, rounds = payload
        calls = [self._timer(c, r)[1] for c, r in entries]
        samples: list[list[float]] = [[] for _ in calls]
        sdpa: dict[str, list[float]] = {b: [] for b in measure.SDPA_BACKENDS}
        for _ in range(rounds):
            for i, call in enumerate(calls):
                samples[i].append(measure.time_calls(call, len(self.sets),
                                                     graph=self.graph).median_us)
            for backend in measure.SDPA_BACKENDS:
                t = measure.time_sdpa(self.workload, self.sets, backend, graph=self.graph)
                if t is not None:
                    sdpa[backend].append(t.median_us)
        torch.cuda.synchronize()
        return {
            "candidates": [{"median_us": statistics.median(s), "spread_us": max(s) - min(s),
                            "rounds": len(s)} for s in samples],
            **{b: (statistics.median(v) if v else None) for b, v in sdpa.items()},
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
