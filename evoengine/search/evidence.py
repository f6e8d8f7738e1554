"""The search's evidence: what it writes to the store as it goes, and its results document.

The store is the search's state. ``Evidence`` writes each compile report and measurement of
one run as it happens, so an interrupted search loses at most the points still compiling,
and rewrites the elites (the store's ranking, top ``elites`` per arch and workload) only
when a time can change them. ``results_document`` is a finished run as the JSON kept under
``benchmarks/results/``: device, driver, commit, date, method, the tally and the rows.

Contract. ``Evidence`` adds candidates, compile reports and measurements of its own run and
rewrites the elites of its own (arch, workload); it never changes or deletes a measurement,
and never mutates the candidates, compile results or evaluations it is given.
``measurement`` raises the store's ``ClaimLost`` when this worker's claim on the point was
released meanwhile (its trial was failed as stale, and another worker may have the point);
nothing is written then. Other store errors propagate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from evoengine._version import __version__
from evoengine.compile import CompileResult, nvrtc_version
from evoengine.problems import problem_of
from evoengine.provenance import git_commit, header
from evoengine.render import Candidate, render
from evoengine.search.domain import Domain
from evoengine.search.evaluator import DeviceInfo, Evaluation
from evoengine.search.progress import Tally
from evoengine.store import Store
from evoengine.workload import Workload


class Evidence:
    """What run ``run_id`` of ``domain``'s (arch, workload) writes to ``store``."""

    def __init__(self, store: Store, domain: Domain, run_id: int, *, elites: int) -> None:
        self.store = store
        self.domain = domain
        self.run_id = run_id
        self.elites = elites
        self.arch = domain.arch.name
        self.key = domain.workload.key()
        self._elite_bar = math.inf  # a valid time must beat this to enter the elites

    @classmethod
    def start(cls, store: Store, domain: Domain, device: DeviceInfo, study: str, *,
              elites: int) -> Evidence:
        """Record a new run (device, versions, commit, study) and write its evidence."""
        w = domain.workload
        run_id = store.start_run(arch=domain.arch.name, workload=w.to_dict(),
                                 workload_key=w.key(), device=device.name,
                                 versions=versions(device), commit=git_commit(), study=study)
        return cls(store, domain, run_id, elites=elites)

    def ranked(self, limit: int | None = None) -> list[tuple[str, float]]:
        """``(identity, median_us)`` of every point measured valid by any run, fastest first."""
        return self.store.ranked(arch=self.arch, workload_key=self.key, limit=limit)

    # ---- as the search goes -------------------------------------------------------------

    def compiled(self, candidate: Candidate, result: CompileResult) -> None:
        """The candidate (with its source, where the domain renders) and its compile report."""
        c = candidate
        self.store.add_candidate(identity=c.identity, family=c.family,
                                 template_hash=c.template_hash, params=c.params,
                                 problem=c.problem,
                                 source=render(c) if self.domain.renders else "")
        self.store.set_compile_report(c.identity, arch=self.arch, ok=result.ok,
                                      registers=result.registers, spill_bytes=result.spill_bytes,
                                      smem_bytes=result.smem_bytes,
                                      compile_seconds=result.seconds, error=result.error,
                                      compiler=nvrtc_version())

    def measurement(self, candidate: Candidate, e: Evaluation, *, trial: int, trial_id: int,
                    device: int | None = None) -> None:
        """A search-phase measurement of trial number ``trial`` (storage id ``trial_id``),
        settling its claim; ``ClaimLost`` if the claim was released meanwhile."""
        tflops = self.domain.workload.flops() / e.median_us / 1e6 if e.ok and e.median_us else None
        extra = {"phase": "search", "trial": trial, "reps": e.reps, "graph": e.graph,
                 "seconds": round(e.seconds, 3), "fault": e.fault}
        if device is not None:
            extra["gpu"] = device
        self.store.add_measurement(
            self.run_id, candidate.identity, ok=e.ok, reason=e.reason, median_us=e.median_us,
            spread_us=e.spread_us, max_err=e.max_err, tolerance=e.tolerance, tflops=tflops,
            extra=extra, trial_id=trial_id)

    def valid_time(self, median_us: float) -> None:
        """A valid time was just measured: rewrite the elites if it can change them. The bar
        only ever falls (a candidate's best time only falls), and other workers' times lower
        it at the next ``read_elite_bar``: until then it is too high, which costs a needless
        rewrite, never a missed one."""
        if median_us <= self._elite_bar:
            self._set_elite_bar(self.store.update_elites(
                arch=self.arch, workload_key=self.key, limit=self.elites, run_id=self.run_id))

    def read_elite_bar(self) -> None:
        """Read the elites' slowest time back (other workers' times lower it)."""
        self._set_elite_bar(self.ranked(limit=self.elites))

    def _set_elite_bar(self, top: list[tuple[str, float]]) -> None:
        self._elite_bar = top[-1][1] if len(top) >= self.elites else math.inf

    # ---- at the end ---------------------------------------------------------------------

    def settle_elites(self) -> None:
        """Rewrite the elites from the ranking (the loop rewrote them only on changes)."""
        self.store.update_elites(arch=self.arch, workload_key=self.key, limit=self.elites,
                                 run_id=self.run_id)

    def final(self, entries: Sequence[tuple[Candidate, CompileResult]],
              timed: dict[str, Any]) -> list[dict[str, Any]]:
        """The final re-time (``Evaluator.final``'s answer for ``entries``): each time as a
        ``final``-phase measurement, the elites set to the times, and the rows, fastest
        first."""
        rows = []
        w = self.domain.workload
        for (candidate, _), t in zip(entries, timed["candidates"], strict=True):
            if "median_us" not in t:
                continue
            r = row(w, candidate, t["median_us"], timed)
            r["spread_us"] = t["spread_us"]
            rows.append(r)
            self.store.add_measurement(self.run_id, candidate.identity, ok=True,
                                       median_us=t["median_us"], spread_us=t["spread_us"],
                                       tflops=w.flops() / t["median_us"] / 1e6,
                                       extra={"phase": "final", "rounds": t.get("rounds"),
                                              **anchor_times(timed)})
        rows.sort(key=lambda r: r["ours_us"])
        if rows:
            self.store.set_elites(arch=self.arch, workload_key=self.key,
                                  entries=[(r["identity"], r["ours_us"]) for r in rows],
                                  run_id=self.run_id)
        return rows

    def rows_from_store(self, baseline: dict[str, float | None]) -> list[dict[str, Any]]:
        """The rows of the fastest points in the store (when there was no final re-time)."""
        rows = []
        for identity, us in self.ranked(limit=self.elites):
            point = self.domain.point(identity)
            if point is not None:
                rows.append(row(self.domain.workload, self.domain.candidate(*point), us,
                                baseline))
        return rows


