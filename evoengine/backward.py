"""The attention backward pass: dQ, dK, dV from a compiled backward candidate (``mma_bwd`` on
mma.sync, sm_80+; ``wgmma_bwd`` on wgmma, sm_90a).

The launchers are ``evoengine.launch.CudaBackward`` (its docstring holds the three kernels' ABI)
and, for ragged batches, ``CudaVarlenBackward``, so that exported modules carry the same code;
``BackwardKernel`` and ``VarlenBackwardKernel`` build one from a candidate.
"""

from __future__ import annotations

from evoengine.launch import BACKWARD_ENTRIES, CudaBackward, CudaVarlenBackward
from evoengine.render import Candidate
from evoengine.runtime import FromCandidate

__all__ = ["BACKWARD_ENTRIES", "BACKWARD_FAMILIES", "BackwardKernel", "VarlenBackwardKernel"]

BACKWARD_FAMILIES = ("mma_bwd", "wgmma_bwd")


class BackwardKernel(FromCandidate, CudaBackward):
    """One compiled backward candidate:
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)`` (``CudaBackward``)."""

    @classmethod
    def refusal(cls, candidate: Candidate) -> str | None:
        return (None if candidate.family in BACKWARD_FAMILIES
                else f"is not a backward family ({', '.join(BACKWARD_FAMILIES)})")


class VarlenBackwardKernel(FromCandidate, CudaVarlenBackward):
    """One backward candidate compiled with VARLEN: ``kernel(q, k, v, out, lse, dout,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=...) -> (dq, dk, dv)`` on
    packed tensors (``CudaVarlenBackward``)."""

    @classmethod
    def refusal(cls, candidate: Candidate) -> str | None:
        return (None if candidate.problem.get("VARLEN")
                else "is not compiled for ragged batches (VARLEN)")
