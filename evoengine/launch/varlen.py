"""Ragged batches: ``CudaVarlenKernel``, a forward kernel compiled with VARLEN, launched on
packed q, k, v with cu_seqlens, the checks of such a call, SDPA per sequence (the fallback),
and SDPA's gradients for a kernel's output (``with_sdpa_gradients``).

Varlen ABI (mma): the forward's arguments, then ``cu_seqlens_q, cu_seqlens_k`` (int32*) and
``total_q`` (int32, the log-sum-exp's row stride), on a grid of (ceil(max_seqlen_q / block_m),
heads, batch) blocks; Q, K, V, O are passed with batch strides of 0 and their packed [total,
heads, head_dim] strides as the head and row strides. Varlen TMA ABI (wgmma): the TMA
arguments, then the same three, on the forward's grid of tiles over (query block of the
longest sequence, head, batch); the tensor maps are built over the packed tensors seen as
[1, heads, total, head_dim], the kernel offsetting each sequence's row coordinate.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, NamedTuple

import torch
from torch import Tensor

from evoengine.launch.core import (
    DTYPE_NAMES,
    LOG2E,
    ParamBuffer,
    check_aligned,
    check_dtype,
    check_grid_dims,
    check_shared,
    check_tensor,
    in_context,
    launch_in_context,
    raw_stream,
    rows_aligned,
    sdpa_attention,
    sm_count,
    softmax_scale,
    zero_int32,
)
from evoengine.launch.forward import CudaKernel
from evoengine.launch.tma import TMA_ARG_OFFSETS, tma_grid

_VARLEN_ARGS = ParamBuffer("QQQQQ" + "iiii" + "q" * 12 + "f" + "QQi")
# The TMA arguments (tma.TMA_ARGS) and cu_seqlens_q, cu_seqlens_k, total_q.
_TMA_VARLEN_ARGS = struct.Struct("=128s128s128s2Q5i4x3qf4xQQQi")
_TMA_VARLEN_OFFSETS = (*TMA_ARG_OFFSETS, 464, 472, 480)


class VarlenProblem(NamedTuple):
    """The shapes of one ragged call, read off the tensors."""

    batch: int
    heads: int
    kv_heads: int
    total_q: int
    total_k: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int


def _check_packed(name: str, t: object, heads_name: str, any_float: bool,
                  aligned: bool) -> Tensor:
    t = check_tensor(name, t, 3, f"[total, {heads_name}, head_dim] (packed)")
    check_dtype(name, t, any_float)
    if t.shape[1] == 0 or t.shape[2] == 0:
        raise ValueError(f"{name} must have {heads_name} >= 1 and head_dim >= 1, got "
                         f"{tuple(t.shape)}")
    if aligned and t.dtype in DTYPE_NAMES:
        check_aligned(name, t)
    return t


def _check_cu(name: str, t: object, device: torch.device) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {t.device}")
    if t.dim() != 1 or t.numel() < 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D [batch + 1] tensor, batch >= 1, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    return t


def check_cu_values(name: str, cu: list[int], total: int, max_seqlen: int) -> None:
    """cu_seqlens' values: from 0, never decreasing, ending at the packed length ``total``,
    no sequence longer than ``max_seqlen``."""
    lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    if cu[0] != 0 or min(lengths) < 0:
        raise ValueError(f"{name} must start at 0 and never decrease, got "
                         f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {cu[-1]}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen_{name[-1]} ({max_seqlen}) is smaller than a sequence "
                         f"of length {max(lengths)}")


def check_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                        cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                        head_dim: int | None = None, dtype: str | None = None,
                        values: bool = True, any_float: bool = False,
                        aligned: bool = True) -> VarlenProblem:
    """Reject what a varlen kernel cannot take, with a one-line ``ValueError`` naming what was
    expected, before any launch; return the shapes.

    ``values`` also checks what cu_seqlens hold (starting at 0, never decreasing, ending at the
    packed lengths, no sequence longer than its max_seqlen): that reads them back to the host,
    one device-to-host copy of 2 (batch + 1) int32 and so a synchronization with the stream
    per call. ``values=False`` skips it (the kernel then trusts them: a wrong cu_seqlens reads
    and writes out of bounds). ``any_float`` and ``aligned=False``: as ``check_inputs``'s,
    for the SDPA fallback.
    """
    _check_packed("q", q, "heads", any_float, aligned)
    _check_packed("k", k, "kv_heads", any_float, aligned)
    _check_packed("v", v, "kv_heads", any_float, aligned)
    check_shared("q, k, v", q, k, v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    total_q, heads, d = q.shape
    total_k, kv_heads, dk = k.shape
    if dk != d:
        raise ValueError(f"q and k must share head_dim, got {d} and {dk}")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"this kernel takes head_dim {head_dim}, got {d}")
    if dtype is not None and DTYPE_NAMES.get(q.dtype) != dtype:
        raise ValueError(f"this kernel takes {dtype}, got {q.dtype}")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [batch + 1], got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} entries")
    batch = cu_seqlens_q.numel() - 1
    check_grid_dims(batch, heads)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # The kernels take it as an int32.
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**31:
            raise ValueError(f"{name} must be an int in [0, 2**31), got {m!r}")
    if values:
        both = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()  # the one sync
        check_cu_values("cu_seqlens_q", both[:batch + 1], total_q, max_seqlen_q)
        check_cu_values("cu_seqlens_k", both[batch + 1:], total_k, max_seqlen_k)
    return VarlenProblem(batch, heads, kv_heads, total_q, total_k, d, max_seqlen_q,
                         max_seqlen_k)


def check_varlen_out(out: Tensor, lse: Tensor | None, q: Tensor, p: VarlenProblem,
                     aligned: bool = True) -> None:
    """``out`` like q ([total_q, heads, head_dim], any 16-byte aligned rows; any strides
    where not ``aligned``: SDPA writes it); ``lse`` a contiguous float32 [heads, total_q]."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if aligned and not rows_aligned(out):
        raise ValueError(f"out must have a contiguous last dim and 16-byte aligned rows, got "
                         f"strides {out.stride()}")
    if lse is not None and not isinstance(lse, Tensor):
        raise TypeError(f"lse must be a torch.Tensor or None, got {type(lse).__name__}")
    if lse is not None and (lse.shape != (p.heads, p.total_q) or lse.dtype != torch.float32
                            or not lse.is_contiguous() or lse.device != q.device):
        raise ValueError(f"lse must be a contiguous float32 [{p.heads}, {p.total_q}] on "
                         f"{q.device}")


