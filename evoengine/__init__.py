"""evoengine: search for the fastest correct attention kernel for a GPU and a workload.

The pipeline, one module each: ``space`` (what may be tried) -> ``render`` (CUDA source) ->
``compile`` (NVRTC cubins, offline) -> ``runtime`` (load and launch on torch tensors) ->
``validate`` (the one correctness criterion) -> ``measure`` (GPU timing) -> ``store``
(runs, candidates, measurements, elites) -> ``export`` (the winners as a standalone module;
``evoengine.load`` gives the same callable in-process).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from evoengine import paths
from evoengine._version import __version__
from evoengine.arch import ARCHS, Arch, get_arch
from evoengine.compile import CompileResult, compile_candidate, compile_many
from evoengine.render import Candidate, make_candidate
from evoengine.space import SearchSpace, default_spaces
from evoengine.workload import Workload

if TYPE_CHECKING:
    from evoengine.launch import TunedAttention

__all__ = [
    "ARCHS", "Arch", "Candidate", "CompileResult", "SearchSpace", "Workload",
    "compile_candidate", "compile_many", "default_spaces", "get_arch", "load", "make_candidate",
    "__version__",
]


def load(store: str | os.PathLike[str] | None = paths.DEFAULT_STORE,
         arch: Arch | str | None = None, study: str | None = None) -> TunedAttention:
    """The store's best kernels as ``attention(q, k, v, causal=False, scale=None)``, the same
    callable an exported module holds; ``arch`` defaults to the GPU present. ``store`` is
    named as every command names one (``evoengine.store.resolve_url``: a path to a SQLite
    file or any SQLAlchemy URL) and must exist: a missing one is a ``FileNotFoundError``."""
    from evoengine.export import load as load_from_store

    return load_from_store(store, arch, study)
