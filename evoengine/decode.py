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
        cubin = compiled_cubin(candidate, compiled)
        params = candidate.params
        super().__init__(
            candidate.identity, head_dim=int(candidate.problem["HEAD_DIM"]),  # type: ignore[call-overload]
            dtype=str(candidate.problem["DTYPE"]), paged=bool(candidate.problem["PAGED"]),
            block_m=candidate.block_m, block_n=int(params["BLOCK_N"]),  # type: ignore[call-overload]
            threads=candidate.threads, smem_bytes=candidate.smem_bytes,
            split_policy=str(params["SPLIT_POLICY"]), splits=int(params["SPLITS"]),  # type: ignore[call-overload]
            combine=str(params["COMBINE"]), cluster=int(params.get("CLUSTER", 1)),  # type: ignore[call-overload]
            combine_launch=str(params.get("COMBINE_LAUNCH", "stream")),
            arch=compiled.arch, cubin=cubin)
        self.candidate = candidate
        self.compiled = compiled

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> DecodeKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"DecodeKernel({self.candidate.identity!r})"
