"""Load a compiled candidate on the GPU and call it on torch tensors.

Kernels are cubins built by :mod:`evoengine.compile` (NVRTC) and loaded through CuPy's
module API; they launch on torch's current stream, so they order correctly with the
surrounding torch work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.render import KERNEL_NAME, Candidate

if TYPE_CHECKING:
    import torch

LOG2E = 1.4426950408889634


class NoGPUError(RuntimeError):
    """Raised where a CUDA GPU is needed and none is usable."""


def gpu_arch() -> Arch:
    """The target of the current CUDA device; ``NoGPUError`` when there is none."""
    from evoengine.arch import arch_of_capability

    try:
        import torch
    except ImportError:
        raise NoGPUError("torch is not installed") from None
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA GPU is visible to torch")
    return arch_of_capability(*torch.cuda.get_device_capability())


@dataclass(frozen=True)
class Problem:
    """The shapes of one call, read off the tensors."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int


_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 head_dim: int | None = None, dtype: str | None = None) -> Problem:
    """Reject what the kernels cannot take, naming what was expected; return the shapes."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], "
                             f"got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
        if any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned with strides a multiple of 8 "
                             f"elements, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if dtype is not None and q.dtype != getattr(torch, _DTYPES[dtype]):
        raise ValueError(f"this kernel takes {dtype}, got {q.dtype}")
    b, h, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    kb, hkv, sk, kd = k.shape
    if kb != b or kd != d:
        raise ValueError(f"k, v must be [{b}, kv_heads, seq_k, {d}] to match q, "
                         f"got {tuple(k.shape)}")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"this kernel takes head_dim {head_dim}, got {d}")
    return Problem(b, h, hkv, sq, sk, d)


class Kernel:
    """One compiled candidate on the current device: ``kernel(q, k, v) -> out``."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        import cupy

        if not compiled.ok or compiled.cubin is None:
            raise ValueError(f"{candidate.identity} did not compile: {compiled.error}")
        self.candidate = candidate
        self.compiled = compiled
        import torch

        # The cubin is loaded from memory into the current device's (primary) context.
        with cupy.cuda.Device(torch.cuda.current_device()):
            self._module = cupy.cuda.function.Module()
            self._module.load(compiled.cubin)
            self._fn = self._module.get_function(KERNEL_NAME)
            cupy.cuda.driver.funcSetAttribute(
                self._fn.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                candidate.smem_bytes)
        self.head_dim = int(candidate.problem["HEAD_DIM"])  # type: ignore[call-overload]
        self.dtype = str(candidate.problem["DTYPE"])
        self.causal = bool(candidate.problem["CAUSAL"])
        # The wgmma family takes TMA tensor maps instead of pointers: its own launcher.
        self._tma = None
        if candidate.family == "wgmma":
            from evoengine._tma import TmaLauncher

            self._tma = TmaLauncher(candidate, self._fn.ptr, torch.cuda.current_device())

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> Kernel:
        return cls(candidate, compile_candidate(candidate, arch))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 scale: float | None = None, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over k, v. ``lse`` (float32 [B, H, Sq]) receives the log-sum-exp."""
        import torch

        p = check_inputs(q, k, v, head_dim=self.head_dim, dtype=self.dtype)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must match q: {tuple(q.shape)} {q.dtype} on {q.device}")
        elif out.stride(-1) != 1 or any(s % 8 for s in out.stride()[:-1]) or out.data_ptr() % 16:
            raise ValueError("out must have a contiguous last dim and 16-byte aligned rows")
        if lse is not None and (lse.shape != (p.batch, p.heads, p.seq_q) or
                                lse.dtype != torch.float32 or not lse.is_contiguous()):
            raise ValueError(f"lse must be a contiguous float32 [{p.batch}, {p.heads}, {p.seq_q}]")
        scale = 1.0 / math.sqrt(p.head_dim) if scale is None else float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        self.launch(q, k, v, out, lse, p, scale)
        return out

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, p: Problem, scale: float) -> None:
        """Launch without checks, on torch's current stream (inputs already validated)."""
        if self._tma is not None:
            self._tma.launch(q, k, v, out, lse, p, scale)
            return
        import cupy
        import torch

        c = self.candidate
        grid = ((p.seq_q + c.block_m - 1) // c.block_m, p.heads, p.batch)
        args = (
            np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()),
            np.uint64(out.data_ptr()), np.uint64(lse.data_ptr() if lse is not None else 0),
            np.int32(p.seq_q), np.int32(p.seq_k), np.int32(p.heads),
            np.int32(p.heads // p.kv_heads),
            *(np.int64(s) for t in (q, k, v, out) for s in t.stride()[:3]),
            np.float32(scale * LOG2E),
        )
        stream = torch.cuda.current_stream(q.device)
        with cupy.cuda.Device(q.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
            self._fn(grid, (c.threads,), args, shared_mem=c.smem_bytes)