class CudaVarlenKernel(CudaKernel):
    """A forward kernel compiled with VARLEN: ``kernel(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, scale=, out=, lse=)`` on packed [total, heads, head_dim]
    tensors; ``launch`` is the unchecked hot path."""

    kind = "varlen"  # the problem it solves (dispatch.KERNEL_CLASSES)

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        if self.tma is not None:
            size, offsets = _TMA_VARLEN_ARGS.size, _TMA_VARLEN_OFFSETS
        else:
            size, offsets = _VARLEN_ARGS.struct.size, _VARLEN_ARGS.offsets
        self._args = ctypes.create_string_buffer(size)
        base = ctypes.addressof(self._args)
        self._argv = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._argv_ptr = ctypes.addressof(self._argv)

    def __repr__(self) -> str:
        return f"CudaVarlenKernel({self.name!r})"

    def launch(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor,  # type: ignore[override]
               cu_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, out: Tensor,
               lse: Tensor | None, scale: float) -> None:
        """Launch on torch's current stream, without checks (inputs already validated)."""
        if max_seqlen_q == 0 or q.shape[0] == 0:
            return  # no query row anywhere
        index = q.get_device()
        loaded = self._loaded.get(index) or self.load(index)
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        batch = cu_q.numel() - 1
        os_ = out.stride()
        stream = raw_stream(index)
        lse_ptr = 0 if lse is None else lse.data_ptr()
        if self.tma is None:
            qs, ks, vs = q.stride(), k.stride(), v.stride()
            grid_x = -(-max_seqlen_q // self.block_m)
            with self._lock:
                _VARLEN_ARGS.struct.pack_into(
                    self._args, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                    lse_ptr, max_seqlen_q, max_seqlen_k, heads, group, 0, qs[1], qs[0], 0,
                    ks[1], ks[0], 0, vs[1], vs[0], 0, os_[1], os_[0], scale * LOG2E,
                    cu_q.data_ptr(), cu_k.data_ptr(), q.shape[0])
                launch_in_context(loaded, (loaded.fn, grid_x, heads, batch, self.threads, 1, 1,
                                            self.smem_bytes, stream, self._argv_ptr, 0))
            return
        if k.shape[0] == 0:  # no key anywhere, and a tensor map cannot span zero rows
            out.zero_()  # every row sees no key: zero, log-sum-exp -inf (as the kernels write)
            if lse is not None:
                lse.fill_(float("-inf"))
            return
        # [total, H, D] seen as [1, H, total, D]: the maps' row coordinate is the packed row.
        q_map, pack = self._q_map(q.unsqueeze(0).transpose(1, 2), group)
        grid, tiles = tma_grid(self.block_m, max_seqlen_q, heads, batch, self.tma.persistent,
                               sm_count(index), pack)
        maps = (q_map,
                self._tensor_map(k.unsqueeze(0).transpose(1, 2), self.tma.block_n),
                self._tensor_map(v.unsqueeze(0).transpose(1, 2), self.tma.block_n))
        with self._lock:  # the argument buffer and the counters: one launch at a time
            counter = self._counter(q.device, stream) if self.tma.dynamic else 0
            _TMA_VARLEN_ARGS.pack_into(
                self._args, 0, *maps, out.data_ptr(), lse_ptr, max_seqlen_q, max_seqlen_k,
                heads, group, tiles, 0, os_[1], os_[0], scale * LOG2E, counter,
                cu_q.data_ptr(), cu_k.data_ptr(), q.shape[0])
            if counter:  # zeroed on this stream right before the launch (as the forward's)
                in_context(loaded, zero_int32, counter, stream)
            launch_in_context(loaded, (loaded.fn, grid, 1, 1, self.threads, 1, 1,
                                        self.smem_bytes, stream, self._argv_ptr, 0))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor,  # type: ignore[override]
                 cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, *, scale: float | None = None, out: Tensor | None = None,
                 lse: Tensor | None = None, check: bool = True) -> Tensor:
        """Attention of each sequence's queries over its keys; ``lse`` (float32 [heads,
        total_q]) receives the log-sum-exp. ``check=False`` skips reading cu_seqlens back
        (``check_varlen_inputs``: one sync per call)."""
        p = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, head_dim=self.head_dim, dtype=self.dtype,
                                values=check)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        check_varlen_out(out, lse, q, p)
        self.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                    softmax_scale(scale, p.head_dim))
        return out


