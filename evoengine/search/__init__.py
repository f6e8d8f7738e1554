"""The search on a GPU: propose candidates (Optuna, with our evolutionary sampler by
default), compile them ahead in worker processes, validate and time them in an isolated GPU
worker, keep everything in the store, re-time the elites next to SDPA.

``search(SearchConfig(...))`` is the entry point; ``evoengine search`` is a thin layer on it.
One module per concept, each stating its contract:

- ``loop``: the schedule (propose, compile ahead, evaluate, record) and ``search`` itself;
- ``domain``: the admitted points of every family for one workload and target;
- ``seeds``: where a search starts (other workloads' elites, nearest first) and ``priors``:
  the target's shipped points that join them;
- ``samplers``: the strategies, as Optuna samplers;
- ``study``: the adapter to Optuna's study and trials (the only user of Optuna's private API);
- ``coordination``: claims, heartbeats and the view of other workers on the same store;
- ``evidence``: what the search writes to the store, and its results document;
- ``evaluator``: the ``Evaluator`` interface; ``worker``: the GPU worker process and its
  protocol (``GpuEvaluator``, ``GpuWorker``);
- ``progress``: the live status line; ``replay``: searching recorded sweeps without a GPU;
- ``cross``: the tune's cross re-time of each rung's entry over its dispatch cell.
"""

from __future__ import annotations

from evoengine.search.domain import Domain
from evoengine.search.evaluator import DeviceInfo, Evaluation, Evaluator, EvaluatorError
from evoengine.search.loop import SearchConfig, SearchError, SearchResult, default_study, search
from evoengine.search.progress import Progress, Tally, elite_table
from evoengine.search.samplers import STRATEGIES, EvoSampler, make_sampler
from evoengine.search.worker import GpuEvaluator, GpuWorker, WorkerEvaluator

__all__ = [
    "STRATEGIES", "DeviceInfo", "Domain", "Evaluation", "Evaluator", "EvaluatorError",
    "EvoSampler", "GpuEvaluator", "GpuWorker", "Progress", "SearchConfig", "SearchError",
    "SearchResult", "Tally", "WorkerEvaluator", "default_study", "elite_table", "make_sampler",
    "search",
]
