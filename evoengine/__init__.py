"""evoengine: search for the fastest correct attention kernel for a GPU and a workload.

The pipeline, one module each: ``space`` (what may be tried) -> ``render`` (CUDA source) ->
``compile`` (NVRTC cubins, offline) -> ``runtime`` (load and launch on torch tensors) ->
``validate`` (the one correctness criterion) -> ``measure`` (GPU timing) -> ``store``
(runs, candidates, measurements, elites).
"""

from __future__ import annotations

__version__ = "0.1.0"

from evoengine.arch import ARCHS, Arch, get_arch
from evoengine.compile import CompileResult, compile_candidate, compile_many
from evoengine.render import Candidate, make_candidate
from evoengine.space import SearchSpace, default_spaces
from evoengine.workload import Workload

__all__ = [
    "ARCHS", "Arch", "Candidate", "CompileResult", "SearchSpace", "Workload",
    "compile_candidate", "compile_many", "default_spaces", "get_arch", "make_candidate",
    "__version__",
]