def varlen_sdpa(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                *, causal: bool, scale: float | None = None,
                lengths: list[tuple[int, int]] | None = None) -> Tensor:
    """The SDPA fallback: each sequence through ``sdpa_attention`` (bottom-right causal, GQA,
    empty-key rows 0), into one packed output."""
    if lengths is None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    else:
        cq, ck = [0], [0]
        for lq, lk in lengths:
            cq.append(cq[-1] + lq)
            ck.append(ck[-1] + lk)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
            continue  # no query, or no key: rows stay 0
        qb, kb, vb = (x[s:e].transpose(0, 1).unsqueeze(0) for x, s, e in
                      ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
        out[cq[b]:cq[b + 1]] = sdpa_attention(qb, kb, vb, causal=causal,
                                              scale=scale)[0].transpose(0, 1)
    return out


class _SdpaGradients(torch.autograd.Function):
    """A varlen forward whose gradients are SDPA's: ``run()`` gives the output (a varlen
    kernel's launch), and the backward recomputes each sequence through ``varlen_sdpa`` and
    differentiates that (no varlen backward kernel exists yet)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                causal: bool, scale: float | None, run: Any) -> Tensor:
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.causal, ctx.scale = causal, scale
        return run()

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = varlen_sdpa(*leaves, cu_q, cu_k, causal=ctx.causal, scale=ctx.scale)
            grads: tuple[Tensor | None, ...] = (None, None, None)
            if out.requires_grad:  # else no sequence has both a query and a key
                grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        grads = tuple(None if not wanted else torch.zeros_like(t) if g is None else g
                      for t, g, wanted in zip(leaves, grads, ctx.needs_input_grad[:3],
                                              strict=True))
        return (*grads, None, None, None, None, None)


def with_sdpa_gradients(run: Any, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                        cu_seqlens_k: Tensor, *, causal: bool, scale: float | None) -> Tensor:
    """``run()`` (a varlen kernel's output for q, k, v) made differentiable in q, k and v
    with SDPA's gradients, each sequence recomputed in the backward: where a ragged call
    wants gradients (a Transformers model trained on padded batches), the forward is the
    kernel's and the gradients are right, not absent."""
    return _SdpaGradients.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, run)
