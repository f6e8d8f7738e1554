"""The tuned attention function: ``TunedAttention`` over a dispatch table, and the
``torch.library`` custom ops (the forward and its autograd formula, the backward) that make it
traceable by ``torch.compile`` and differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from evoengine.launch.core import (
    DTYPE_NAMES,
    NoKernelError,
    Problem,
    check_aligned,
    check_fallback,
    check_flag,
    check_grid,
    check_inputs,
    check_out,
    rows_aligned,
    sdpa_attention,
    sdpa_attention_grads,
    softmax_scale,
)
from evoengine.launch.dispatch import KINDS, Entry, describe, dispatch_table, nearest
from evoengine.launch.explain import Explanation, explain_call
from evoengine.launch.forward import CudaKernel
from evoengine.launch.transformers import register_hf
from evoengine.launch.varlen import (
    CudaVarlenKernel,
    check_varlen_inputs,
    check_varlen_out,
    varlen_sdpa,
    with_sdpa_gradients,
)
from evoengine.launch.varlen_backward import with_kernel_gradients

# How many TorchDispatchModes are active (FakeTensorMode, FlopCounterMode, ...): calls under
# one go through the custom op, so that the mode sees it.
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_mode", lambda: 0)


def wants_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether autograd will want the gradients of a call on q, k, v."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


class TunedAttention:
    """``attention(q, k, v, causal=False, scale=None)`` over a table of tuned kernels.

    Picks the kernel tuned for the call's (dtype, head_dim, causal) at the nearest sequence
    lengths (``nearest``). Eager calls launch directly; under ``torch.compile``, a dispatch
    mode or autograd the call goes through the ``torch.library`` custom op
    ``<namespace>::attention``, which does the same thing and is differentiable: its
    autograd formula is the custom op ``<namespace>::attention_backward``, which launches
    the backward kernel tuned nearest the call (entries of kind ``bwd``).
    """

    supports_bshd = True  # writes straight into [B, S, H, D] storage (Transformers' layout)

    def __init__(self, kernels: list[Any], entries: Iterable[Entry], *,
                 namespace: str, provenance: Mapping[str, Any] | None = None) -> None:
        self.kernels = list(kernels)
        self.entries = tuple(entries)
        self._tables = {kind: dispatch_table(self.entries, kind) for kind in KINDS}
        self.table, self.backward_table = self._tables["fwd"], self._tables["bwd"]
        self.varlen_table = self._tables["varlen"]
        for e in self.entries:
            if e.kind not in KINDS:
                raise ValueError(f"dispatch entry {e.workload} is of kind {e.kind!r}; this "
                                 f"launcher knows {', '.join(KINDS)}")
            k = self.kernels[e.kernel]
            if k.kind != e.kind or (k.dtype, k.head_dim, k.causal) != e.key:
                raise ValueError(f"dispatch entry {e.workload} names kernel {k.name}, "
                                 f"which is compiled for another problem")
        self.provenance = dict(provenance or {})
        self._choices: dict[tuple, Any] = {}
        self._plans: dict[tuple, tuple[Problem, bool, float, Any]] = {}  # eager calls' checks
        self._refused: dict[tuple, str] = {}  # why a kernel would not load on a device
        self._op, self.namespace = _define_op(self, namespace)

    def __repr__(self) -> str:
        keys = ", ".join(describe(key) for key in self.table)
        backward = ", ".join(describe(key) for key in self.backward_table) or "none"
        return (f"<tuned attention {self.namespace}: {len(self.kernels)} kernels for {keys}; "
                f"backward for {backward}>")

    def select(self, dtype: str, head_dim: int, causal: bool, seq_q: int, seq_k: int,
               rows: int = 1, kind: str = "fwd") -> Entry | None:
        """The dispatch entry of ``kind`` for a call, or None where no kernel has its (dtype,
        head_dim, causal). Pure Python: no GPU needed."""
        group = self._tables[kind].get((dtype, head_dim, causal))
        return None if group is None else nearest(group, seq_q, seq_k, rows)

    def explain(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, *,
                kind: str = "fwd") -> Explanation:
        """Which entry of ``kind`` serves ``attention(q, k, v, causal=causal)``: the workload
        it was tuned at, the kernel's identity, tuned or derived, the measured time
        (``explain.Explanation``). Reads only shapes and dtype; runs nothing."""
        return explain_call(self, q, k, v, causal, kind)

    def _kernel_for(self, q: Tensor, p: Problem, causal: bool, kind: str = "fwd") -> Any:
        """The kernel of ``kind`` for a call, or None (no kernel for its key, or a GPU it
        cannot run on); memoised, since a model makes the same calls over and over."""
        index = q.get_device()
        key = (q.dtype, p.head_dim, causal, p.seq_q, p.seq_k, p.batch * p.heads, index, kind)
        try:
            return self._choices[key]
        except KeyError:
            pass
        dtype = DTYPE_NAMES.get(q.dtype)
        entry = None if dtype is None else self.select(dtype, *key[1:6], kind=kind)
        kernel = None
        if entry is not None:
            kernel = self.kernels[entry.kernel]
            try:
                kernel.load(index)  # once per device: a GPU it cannot run on says so here
            except NoKernelError as e:
                self._refused[(kind, *key[:3])] = str(e)
                kernel = None
        if len(self._choices) > 4096:  # lengths vary without bound; keep the cache small
            self._choices.clear()
        self._choices[key] = kernel
        return kernel

    def no_kernel(self, q: Tensor, head_dim: int, causal: bool, kind: str = "fwd") -> str:
        """Why a call has no kernel of ``kind``, in one line naming what this module has."""
        hint = " Pass fallback='sdpa' to run torch SDPA for such calls."
        refused = self._refused.get((kind, q.dtype, head_dim, causal))
        if refused is not None:
            return refused + "." + hint
        what = {"fwd": "kernel", "bwd": "backward kernel"}.get(kind, f"{kind} kernel")
        have = "; ".join(describe(key) for key in self._tables[kind]) or "none"
        return (f"no tuned {what} for {q.dtype} head_dim {head_dim} "
                f"{'causal' if causal else 'non-causal'}; this module has {what}s for: "
                f"{have}." + hint)

    def _plan(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None,
              fallback: str | None) -> tuple[Problem, bool, float, CudaKernel | None]:
        """A forward call's checked shapes, causal flag, scale and kernel (None: SDPA).

        Memoised by everything the checks read but the data pointers (shapes, strides,
        dtypes, devices, the flags and their types), whose alignment a kernel's call checks
        again each time: a model makes the same calls over and over, and the checks are most
        of an eager call's host time."""
        try:
            key: tuple | None = (
                q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                k.dtype, v.dtype, q.device, k.device, v.device, type(causal), causal,
                type(scale), scale, fallback)
            planned = self._plans.get(key)  # type: ignore[arg-type]
        except (AttributeError, TypeError):  # not tensors, an unhashable flag: checked below
            key, planned = None, None
        if planned is not None and (planned[3] is None
                                    or not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16):
            return planned
        planned = self._check_plan(q, k, v, causal, scale, fallback)
        if key is not None:
            if len(self._plans) > 1024:  # lengths vary without bound; keep the cache small
                self._plans.clear()
            self._plans[key] = planned
        return planned

    def _check_plan(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None,
                    fallback: str | None) -> tuple[Problem, bool, float, CudaKernel | None]:
        check_fallback(fallback)
        p = check_inputs(q, k, v, any_float=fallback is not None, aligned=fallback is None)
        check_grid(p)
        causal = check_flag("causal", causal)
        scale = softmax_scale(scale, p.head_dim)
        kernel = self._kernel_for(q, p, causal)
        if kernel is None and fallback is None:
            raise NoKernelError(self.no_kernel(q, p.head_dim, causal))
        if kernel is not None and fallback is not None:  # not checked above: SDPA might serve
            for name, t in (("q", q), ("k", k), ("v", v)):
                check_aligned(name, t)
        return p, causal, scale, kernel

    @staticmethod
    def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
              bshd: bool) -> Tensor:
        result = sdpa_attention(q, k, v, causal=causal, scale=scale)
        # The layout the custom op's fake promises (SDPA may return either).
        if bshd:
            return result.transpose(1, 2).contiguous().transpose(1, 2)
        return result.contiguous()

    @staticmethod
    def _output(q: Tensor, p: Problem, bshd: bool) -> Tensor:
        if bshd:  # [B, H, S, D] view of [B, S, H, D] storage: what Transformers wants
            return torch.empty((p.batch, p.seq_q, p.heads, p.head_dim), dtype=q.dtype,
                               device=q.device).transpose(1, 2)
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                scale: float | None = None, out: Tensor | None = None,
                lse: Tensor | None = None, fallback: str | None = None,
                bshd: bool = False) -> Tensor:
        """The eager call, with the criterion's ``out=``/``lse=`` buffers."""
        p, causal, scale, kernel = self._plan(q, k, v, causal, scale, fallback)
        if kernel is None:
            if lse is not None:
                raise ValueError("lse is not available from the SDPA fallback")
            if out is None:
                return self._sdpa(q, k, v, causal, scale, bshd)
            check_out(out, q, None, p)
            return out.copy_(sdpa_attention(q, k, v, causal=causal, scale=scale))
        if out is not None or lse is not None:  # an lse given alone is checked too
            check_out(out, q, lse, p)
        if out is None:
            out = self._output(q, p, bshd)
        kernel.launch(q, k, v, out, lse, p, scale)
        return out

    def forward_lse(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    scale: float | None = None, fallback: str | None = None,
                    bshd: bool = False) -> tuple[Tensor, Tensor]:
        """The output and the natural-log log-sum-exp (float32 [B, H, Sq]) that the backward
        kernels read; NaN where SDPA served the call (its backward then recomputes)."""
        p, causal, scale, kernel = self._plan(q, k, v, causal, scale, fallback)
        lse = torch.empty((p.batch, p.heads, p.seq_q), dtype=torch.float32, device=q.device)
        if kernel is None:
            return self._sdpa(q, k, v, causal, scale, bshd), lse.fill_(math.nan)
        out = self._output(q, p, bshd)
        kernel.launch(q, k, v, out, lse, p, scale)
        return out, lse

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dout: Tensor, *, causal: bool = False, scale: float | None = None,
                 fallback: str | None = None,
                 deterministic: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """dQ, dK, dV (shaped like q, k, v) of the call that ``forward_lse`` answered with
        ``out`` and ``lse``, for the output gradient ``dout``.

        The backward kernel tuned nearest the call; SDPA's backward where the forward was
        SDPA's or no backward kernel fits and ``fallback='sdpa'``; otherwise
        ``NoKernelError`` naming what is missing. ``deterministic`` defaults to
        ``torch.are_deterministic_algorithms_enabled()``.
        """
        check_fallback(fallback)
        p = check_inputs(q, k, v, any_float=fallback is not None, aligned=fallback is None)
        causal = check_flag("causal", causal)
        if lse.numel() == 0 and fallback is None:  # the op was called with with_lse=False
            raise ValueError("this call's forward kept no log-sum-exp: call the attention op "
                             "with with_lse=True where gradients are wanted")
        kernel = None
        if lse.numel() and self._kernel_for(q, p, causal) is not None:  # a kernel wrote lse
            kernel = self._kernel_for(q, p, causal, "bwd")
        if kernel is None:
            if fallback is None:
                raise NoKernelError(self.no_kernel(q, p.head_dim, causal, "bwd"))
            grads = sdpa_attention_grads(q, k, v, dout, causal=causal,
                                         scale=softmax_scale(scale, p.head_dim))
            # The layout the custom op's fake promises.
            return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous()
        if not rows_aligned(dout):  # autograd hands out what it has: expanded ones, views
            dout = dout.contiguous()
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        return kernel(q, k, v, out, lse, dout, causal=causal, scale=scale,
                      deterministic=deterministic)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                 scale: float | None = None, *, fallback: str | None = None,
                 bshd: bool = False) -> Tensor:
        """Attention of q [B, H, Sq, D] over k, v [B, H_kv, Sk, D]; returns [B, H, Sq, D].

        Any strides with a contiguous last dim; GQA; causal aligned bottom-right. ``bshd``
        returns the result as a view of [B, S, H, D] storage. ``fallback='sdpa'`` runs torch
        SDPA where no tuned kernel fits (instead of raising ``NoKernelError``), forward or
        backward. Differentiable in q, k and v.
        """
        compiling = torch.compiler.is_compiling()
        if not compiling and not (isinstance(q, Tensor) and isinstance(k, Tensor)
                                  and isinstance(v, Tensor)):
            return self.forward(q, k, v)  # raises the TypeError naming what was expected
        grad = wants_grad(q, k, v)
        # The custom op costs tens of microseconds per eager call in the dispatcher, so plain
        # tensors outside compile, dispatch modes and autograd skip it and run the same code.
        if (not compiling and not grad and type(q) is Tensor and type(k) is Tensor
                and type(v) is Tensor and not _dispatch_modes()):
            return self.forward(q, k, v, causal=causal, scale=scale, fallback=fallback,
                                bshd=bshd)
        if not compiling:  # the op's schema would refuse these in five lines of its own
            check_flag("causal", causal)
            softmax_scale(scale, 1)
        return self._op(q, k, v, causal, scale, fallback, bshd, grad)[0]

    def varlen(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               causal: bool = False, scale: float | None = None, *,
               fallback: str | None = None, check: bool = True, out: Tensor | None = None,
               lse: Tensor | None = None) -> Tensor:
        """Attention over a ragged batch, as FlashAttention's ``flash_attn_varlen_func``: q
        [total_q, H, D], k and v [total_k, H_kv, D] packed (any strides, contiguous last dim),
        int32 ``cu_seqlens_*`` [batch + 1] where each sequence's rows start, causal per
        sequence aligned bottom-right; returns [total_q, H, D] (an empty-key sequence's rows
        0). ``lse`` (float32 [H, total_q]) receives the log-sum-exp.

        The varlen kernel tuned nearest (max_seqlen_q, max_seqlen_k) for the call's (dtype,
        head_dim, causal); ``fallback='sdpa'`` runs SDPA per sequence where none fits. Inputs
        are checked before any launch, one-line ``ValueError``s; ``check`` includes what
        cu_seqlens hold, read back to the host (one sync per call): ``check=False`` skips it.
        Eager only (no torch.compile). Where q, k or v require grad the result is
        differentiable: the forward is the kernel's, the backward the varlen backward kernel
        tuned nearest the call (entries of kind ``varlen_bwd``), or, where the module has none
        for the call, each sequence recomputed and differentiated through SDPA.
        """
        check_fallback(fallback)
        p = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, values=check, any_float=fallback is not None,
                                aligned=fallback is None)
        causal = check_flag("causal", causal)
        scale = softmax_scale(scale, p.head_dim)
        # Chosen as a padded call of the longest lengths would be (the lengths a varlen
        # kernel was tuned at are its workload's longest).
        shape = Problem(p.batch, p.heads, p.kv_heads, max(1, p.max_seqlen_q),
                        max(1, p.max_seqlen_k), p.head_dim)
        kernel: CudaVarlenKernel | None = self._kernel_for(q, shape, causal, "varlen")
        if kernel is None:
            if fallback is None:
                raise NoKernelError(self.no_kernel(q, p.head_dim, causal, "varlen"))
            if lse is not None:
                raise ValueError("lse is not available from the SDPA fallback")
            if out is not None:
                check_varlen_out(out, None, q, p, aligned=False)
            result = varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale)
            return result if out is None else out.copy_(result)
        if fallback is not None:  # not checked above: SDPA might have served
            for name, t in (("q", q), ("k", k), ("v", v)):
                check_aligned(name, t)
        into = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        check_varlen_out(into, lse, q, p)

        def run(dst: Tensor, dst_lse: Tensor | None = lse) -> Tensor:
            kernel.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
                          dst, dst_lse, scale)
            return dst

        if not wants_grad(q, k, v):
            return run(into)
        # The autograd function's output is its own; out, where given, gets a copy.
        own = into if out is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        backward = self._kernel_for(q, shape, causal, "varlen_bwd")
        if backward is None:
            result = with_sdpa_gradients(lambda: run(own), q, k, v, cu_seqlens_q, cu_seqlens_k,
                                         causal=causal, scale=scale)
        else:
            def run_lse(own_lse: Tensor) -> Tensor:
                run(own, own_lse)
                if lse is not None:
                    lse.copy_(own_lse)
                return own

            result = with_kernel_gradients(run_lse, backward, q, k, v, cu_seqlens_q,
                                           cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
                                           causal=causal, scale=scale)
        return result if out is None else out.copy_(result)

    def register_transformers(self, name: str = "evoengine", *,
                              fallback: str | None = None) -> str:
        """Make ``attn_implementation=name`` run these kernels in Transformers models."""
        return register_hf(self, name=name, fallback=fallback)


