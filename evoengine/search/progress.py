"""Progress of a search: a live status line and the final table of elites."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from evoengine.problems.base import Rate


@dataclass
class Tally:
    """Counts of one search invocation, updated as trials finish."""

    planned: int | None = None
    deadline: float | None = None  # time.monotonic() at which no new trial starts
    evaluated: int = 0  # reached the GPU
    valid: int = 0
    compile_failed: int = 0
    faults: int = 0  # worker died or hung
    answered_from_store: int = 0
    rejected: int = 0  # sampler proposals the constraints rejected (Optuna samplers only)
    cached_compiles: int = 0
    cold_compiles: int = 0
    best_us: float | None = None
    best_identity: str | None = None
    baseline: dict[str, float | None] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    first_eval: float | None = None
    stopped: float | None = None  # time.monotonic() when the search loop ended
    gpu_idle_s: float = 0.0  # time the GPUs waited on the compiler, summed over GPUs
    compiling: int = 0
    per_gpu: dict[int, int] = field(default_factory=dict)  # evaluations by device
    claimed_elsewhere: int = 0  # proposals another worker had claimed first
    released: int = 0  # claims of dead workers' trials given back
    claims_lost: int = 0  # measurements dropped: the trial was failed as stale meanwhile
    seeds: int = 0  # points the sampler tried first: other workloads' elites and the priors
    seeds_from_priors: int = 0  # of those, the ones only the target's priors gave

    @property
    def finished(self) -> int:
        return self.evaluated + self.compile_failed

    def search_minutes(self) -> float | None:
        """Minutes from the first evaluation to the end of the search loop (or now)."""
        if self.first_eval is None:
            return None
        return ((self.stopped or time.monotonic()) - self.first_eval) / 60

    def evals_per_minute(self, evaluated: int | None = None) -> float | None:
        """Of all GPUs, or of ``evaluated`` evaluations over the same window."""
        n = self.evaluated if evaluated is None else evaluated
        minutes = self.search_minutes()
        if minutes is None or n < 2:
            return None
        return n / minutes if minutes > 0 else None


class Progress:
    """Writes a status line to ``stream``: rewritten in place on a terminal, else a line at
    most every ``every_s`` seconds (and on each new best)."""

    def __init__(self, rate: Rate | float, stream: TextIO | None = None, every_s: float = 10.0,
                 quiet: bool = False) -> None:
        # The workload's rate (``Problem.rate``), or its FLOPs for TFLOPS.
        self.rate = rate if isinstance(rate, Rate) else Rate.tflops(rate)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.quiet = quiet
        self._last = 0.0
        self._last_best: float | None = None

    def line(self, t: Tally) -> str:
        total = f"/{t.planned}" if t.planned is not None else ""
        parts = [f"trial {t.finished}{total}"]
        if t.deadline is not None:
            parts.append(f"{max(0.0, t.deadline - time.monotonic()):.0f}s left")
        done = t.finished
        parts.append(f"valid {t.valid}/{done} ({100 * t.valid / done:.0f}%)" if done
                     else "valid -")
        if t.best_us is not None:
            parts.append(f"best {t.best_us:.1f} us {self.rate(t.best_us):.1f} {self.rate.unit}")
            flash = t.baseline.get("flash")
            if flash:
                parts.append(f"{flash / t.best_us:.2f}x flash")
        rate = t.evals_per_minute()
        if rate is not None:
            parts.append(f"{rate:.0f} evals/min")
        if len(t.per_gpu) > 1:
            parts.append(" ".join(f"gpu{d} {n}" for d, n in t.per_gpu.items()))
        if t.faults:
            parts.append(f"{t.faults} faults")
        parts.append(f"compiling {t.compiling}")
        return "  ".join(parts)

    def update(self, t: Tally, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        improved = t.best_us is not None and t.best_us != self._last_best
        if self.tty:
            print("\r\x1b[2K" + self.line(t), end="", file=self.stream, flush=True)
        elif force or improved or now - self._last >= self.every_s:
            print(self.line(t), file=self.stream, flush=True)
            self._last = now
        self._last_best = t.best_us

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=self.stream, flush=True)


def elite_table(rows: list[dict[str, Any]]) -> str:
    """Rank, time, TFLOPS, ratios to SDPA and parameters of the elites."""
    if not rows:
        return "no valid kernel yet"
    head = (f"{'rank':>4} {'us':>9} {'TFLOPS':>7} {'x flash':>8} {'x cudnn':>8}  "
            "family  parameters")
    lines = [head]
    for i, r in enumerate(rows, start=1):
        def ratio(key: str, r: dict[str, Any] = r) -> str:
            base = r.get(key)
            return f"{base / r['ours_us']:8.2f}" if base else f"{'-':>8}"
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"{i:4d} {r['ours_us']:9.1f} {r['tflops']:7.1f} {ratio('sdpa_flash_us')} "
                     f"{ratio('sdpa_cudnn_us')}  {r['family']:6}  {params}")
    return "\n".join(lines)
