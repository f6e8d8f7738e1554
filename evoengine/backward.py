"""The attention backward pass: dQ, dK, dV from a compiled backward candidate (``mma_bwd`` on
mma.sync, sm_80+; ``wgmma_bwd`` on wgmma, sm_90a).

The launchers are ``evoengine.launch.CudaBackward`` (its docstring holds the three kernels' ABI)
and, for ragged batches, ``CudaVarlenBackward``, so that exported modules carry the same code;
``BackwardKernel`` and ``VarlenBackwardKernel`` build one from a candidate.
"""

from __future__ import annotations

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.launch import BACKWARD_ENTRIES, CudaBackward, CudaVarlenBackward
from evoengine.render import Candidate
from evoengine.runtime import compiled_cubin

__all__ = ["BACKWARD_ENTRIES", "BACKWARD_FAMILIES", "BackwardKernel", "VarlenBackwardKernel"]

BACKWARD_FAMILIES = ("mma_bwd", "wgmma_bwd")


class BackwardKernel(CudaBackward):
    """One compiled backward candidate:
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)`` (``CudaBackward``)."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        if candidate.family not in BACKWARD_FAMILIES:
            raise ValueError(f"{candidate.identity} is not a backward family "
                             f"({', '.join(BACKWARD_FAMILIES)})")
        super().__init__(candidate.identity, arch=compiled.arch,
                         cubin=compiled_cubin(candidate, compiled),
                         **self.spec_args(candidate.spec()))
        self.candidate = candidate
        self.compiled = compiled

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> BackwardKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"BackwardKernel({self.candidate.identity!r})"


class VarlenBackwardKernel(CudaVarlenBackward):
    """One backward candidate compiled with VARLEN: ``kernel(q, k, v, out, lse, dout,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=...) -> (dq, dk, dv)`` on
    packed tensors (``CudaVarlenBackward``)."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        if not candidate.problem.get("VARLEN"):
            raise ValueError(f"{candidate.identity} is not compiled for ragged batches (VARLEN)")
        super().__init__(candidate.identity, arch=compiled.arch,
                         cubin=compiled_cubin(candidate, compiled),
                         **self.spec_args(candidate.spec()))
        self.candidate = candidate
        self.compiled = compiled

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> VarlenBackwardKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"VarlenBackwardKernel({self.candidate.identity!r})"