def _define_op(tuned: TunedAttention, namespace: str) -> tuple[Any, str]:
    """Register ``<namespace>::attention`` and ``<namespace>::attention_backward``, the
    former's autograd formula; a taken namespace gets a numbered suffix, so two modules with
    the same kernels coexist in one process.

    ``attention`` returns (out, lse): the log-sum-exp where ``with_lse`` (what the backward
    reads; the caller asks for it where gradients are wanted), else an empty tensor.
    """
    base, n = namespace, 1
    while hasattr(getattr(torch.ops, namespace), "attention"):
        n += 1
        namespace = f"{base}_{n}"

    @torch.library.custom_op(f"{namespace}::attention", mutates_args=())
    def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  scale: float | None = None, fallback: str | None = None,
                  bshd: bool = False, with_lse: bool = False) -> tuple[Tensor, Tensor]:
        if with_lse:
            return tuned.forward_lse(q, k, v, causal=causal, scale=scale, fallback=fallback,
                                     bshd=bshd)
        out = tuned.forward(q, k, v, causal=causal, scale=scale, fallback=fallback, bshd=bshd)
        return out, out.new_empty(0, dtype=torch.float32)

    @attention.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
          fallback: str | None = None, bshd: bool = False,
          with_lse: bool = False) -> tuple[Tensor, Tensor]:
        check_inputs(q, k, v, any_float=fallback is not None, pointers=False,
                     aligned=fallback is None)
        b, h, sq, d = q.shape
        lse = q.new_empty((b, h, sq) if with_lse else (0,), dtype=torch.float32)
        if bshd:
            return q.new_empty((b, sq, h, d)).transpose(1, 2), lse
        return q.new_empty((b, h, sq, d)), lse

    @torch.library.custom_op(f"{namespace}::attention_backward", mutates_args=())
    def attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           dout: Tensor, causal: bool, scale: float | None,
                           fallback: str | None) -> tuple[Tensor, Tensor, Tensor]:
        return tuned.backward(q, k, v, out, lse, dout, causal=causal, scale=scale,
                              fallback=fallback)

    @attention_backward.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
          causal: bool, scale: float | None,
          fallback: str | None) -> tuple[Tensor, Tensor, Tensor]:
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format),
                torch.empty_like(v, memory_format=torch.contiguous_format))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, causal, scale, fallback = inputs[:6]
        ctx.save_for_backward(q, k, v, *output)
        ctx.options = (causal, scale, fallback)

    def backward(ctx: Any, dout: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, *ctx.options)
        return dq, dk, dv, None, None, None, None, None

    attention.register_autograd(backward, setup_context=setup_context)
    return attention, namespace

