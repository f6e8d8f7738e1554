"""The attention backward pass: dQ, dK, dV from a compiled backward candidate (``mma_bwd`` on
mma.sync, sm_80+; ``wgmma_bwd`` on wgmma, sm_90a).

The launcher is ``evoengine.launch.CudaBackward`` (its docstring holds the three kernels' ABI), so
that exported modules carry the same code; ``BackwardKernel`` builds one from a candidate.
"""

from __future__ import annotations

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.launch import BACKWARD_ENTRIES, CudaBackward
from evoengine.render import Candidate
from evoengine.runtime import compiled_cubin

__all__ = ["BACKWARD_ENTRIES", "BACKWARD_FAMILIES", "BackwardKernel"]

BACKWARD_FAMILIES = ("mma_bwd", "wgmma_bwd")


class BackwardKernel(CudaBackward):
    """One compiled backward candidate:
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)`` (``CudaBackward``)."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        if candidate.family not in BACKWARD_FAMILIES:
            raise ValueError(f"{candidate.identity} is not a backward family "
                             f"({', '.join(BACKWARD_FAMILIES)})")
        cubin = compiled_cubin(candidate, compiled)
        loader = str(candidate.params.get("LOADER", "cp_async"))  # mma_bwd has no producer
        super().__init__(
            candidate.identity, head_dim=int(candidate.problem["HEAD_DIM"]),  # type: ignore[call-overload]
            dtype=str(candidate.problem["DTYPE"]), causal=bool(candidate.problem["CAUSAL"]),
            block_m=candidate.block_m, block_n=int(candidate.params["BLOCK_N"]),  # type: ignore[call-overload]
            threads=candidate.threads, smem_bytes=candidate.smem_bytes,
            dq_accum=str(candidate.params["DQ_ACCUM"]), arch=compiled.arch,
            cubin=cubin, loader=loader,
            swizzle=int(candidate.params["SWIZZLE"]) if loader == "tma" else None)  # type: ignore[call-overload]
        self.candidate = candidate
        self.compiled = compiled

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> BackwardKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"BackwardKernel({self.candidate.identity!r})"
