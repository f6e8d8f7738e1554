"""The backward of ragged batches: dQ, dK, dV of a varlen forward (``varlen.py``).

Its workload is the varlen forward's (packed q, k, v with cu_seqlens; per-sequence lengths,
heads, head dim, causal bottom-right per sequence, GQA) under kind ``varlen_bwd``: keys read
``varlen_bwd-r16x128x4096s0-...``. FLOPs are 2.5x the forward's useful ones (five GEMMs of
the forward's two's size), as the dense backward counts them (``backward.py``).

Kernels are the backward families compiled with ``VARLEN`` (a space's ``kinds = ["bwd",
"varlen_bwd"]``, ``[kind_problem.varlen_bwd]``), launched by
``evoengine.launch.CudaVarlenBackward``. The criterion is ``validate.check_varlen_backward``
on every check of ``validate.varlen_plan``; the anchors are SDPA's cuDNN and flash backward
on the batch padded to its longest sequence, and FlashAttention-4's varlen backward where it
imports, each timed as ``torch.autograd.grad`` of an output whose forward graph is kept.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from evoengine.problems.base import TimedCall
from evoengine.problems.varlen import (
    Varlen,
    VarlenWorkload,
    fa4_varlen,
    padded,
    padded_inputs,
)

if TYPE_CHECKING:
    import argparse

    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict


class VarlenBackwardWorkload(VarlenWorkload):
    """A ragged batch, for the backward pass."""

    kind: ClassVar[str] = "varlen_bwd"

    def flops(self) -> float:
        """Matrix FLOPs of the backward: 2.5x the forward's, over the unmasked pairs."""
        return 2.5 * super().flops()


