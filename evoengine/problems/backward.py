"""The backward pass: dQ, dK, dV from q, k, v, the forward's out and log-sum-exp, and dO.

Its workload is the forward's geometry (Q [B, H, Sq, D], K and V [B, KV, Sk, D], causal
bottom-right, fp16 or bf16) under kind ``bwd``: keys read ``bwd-b8-h16-...``. Backward FLOPs
are 2.5x the forward's (five GEMMs of the forward's two's size: S, dP, dV, dK, dQ), halved for
causal, as FlashAttention counts them. The criterion is ``validate.check_backward_workload``;
kernels are ``evoengine.backward.BackwardKernel``; the anchors are SDPA's flash and cuDNN
backward, timed as ``torch.autograd.grad`` of an output whose forward graph is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from evoengine.problems.base import Problem
from evoengine.problems.forward import Forward
from evoengine.workload import Workload

if TYPE_CHECKING:
    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict

PREFIX = "bwd-"


@dataclass(frozen=True)
class BackwardWorkload(Workload):
    """The forward's geometry, for the backward pass."""

    kind: ClassVar[str] = "bwd"

    @classmethod
    def of(cls, forward: Workload) -> BackwardWorkload:
        return cls.from_dict(forward.to_dict())  # type: ignore[return-value]

    @classmethod
    def from_key(cls, key: str) -> BackwardWorkload:
        if not key.startswith(PREFIX):
            raise ValueError(f"not a backward workload key: {key!r} (expected "
                             f"{PREFIX}b1-h8-kv8-sq512-sk512-d64-full-fp16)")
        return cls.of(Workload.from_key(key[len(PREFIX):]))

    def key(self) -> str:
        return PREFIX + super().key()

    def flops(self) -> float:
        """Matrix FLOPs of the backward pass: 2.5x the forward's, halved by causal masking."""
        return 2.5 * super().flops()


class Backward(Forward):
    """The backward problem; it names workloads with the forward's flags."""

    kind = "bwd"
    summary = "attention backward: dq, dk, dv from q, k, v, out, log-sum-exp and dout"
    anchors = ("flash", "cudnn", "fa4")  # SDPA's backward by backend; FA4's where it imports

    def method(self) -> str:
        from evoengine import measure

        return (f"{measure.TIMING}, no graph replay, {measure.INPUTS}; ours: the pre, main and "
                "post kernels per call; elites re-timed interleaved with SDPA's flash and cuDNN "
                "backward and FlashAttention-4's where it imports (torch.autograd.grad of the "
                "output, the forward's graph kept), median of the rounds' medians")

    def workload_from_dict(self, data: Mapping[str, Any]) -> BackwardWorkload:
        return BackwardWorkload.from_dict(dict(data))  # type: ignore[return-value]

    def workload_from_key(self, key: str) -> BackwardWorkload:
        return BackwardWorkload.from_key(key)

    def workload_from_arguments(self, args: argparse.Namespace) -> BackwardWorkload:
        return BackwardWorkload.of(super().workload_from_arguments(args))

    def tune_workloads(self, geometry: ModelGeometry) -> list[Workload]:
        """The prefill ladder alone: a training step's calls come batched (no latency
        calls, which are the forward's)."""
        return Problem.tune_workloads(self, geometry)

    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        import torch

        from evoengine.backward import BackwardKernel

        kernel = BackwardKernel(candidate, compiled)
        kernel.load(torch.cuda.current_device())  # a bad cubin fails here
        return kernel

    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        from evoengine import validate

        return validate.check_backward_workload(kernel, workload, device=device)

    def graph_for(self, workload: Any) -> bool:
        # Eager for every contender: SDPA's backward runs through autograd, which a CUDA graph
        # capture of one call does not take reliably; backward workloads are large.
        return False

    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        """Sets of (q, k, v, out, lse, dout, dq, dk, dv): out (in the dtype) and lse (float32)
        of the forward, computed by chunks of heads; enough sets to rotate past L2."""
        import torch

        from evoengine import measure
        from evoengine.launch import KERNEL_DTYPES

        w = workload
        dtype = KERNEL_DTYPES[w.dtype]
        per_set = 2 * w.batch * w.head_dim * (3 * w.heads * w.seq_q + 4 * w.kv_heads * w.seq_k)
        scale = 1.0 / math.sqrt(w.head_dim)
        sets = []
        for _ in range(measure.copies_needed(per_set)):
            q = torch.randn(w.batch, w.heads, w.seq_q, w.head_dim, device=device, dtype=dtype)
            k = torch.randn(w.batch, w.kv_heads, w.seq_k, w.head_dim, device=device,
                            dtype=dtype)
            v, dout = torch.randn_like(k), torch.randn_like(q)
            out, lse = _forward(q, k, v, w.causal, scale)
            sets.append((q, k, v, out, lse, dout, torch.empty_like(q), torch.empty_like(k),
                         torch.empty_like(v)))
        return sets

    def timed_call(self, kernel: Any, workload: Any, sets: Sequence[tuple[Any, ...]]) -> Any:
        causal = workload.causal

        def call(i: int) -> None:
            q, k, v, out, lse, dout, dq, dk, dv = sets[i]
            kernel(q, k, v, out, lse, dout, causal=causal, dq=dq, dk=dk, dv=dv)
        return call

    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        """SDPA's backward under ``anchor``'s backend: ``torch.autograd.grad`` of each set's
        output with the forward's graph kept, so only the backward is timed."""
        import torch

        from evoengine import measure

        if anchor == "fa4":
            fn = measure.fa4_attention()
            if fn is None:
                return None
            forward = lambda q, k, v: measure.fa4_output(  # noqa: E731
                fn(*(x.transpose(1, 2) for x in (q, k, v)), causal=workload.causal)
            ).transpose(1, 2)
            context: Any = contextlib.nullcontext()
        elif workload.causal and workload.seq_q != workload.seq_k:
            return None  # SDPA's is_causal aligns top-left; ours is bottom-right
        else:
            gqa = workload.kv_heads != workload.heads
            forward = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q, k, v, is_causal=workload.causal, enable_gqa=gqa)
            context = measure.sdpa_backend(anchor)
        timing["graph"] = False
        try:
            with context:
                graphs = []
                for q, k, v, _out, _lse, dout, *_ in sets:
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    out = forward(*leaves)
                    graphs.append((out, leaves, dout))

                def call(i: int) -> None:
                    out, leaves, dout = graphs[i]
                    torch.autograd.grad(out, leaves, dout, retain_graph=True)
                return measure.time_calls(call, len(sets), **timing)
        except (RuntimeError, ValueError, TypeError, AssertionError):
            return None


def _forward(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    """The forward's output (q's dtype) and natural-log log-sum-exp (float32 [B, H, Sq]; -inf
    and a zero output on rows that see no key), causal bottom-right, one query head at a time
    so the scores of long sequences never sit in memory at once."""
    import torch

    b, h, sq, _ = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    mask = None
    if causal:
        from evoengine.validate import causal_mask

        mask = causal_mask(sq, k.shape[2], q.device)
    for head in range(h):
        s = torch.matmul(q[:, head].float(), k[:, head // group].float().transpose(-1, -2))
        s *= scale
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        lse[:, head] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)
        out[:, head] = torch.matmul(p, v[:, head // group].float()).to(q.dtype)
    return out, lse