# The results-row key of each anchor's time (the anchors are the problem's: evoengine.problems).
ANCHOR_KEYS = {"flash": "sdpa_flash_us", "cudnn": "sdpa_cudnn_us", "fa4": "fa4_us",
               # varlen: SDPA on the batch padded to its longest sequence
               "cudnn_padded": "sdpa_cudnn_padded_us", "flash_padded": "sdpa_flash_padded_us",
               "flashinfer": "flashinfer_us"}  # decode, where its wheel imports
ALWAYS_ANCHORS = ("flash", "cudnn")  # in every forward or backward row, None where not run


def anchor_times(timed: Mapping[str, Any]) -> dict[str, float | None]:
    """The anchors' times of a re-time or baseline as row keys: SDPA's two always (None where
    one could not run), the others (FlashAttention-4's, varlen's padded SDPA) where timed."""
    return {key: timed.get(anchor) for anchor, key in ANCHOR_KEYS.items()
            if anchor in ALWAYS_ANCHORS or anchor in timed}


def row(w: Workload, candidate: Candidate, us: float,
        anchors: Mapping[str, Any]) -> dict[str, Any]:
    """One result row: the point, its time and TFLOPS, and the anchors' times beside it."""
    return {
        "kind": w.kind, "direction": "bwd" if w.kind in ("bwd", "varlen_bwd") else "fwd",
        "family": candidate.family, "shape": [w.batch, w.heads, w.seq_q, w.head_dim],
        "kv_heads": w.kv_heads, "seq_k": w.seq_k, "causal": w.causal, "dtype": w.dtype,
        "ours_us": us, **anchor_times(anchors),
        "tflops": w.flops() / us / 1e6, "params": candidate.params,
        "identity": candidate.identity,
    }


def versions(info: DeviceInfo) -> dict[str, str]:
    return {"evoengine": __version__, "compiler": nvrtc_version(), "driver": info.driver,
            **info.versions}


def results_document(*, device: DeviceInfo, workload: Workload, study: str, run_id: int,
                     tally: Tally, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run as the results JSON of ``benchmarks/results/``: the one header, then the run."""
    return header(device=device.name, driver=device.driver,
                  torch=device.versions.get("torch"), method=problem_of(workload).method(),
                  study=study, run_id=run_id, search=tally_dict(tally), rows=rows)


def tally_dict(t: Tally) -> dict[str, Any]:
    return {
        "evaluated": t.evaluated, "valid": t.valid, "compile_failed": t.compile_failed,
        "faults": t.faults, "answered_from_store": t.answered_from_store,
        "rejected": t.rejected, "cached_compiles": t.cached_compiles,
        "cold_compiles": t.cold_compiles, "evals_per_minute": t.evals_per_minute(),
        "gpu_waited_on_compiler_s": round(t.gpu_idle_s, 2),
        "claimed_elsewhere": t.claimed_elsewhere, "claims_released": t.released,
        "claims_lost": t.claims_lost, "seeds": t.seeds,
        "seeds_from_priors": t.seeds_from_priors, "gpus": _per_gpu(t),
        "wall_s": round(time.monotonic() - t.started, 2),
        "sdpa_flash_us": t.baseline.get("flash"), "sdpa_cudnn_us": t.baseline.get("cudnn"),
    }


def _per_gpu(t: Tally) -> dict[str, dict[str, float | int | None]]:
    """Evaluations and evaluations per minute of each GPU, over the same window as the
    overall rate (first evaluation to the end of the search loop)."""
    return {str(d): {"evaluated": n, "evals_per_minute": t.evals_per_minute(n)}
            for d, n in t.per_gpu.items()}
