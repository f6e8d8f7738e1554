"""The attention backward pass: dQ, dK, dV from a compiled backward candidate (``mma_bwd`` on
mma.sync, sm_80+; ``wgmma_bwd`` on wgmma, sm_90a).

A backward cubin holds three kernels, launched in order on torch's current stream; the first
and last are one source for every backward family (``templates/common/bwd_prepost.cuh``), and
the main one (``templates/<family>/kernel.cu.j2``) has one signature and grid in every family:

- ``attn_bwd_pre(O, dO, LSE, LSE2, DELTA, dQacc, seq_q, heads, seq_q_pad, o_sb, o_sh, o_ss,
  do_sb, do_sh, do_ss)`` on (ceil(seq_q_pad / 32), heads, batch) blocks of 256 threads: per
  query row, delta = rowsum(dO * O) and the log-sum-exp in base 2, padded to whole query
  blocks (seq_q_pad); zeroes the fp32 dQ accumulator (dQacc, null when dQ is stored in parts);
- ``attn_bwd(Q, K, V, dO, LSE2, DELTA, dQacc, dQpart, dK, dV, seq_q, seq_k, heads, kv_group,
  seq_q_pad, <q, k, v, dO, dK, dV strides: batch, head, seq each>, scale, scale_log2)`` on
  (ceil(seq_k / block_n), kv_heads, batch) blocks of the candidate's threads and shared memory
  (wgmma_bwd: one 128-thread warpgroup per 64 keys, no producer, no tensor maps): dK and dV
  (summed over each key/value head's query heads), and dQ added into dQacc with atomics, or,
  when dQpart is given, stored per key block into dQpart [key blocks, B, H, Sq, D] (fp32);
- ``attn_bwd_post(dQacc, dQpart, dQ, seq_q, seq_k, heads, dq_sb, dq_sh, dq_ss, scale)`` on
  (ceil(seq_q * head_dim / 8 / 256), heads, batch) blocks of 256 threads: dQ to fp16/bf16,
  scaled, the parts summed in key order.

``deterministic=True`` (or a ``DQ_ACCUM="separate"`` candidate) takes the path with parts:
bit-identical results run to run, at the cost of one fp32 dQ per key block of workspace.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import torch
from torch import Tensor

from evoengine._standalone import (
    LOG2E,
    CudaKernel,
    _check_grid,
    _launch_in_context,
    _raw_stream,
    check_inputs,
    softmax_scale,
)
from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.render import Candidate

__all__ = ["BACKWARD_FAMILIES", "ENTRIES", "BackwardKernel"]

BACKWARD_FAMILIES = ("mma_bwd", "wgmma_bwd")
ENTRIES = ("attn_bwd_pre", "attn_bwd", "attn_bwd_post")
# The launch shapes of the first and last kernels, as the template's cfg::PRE_THREADS,
# PRE_ROWS and POST_THREADS (tests/test_backward.py reads them from a rendered source).
PRE_THREADS = 256
PRE_ROWS = 32
POST_THREADS = 256


class _Params:
    """One kernel's parameter buffer: fields at their natural alignment, as the kernel's
    parameter space lays them out (``codes``: struct letters, Q a pointer, q an int64, i an
    int32, f a float), and the array of pointers into it that cuLaunchKernel takes."""

    def __init__(self, codes: str) -> None:
        fmt, offsets, at = "=", [], 0
        for code in codes:
            size = struct.calcsize("=" + code)
            pad = -at % size
            fmt += f"{pad}x{code}" if pad else code
            offsets.append(at + pad)
            at += pad + size
        self.struct = struct.Struct(fmt)
        self.offsets = tuple(offsets)

    def pack(self, *values: Any) -> tuple[Any, Any]:
        """(buffer, pointer array); both must live until the launch has been enqueued."""
        buf = ctypes.create_string_buffer(self.struct.size)
        self.struct.pack_into(buf, 0, *values)
        base = ctypes.addressof(buf)
        argv = (ctypes.c_void_p * len(self.offsets))(*(base + o for o in self.offsets))
        return buf, argv


_PRE = _Params("QQQQQQ" + "iii" + "q" * 6)
_MAIN = _Params("Q" * 10 + "i" * 5 + "q" * 18 + "ff")
_POST = _Params("QQQ" + "iii" + "qqq" + "f")


def _check_tensor(name: str, t: object, like: Tensor, like_name: str) -> Tensor:
    """``t`` must have ``like``'s shape, dtype and device, a contiguous last dim and 16-byte
    aligned rows (any other strides)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must match {like_name}: {tuple(like.shape)} {like.dtype} on "
                         f"{like.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    strides = t.stride()
    if strides[-1] != 1 or any(s % 8 for s in strides[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows, "
                         f"got strides {strides}")
    return t


class BackwardKernel:
    """One compiled backward candidate:
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)``.

    ``out`` and ``lse`` are the forward's output and natural-log log-sum-exp (float32
    [B, H, Sq], contiguous; -inf on rows that see no key), as the forward kernels write them.
    Loads on first use per device.
    """

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        if candidate.family not in BACKWARD_FAMILIES:
            raise ValueError(f"{candidate.identity} is not a backward family "
                             f"({', '.join(BACKWARD_FAMILIES)})")
        if not compiled.ok or compiled.cubin is None:
            raise ValueError(f"{candidate.identity} did not compile: {compiled.error}")
        self.candidate = candidate
        self.compiled = compiled
        self.head_dim = int(candidate.problem["HEAD_DIM"])  # type: ignore[call-overload]
        self.dtype = str(candidate.problem["DTYPE"])
        self.causal = bool(candidate.problem["CAUSAL"])
        self.block_m = candidate.block_m
        self.block_n = int(candidate.params["BLOCK_N"])  # type: ignore[call-overload]
        self.dq_accum = str(candidate.params["DQ_ACCUM"])
        common: dict[str, Any] = dict(head_dim=self.head_dim, dtype=self.dtype,
                                      causal=self.causal, block_m=self.block_m,
                                      arch=compiled.arch, cubin=compiled.cubin)
        pre, main, post = ENTRIES
        self._pre = CudaKernel(f"{candidate.identity}:{pre}", threads=PRE_THREADS,
                               smem_bytes=0, entry=pre, **common)
        self._main = CudaKernel(candidate.identity, threads=candidate.threads,
                                smem_bytes=candidate.smem_bytes, entry=main, **common)
        self._post = CudaKernel(f"{candidate.identity}:{post}", threads=POST_THREADS,
                                smem_bytes=0, entry=post, **common)

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> BackwardKernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"BackwardKernel({self.candidate.identity!r})"

    def load(self, index: int) -> None:
        """Load the three kernels on CUDA device ``index`` (once each)."""
        for kernel in (self._pre, self._main, self._post):
            kernel.load(index)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dout: Tensor, *, causal: bool, scale: float | None = None,
                 dq: Tensor | None = None, dk: Tensor | None = None, dv: Tensor | None = None,
                 deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of attention(q, k, v) for the output gradient ``dout``, written into
        ``dq``, ``dk``, ``dv`` where given (any strides, contiguous last dim)."""
        p = check_inputs(q, k, v, head_dim=self.head_dim, dtype=self.dtype)
        _check_grid(p)
        if bool(causal) != self.causal:
            raise ValueError(f"this kernel is compiled for causal={self.causal}, "
                             f"got causal={bool(causal)}")
        _check_tensor("out", out, q, "q")
        _check_tensor("dout", dout, q, "q")
        if not isinstance(lse, Tensor):
            raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
        if (lse.shape != (p.batch, p.heads, p.seq_q) or lse.dtype != torch.float32
                or not lse.is_contiguous() or lse.device != q.device):
            raise ValueError(f"lse must be a contiguous float32 [{p.batch}, {p.heads}, "
                             f"{p.seq_q}] on {q.device}, got {tuple(lse.shape)} {lse.dtype} "
                             f"on {lse.device}")
        scale = softmax_scale(scale, p.head_dim)
        new = dict(memory_format=torch.contiguous_format)
        dq = torch.empty_like(q, **new) if dq is None else _check_tensor("dq", dq, q, "q")
        dk = torch.empty_like(k, **new) if dk is None else _check_tensor("dk", dk, k, "k")
        dv = torch.empty_like(v, **new) if dv is None else _check_tensor("dv", dv, v, "v")
        self.launch(q, k, v, out, lse, dout, dq, dk, dv, scale=scale,
                    deterministic=bool(deterministic))
        return dq, dk, dv

    def launch(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
               dq: Tensor, dk: Tensor, dv: Tensor, *, scale: float,
               deterministic: bool) -> None:
        """Launch the three kernels on torch's current stream, without checks."""
        b, h, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        index = q.get_device()
        pre, main, post = (kernel.load(index) for kernel in (self._pre, self._main, self._post))
        stream = _raw_stream(index)
        seq_q_pad = -(-sq // self.block_m) * self.block_m
        n_blocks = -(-sk // self.block_n)
        # Workspace, from torch's stream-ordered allocator: dropped after the launches are
        # enqueued, its memory goes only to work ordered after them on this stream.
        rows = torch.empty((2, b, h, seq_q_pad), dtype=torch.float32, device=q.device)
        lse2, delta = rows[0], rows[1]
        if deterministic or self.dq_accum == "separate":
            acc = None
            part = torch.empty((n_blocks, b, h, sq, d), dtype=torch.float32, device=q.device)
        else:
            acc = torch.empty((b, h, sq, d), dtype=torch.float32, device=q.device)
            part = None
        acc_ptr = 0 if acc is None else acc.data_ptr()
        part_ptr = 0 if part is None else part.data_ptr()

        args = _PRE.pack(out.data_ptr(), dout.data_ptr(), lse.data_ptr(), lse2.data_ptr(),
                         delta.data_ptr(), acc_ptr, sq, h, seq_q_pad, *out.stride()[:3],
                         *dout.stride()[:3])
        _launch_in_context(pre, (pre.fn, -(-seq_q_pad // PRE_ROWS), h, b, PRE_THREADS, 1, 1,
                                 0, stream, ctypes.addressof(args[1]), 0))
        strides = [s for t in (q, k, v, dout, dk, dv) for s in t.stride()[:3]]
        args = _MAIN.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(),
                          lse2.data_ptr(), delta.data_ptr(), acc_ptr, part_ptr, dk.data_ptr(),
                          dv.data_ptr(), sq, sk, h, h // hkv, seq_q_pad, *strides, scale,
                          scale * LOG2E)
        _launch_in_context(main, (main.fn, n_blocks, hkv, b, self._main.threads, 1, 1,
                                  self._main.smem_bytes, stream, ctypes.addressof(args[1]), 0))
        args = _POST.pack(acc_ptr, part_ptr, dq.data_ptr(), sq, sk, h, *dq.stride()[:3], scale)
        chunks = sq * (d // 8)
        _launch_in_context(post, (post.fn, -(-chunks // POST_THREADS), h, b, POST_THREADS, 1, 1,
                                  0, stream, ctypes.addressof(args[1]), 0))
        del rows, acc, part  # only now: every launch has read their addresses
