"""The backward of ragged batches: ``CudaVarlenBackward``, a backward kernel compiled with
VARLEN, launched on packed tensors with cu_seqlens, and the autograd function that gives a
varlen forward kernel's output these kernels' gradients (``with_kernel_gradients``).

Varlen backward ABI (mma_bwd, wgmma_bwd with VARLEN): the kernels of the backward ABI
(``backward.py``, the group split's fourth too), each taking ``cu_seqlens_q, cu_seqlens_k``
(int32*) and ``total_q`` (int32) after its own arguments. q, k, v, out, dout, dq, dk, dv are
passed with batch strides of 0 and their packed [total, heads, head_dim] strides as the head
and row strides; ``seq_q`` and ``seq_k`` are the longest lengths (the grids span them; each
block reads its sequence's own). A TMA kernel's tensor maps of Q and dO span the packed
tensors seen as [1, heads, total, head_dim] (the kernel offsets each sequence's row
coordinate). The forward's log-sum-exp is float32 [heads, total_q] (the varlen forward's);
the fp32 dQ workspace is [heads, total_q, head_dim] (parts: [key blocks, heads, total_q,
head_dim]); LSE2 and DELTA are [heads, seq_q_pad] with seq_q_pad = total_q + batch (block_m +
4) rounded up to 4, each sequence's rows padded to whole query blocks from its own start
(``templates/common/bwd_prepost.cuh``, ``Seq``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from evoengine.launch.backward import (
    BWD_MAIN_ARGS,
    BWD_MAIN_TMA_ARGS,
    BWD_MAIN_TMA_KV_ARGS,
    BWD_POST_ARGS,
    BWD_PRE_ARGS,
    POST_THREADS,
    PRE_ROWS,
    PRE_THREADS,
    CudaBackward,
    tma_operand,
)
from evoengine.launch.core import (
    LOG2E,
    ParamBuffer,
    check_like,
    launch_in_context,
    raw_stream,
    rows_aligned,
    softmax_scale,
)
from evoengine.launch.varlen import check_varlen_inputs, check_varlen_out

# Each backward kernel's arguments, then cu_seqlens_q, cu_seqlens_k, total_q.
_RAGGED = "QQi"
VARLEN_BWD_PRE_ARGS = ParamBuffer(BWD_PRE_ARGS.codes + _RAGGED)
VARLEN_BWD_MAIN_ARGS = ParamBuffer(BWD_MAIN_ARGS.codes + _RAGGED)
VARLEN_BWD_MAIN_TMA_ARGS = ParamBuffer(BWD_MAIN_TMA_ARGS.codes + _RAGGED)
VARLEN_BWD_MAIN_TMA_KV_ARGS = ParamBuffer(BWD_MAIN_TMA_KV_ARGS.codes + _RAGGED)
VARLEN_BWD_POST_ARGS = ParamBuffer(BWD_POST_ARGS.codes + _RAGGED)


def padded_rows(total_q: int, batch: int, block_m: int) -> int:
    """LSE2's and DELTA's row stride per head for a ragged batch: room for every sequence's
    rows padded to whole query blocks from its own 16-byte aligned start (the template's
    ``Seq::pad0``)."""
    rows = total_q + batch * (block_m + 4)
    return -(-rows // 4) * 4


class CudaVarlenBackward(CudaBackward):
    """A backward kernel compiled with VARLEN: ``kernel(q, k, v, out, lse, dout,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=...) -> (dq, dk, dv)``
    on packed [total, heads, head_dim] tensors; ``launch`` is the unchecked hot path."""

    kind = "varlen_bwd"  # the problem it solves (dispatch.KERNEL_CLASSES)

    def __repr__(self) -> str:
        return f"CudaVarlenBackward({self.name!r})"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor,  # type: ignore[override]
                 lse: Tensor, dout: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                 scale: float | None = None, dq: Tensor | None = None,
                 dk: Tensor | None = None, dv: Tensor | None = None,
                 deterministic: bool = False, check: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of the ragged attention whose forward gave ``out`` and ``lse`` (float32
        [heads, total_q]), for the output gradient ``dout``, into ``dq``, ``dk``, ``dv``
        where given (packed like q, k, v; any strides, contiguous last dim). ``check``: as
        ``check_varlen_inputs``'s ``values`` (one sync per call to read cu_seqlens back)."""
        p = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, head_dim=self.head_dim, dtype=self.dtype,
                                values=check)
        if bool(causal) != self.causal:
            raise ValueError(f"this kernel is compiled for causal={self.causal}, "
                             f"got causal={bool(causal)}")
        if not isinstance(lse, Tensor):  # required here: what the forward wrote
            raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
        check_varlen_out(out, lse, q, p)
        check_like("dout", dout, q, "q")
        dq = torch.empty_like(q) if dq is None else check_like("dq", dq, q, "q")
        dk = torch.empty_like(k) if dk is None else check_like("dk", dk, k, "k")
        dv = torch.empty_like(v) if dv is None else check_like("dv", dv, v, "v")
        self.launch(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dq, dk, dv, scale=softmax_scale(scale, p.head_dim),
                    deterministic=bool(deterministic))
        return dq, dk, dv

    def launch(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor,  # type: ignore[override]
               lse: Tensor, dout: Tensor, cu_q: Tensor, cu_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, dq: Tensor, dk: Tensor, dv: Tensor, *, scale: float,
               deterministic: bool) -> None:
        """Launch the kernels on torch's current stream, without checks."""
        total_q, h, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        if total_q == 0 or total_k == 0:  # no (query, key) pair anywhere: every gradient 0
            for t in (dq, dk, dv):
                t.zero_()
            return
        batch = cu_q.numel() - 1
        index = q.get_device()
        pre, main, post = (kernel.load(index) for kernel in (self.pre, self.main, self.post))
        stream = raw_stream(index)
        bm, bn = self.block_m, self.block_n
        seq_q_pad = padded_rows(total_q, batch, bm)
        n_blocks = -(-max_seqlen_k // bn)
        ragged = (cu_q.data_ptr(), cu_k.data_ptr(), total_q)
        # Workspace, from torch's stream-ordered allocator (as CudaBackward.launch's).
        rows = torch.empty((2, h, seq_q_pad), dtype=torch.float32, device=q.device)
        lse2, delta = rows[0], rows[1]
        if deterministic or self.dq_accum == "separate":
            acc = None
            part = torch.empty((n_blocks, h, total_q, d), dtype=torch.float32, device=q.device)
        else:
            acc = torch.empty((h, total_q, d), dtype=torch.float32, device=q.device)
            part = None
        acc_ptr = 0 if acc is None else acc.data_ptr()
        part_ptr = 0 if part is None else part.data_ptr()

        os_, gs = out.stride(), dout.stride()
        args = VARLEN_BWD_PRE_ARGS.pack(out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                                        lse2.data_ptr(), delta.data_ptr(), acc_ptr,
                                        max_seqlen_q, h, seq_q_pad, 0, os_[1], os_[0], 0,
                                        gs[1], gs[0], *ragged)
        pre_rows = -(-max_seqlen_q // bm) * bm
        launch_in_context(pre, (pre.fn, -(-pre_rows // PRE_ROWS), h, batch, PRE_THREADS, 1, 1,
                                 0, stream, ctypes.addressof(args[1]), 0))
        # A group split's shares: [kv_heads x splits, total_k, head_dim] per gradient.
        grad_strides = [s for t in (dk, dv) for s in (0, t.stride(1), t.stride(0))]
        shares, (dk_ptr, dv_ptr), out_strides = self.split_outputs(dk, dv, hkv, total_k, 1,
                                                                   grad_strides, ragged=True)
        strides = [s for t in (q, k, v, dout) for s in (0, t.stride(1), t.stride(0))]
        main_args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(),
                     lse2.data_ptr(), delta.data_ptr(), acc_ptr, part_ptr, dk_ptr, dv_ptr,
                     max_seqlen_q, max_seqlen_k, h, h // hkv, seq_q_pad, *strides,
                     *out_strides, scale, scale * LOG2E, *ragged)
        if self.loader == "tma":  # maps over [1, heads, total, head_dim]: rows by sequence
            q_tma = tma_operand(q.unsqueeze(0).transpose(1, 2))
            dout_tma = tma_operand(dout.unsqueeze(0).transpose(1, 2))
            maps = [self.main._tensor_map(q_tma, bm), self.main._tensor_map(dout_tma, bm)]
            kv_tma = self.kv_operands(*(t.unsqueeze(0).transpose(1, 2) for t in (k, v)))
            maps += [self.main._tensor_map(t, bn) for t in kv_tma]
            buffer = VARLEN_BWD_MAIN_TMA_KV_ARGS if kv_tma else VARLEN_BWD_MAIN_TMA_ARGS
            args = buffer.pack(*maps, *main_args)
        else:
            q_tma = dout_tma = kv_tma = None
            args = VARLEN_BWD_MAIN_ARGS.pack(*main_args)
        self.launch_main(main, n_blocks, hkv * self.group_split, batch, stream, args)
        if shares is not None:
            self.launch_kv_post(shares, dk, dv, max_seqlen_k, batch, stream, index,
                                grad_strides, ragged)
        args = VARLEN_BWD_POST_ARGS.pack(acc_ptr, part_ptr, dq.data_ptr(), max_seqlen_q,
                                         max_seqlen_k, h, 0, dq.stride(1), dq.stride(0), scale,
                                         *ragged)
        chunks = max_seqlen_q * (d // 8)
        launch_in_context(post, (post.fn, -(-chunks // POST_THREADS), h, batch, POST_THREADS,
                                  1, 1, 0, stream, ctypes.addressof(args[1]), 0))
        del rows, acc, part, q_tma, dout_tma, kv_tma, shares  # every launch has read them


class _KernelGradients(torch.autograd.Function):
    """A varlen forward kernel's output whose gradients are a varlen backward kernel's:
    ``run(lse)`` gives the output and writes the log-sum-exp the backward reads."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                max_q: int, max_k: int, causal: bool, scale: float, run: Any,
                backward: CudaVarlenBackward) -> Tensor:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        out = run(lse)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.options = (max_q, max_k, causal, scale, backward)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        max_q, max_k, causal, scale, kernel = ctx.options
        if not rows_aligned(dout):  # autograd hands out what it has: expanded ones, views
            dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernel.launch(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, dq, dk, dv,
                      scale=scale, deterministic=torch.are_deterministic_algorithms_enabled())
        return (dq, dk, dv, *(None,) * 8)


def with_kernel_gradients(run: Any, backward: CudaVarlenBackward, q: Tensor, k: Tensor,
                          v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                          scale: float) -> Tensor:
    """``run(lse)`` (a varlen forward kernel's output for q, k, v, its log-sum-exp written
    into ``lse`` [heads, total_q]) made differentiable in q, k and v by ``backward``."""
    return _KernelGradients.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, scale, run, backward)
