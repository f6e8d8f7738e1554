"""Decode over a KV cache from a compiled ``decode`` candidate (templates/decode, sm_80+).

The launcher is ``evoengine.launch.decode.CudaDecode`` (its module docstring holds the two
kernels' ABI and the layouts), so that exported modules carry the same code;
``DecodeKernel`` builds one from a candidate.
"""

from __future__ import annotations

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.launch.decode import CudaDecode
from evoengine.render import Candidate
from evoengine.runtime import compiled_cubin

__all__ = ["DECODE_FAMILIES", "DecodeKernel"]

DECODE_FAMILIES = ("decode",)


class DecodeKernel(CudaDecode):
    """One compiled decode candidate:
    ``kernel(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True) -> out``."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        if candidate.family not in DECODE_FAMILIES:
            raise ValueError(f"{candidate.identity} is not a decode family "
                             f"({', '.join(DECODE_FAMILIES)})")
        super().__init__(candidate.identity, arch=compiled.arch,
                         cubin=compiled_cubin(candidate, compiled),
                         **self.spec_args(candidate.spec()))
        self.candidate = candidate
        self.compiled = compiled

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> DecodeKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"DecodeKernel({self.candidate.identity!r})"