class VarlenBackward(Varlen):
    """The ragged backward; it names workloads with the varlen forward's flags."""

    kind = "varlen_bwd"
    summary = ("ragged backward: dq, dk, dv of a varlen forward (packed, cu_seqlens), as "
               "flash_attn_varlen_func's backward")

    def method(self) -> str:
        from evoengine import measure

        return (f"{measure.TIMING}, no graph replay, {measure.INPUTS}; ours: the pre, main and "
                "post kernels per call on packed [total, H, D] inputs with cu_seqlens; next to "
                "SDPA cuDNN and flash backward on the batch padded to its longest sequence and "
                "FlashAttention-4's varlen backward where it imports (torch.autograd.grad of "
                "the output, the forward's graph kept), interleaved in one process")

    def workload_from_dict(self, data: Mapping[str, Any]) -> VarlenBackwardWorkload:
        return VarlenBackwardWorkload.from_dict(data)  # type: ignore[return-value]

    def workload_from_key(self, key: str) -> VarlenBackwardWorkload:
        return VarlenBackwardWorkload.from_key(key)  # type: ignore[return-value]

    def workload_from_arguments(self, args: argparse.Namespace) -> VarlenBackwardWorkload:
        return VarlenBackwardWorkload.of(super().workload_from_arguments(args))  # type: ignore[return-value]

    def tune_workloads(self, geometry: ModelGeometry) -> list[VarlenBackwardWorkload]:
        """The varlen forward's ragged prefills, for their backward."""
        return [VarlenBackwardWorkload.of(w)  # type: ignore[misc]
                for w in super().tune_workloads(geometry)]

    # ---- on the GPU ----------------------------------------------------------------------

    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        import torch

        from evoengine.backward import VarlenBackwardKernel

        kernel = VarlenBackwardKernel(candidate, compiled)
        kernel.load(torch.cuda.current_device())  # a bad cubin fails here
        return kernel

    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        from evoengine import validate

        return validate.check_varlen_backward_workload(kernel, workload, device=device)

    def graph_for(self, workload: Any) -> bool:
        return False  # as the dense backward's: SDPA's backward runs through autograd

    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        """Sets of (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, dout, dq, dk, dv), packed
        and contiguous: out and lse (float32 [H, total_q]) of the forward, sequence by
        sequence; enough sets to rotate past L2."""
        import torch

        from evoengine import measure
        from evoengine.launch import KERNEL_DTYPES
        from evoengine.problems.backward import _forward

        w = workload
        dtype = KERNEL_DTYPES[w.dtype]
        cq, ck = w.cu_seqlens()
        per_set = 2 * w.head_dim * (4 * w.heads * w.total_q + 4 * w.kv_heads * w.total_k)
        scale = 1.0 / math.sqrt(w.head_dim)
        sets = []
        for _ in range(measure.copies_needed(per_set)):
            q = torch.randn(w.total_q, w.heads, w.head_dim, device=device, dtype=dtype)
            k = torch.randn(w.total_k, w.kv_heads, w.head_dim, device=device, dtype=dtype)
            v, dout = torch.randn_like(k), torch.randn_like(q)
            out = torch.zeros_like(q)
            lse = torch.full((w.heads, w.total_q), -math.inf, device=device,
                             dtype=torch.float32)
            for b, (lq, lk) in enumerate(w.seqlens):
                if lq and lk:
                    rows_q, rows_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
                    o, s = _forward(*(x[r].transpose(0, 1).unsqueeze(0) for x, r in
                                      ((q, rows_q), (k, rows_k), (v, rows_k))),
                                    w.causal, scale)
                    out[rows_q] = o[0].transpose(0, 1)
                    lse[:, rows_q] = s[0]
            cu_q = torch.tensor(cq, dtype=torch.int32, device=device)
            cu_k = torch.tensor(ck, dtype=torch.int32, device=device)
            sets.append((q, k, v, cu_q, cu_k, out, lse, dout, torch.empty_like(q),
                         torch.empty_like(k), torch.empty_like(v)))
        return sets

    def timed_call(self, kernel: Any, workload: Any,
                   sets: Sequence[tuple[Any, ...]]) -> TimedCall:
        scale = 1.0 / math.sqrt(workload.head_dim)
        max_q, max_k = workload.max_seqlen_q, workload.max_seqlen_k

        def call(i: int) -> None:
            q, k, v, cu_q, cu_k, out, lse, dout, dq, dk, dv = sets[i]
            kernel.launch(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, dq, dk, dv,
                          scale=scale, deterministic=False)
        return call

    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        """``torch.autograd.grad`` of each set's output under ``anchor``, the forward's graph
        kept, so that only the backward is timed: SDPA's backend on the padded batch, or
        FA4's ``flash_attn_varlen_func`` on the packed one."""
        import torch

        from evoengine import measure

        w = workload
        if anchor == "fa4":
            fn = fa4_varlen()
            if fn is None:
                return None

            def fa4(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> Any:
                return measure.fa4_output(fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                             max_seqlen_q=w.max_seqlen_q,
                                             max_seqlen_k=w.max_seqlen_k, causal=w.causal))
            forwards: list[tuple[Callable[..., Any], tuple[Any, ...], Any]] = [
                (fa4, s[:5], s[7]) for s in sets]
            context: Any = contextlib.nullcontext()
        else:
            gqa = w.kv_heads != w.heads
            forwards = []
            cq = w.cu_seqlens()[0]
            for s in sets:
                qp, kp, vp, mask = padded_inputs(w, s)
                dout = padded(s[7], cq, w.max_seqlen_q)  # dO padded like q

                def sdpa(q: Any, k: Any, v: Any, mask: Any = mask) -> Any:
                    if mask is None:
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=w.causal, enable_gqa=gqa)
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, enable_gqa=gqa)
                forwards.append((sdpa, (qp, kp, vp), dout))
            context = measure.sdpa_backend(anchor.removesuffix("_padded"))
        timing["graph"] = False
        try:
            with context:
                graphs = []
                for forward, args, dout in forwards:
                    leaves = [x.detach().requires_grad_() for x in args[:3]]
                    graphs.append((forward(*leaves, *args[3:]), leaves, dout))

                def call(i: int) -> None:
                    out, leaves, dout = graphs[i]
                    torch.autograd.grad(out, leaves, dout, retain_graph=True)
                call(0)
                return measure.time_calls(call, len(graphs), **timing)
        except (RuntimeError, ValueError, TypeError, AssertionError):
            return None
