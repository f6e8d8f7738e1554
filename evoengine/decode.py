"""Decode over a KV cache from a compiled ``decode`` candidate (templates/decode, sm_80+).

The launcher is ``evoengine.launch.decode.CudaDecode`` (its module docstring holds the two
kernels' ABI and the layouts), so that exported modules carry the same code;
``DecodeKernel`` builds one from a candidate.
"""

from __future__ import annotations

from evoengine.launch.decode import CudaDecode
from evoengine.render import Candidate
from evoengine.runtime import FromCandidate

__all__ = ["DECODE_FAMILIES", "DecodeKernel"]

DECODE_FAMILIES = ("decode",)


class DecodeKernel(FromCandidate, CudaDecode):
    """One compiled decode candidate:
    ``kernel(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True) -> out``."""

    @classmethod
    def refusal(cls, candidate: Candidate) -> str | None:
        return (None if candidate.family in DECODE_FAMILIES
                else f"is not a decode family ({', '.join(DECODE_FAMILIES)})")
