"""Load tuned attention kernels and launch them on torch tensors, with cupy and torch only.

This file is the one launcher of the project, forward and backward:
``evoengine.runtime.Kernel``, ``evoengine.backward.BackwardKernel`` and ``evoengine.load`` use
it from the package, and ``evoengine export`` copies its text verbatim into every exported
module. So it imports nothing but torch, cupy (lazily: a module built on it still imports on
a machine without a GPU) and the standard library.

Kernel ABI (mma, wmma): ``extern "C" __global__ attn_fwd(Q, K, V, O, LSE, seq_q, seq_k,
heads, kv_group, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss,
scale_log2)`` on a grid of (ceil(seq_q / block_m), heads, batch) blocks; LSE may be null.

TMA ABI (wgmma, sm_90a): ``attn_fwd(CUtensorMap q, k, v, O, LSE, seq_q, seq_k, heads,
kv_group, total_tiles, o_sb, o_sh, o_ss, scale_log2, tile_counter)`` on a 1-D grid of tiles
(query block, head, batch), or one block per SM when persistent. The tensor maps are 128-byte
``__grid_constant__`` parameters built per call with the driver's ``cuTensorMapEncodeTiled``
(through ctypes) over (head_dim, seq, heads, batch) with the tensors' own strides.
``tile_counter`` (int32*) is where a dynamically scheduled kernel draws its tiles: a fresh
zero per launch, allocated on the launch's stream; null for every other kernel.

Backward ABI (mma_bwd, wgmma_bwd): three kernels of one cubin, launched in order on torch's
current stream (``CudaBackward``); the first and last are one source for every backward family
(``templates/common/bwd_prepost.cuh``):

- ``attn_bwd_pre(O, dO, LSE, LSE2, DELTA, dQacc, seq_q, heads, seq_q_pad, o_sb, o_sh, o_ss,
  do_sb, do_sh, do_ss)`` on (ceil(seq_q_pad / 32), heads, batch) blocks of 256 threads: per
  query row, delta = rowsum(dO * O) and the log-sum-exp in base 2, padded to whole query
  blocks (seq_q_pad); zeroes the fp32 dQ accumulator (dQacc, null when dQ is stored in parts);
- ``attn_bwd(Q, K, V, dO, LSE2, DELTA, dQacc, dQpart, dK, dV, seq_q, seq_k, heads, kv_group,
  seq_q_pad, <q, k, v, dO, dK, dV strides: batch, head, seq each>, scale, scale_log2)`` on
  (ceil(seq_k / block_n), kv_heads, batch) blocks of the candidate's threads and shared memory:
  dK and dV (summed over each key/value head's query heads), and dQ added into dQacc with
  atomics, or, when dQpart is given, stored per key block into dQpart [key blocks, B, H, Sq, D]
  (fp32);
- ``attn_bwd_post(dQacc, dQpart, dQ, seq_q, seq_k, heads, dq_sb, dq_sh, dq_ss, scale)`` on
  (ceil(seq_q * head_dim / 8 / 256), heads, batch) blocks of 256 threads: dQ to fp16/bf16,
  scaled, the parts summed in key order.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import math
import struct
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

LOG2E = 1.4426950408889634
KERNEL_NAME = "attn_fwd"
KERNEL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in KERNEL_DTYPES.items()}
FALLBACKS = (None, "sdpa")
KINDS = ("fwd", "bwd")  # the problems a module carries kernels for: forward and backward
MIN_SM = 80  # cp.async and mma.sync m16n8k16
# NVRTC's options for every kernel, besides the target and the defines: the one list, which
# evoengine.compile reads from this file (offline builds) and exported modules carry (builds
# on another GPU). -default-device: NVRTC 13.0 (the GPU box's) treats a lambda in a kernel as
# a host function unless told that unannotated functions are device code; 13.5 does not care.
NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization")
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z: heads and batch

# The launch arguments, packed once per call into a buffer the driver reads: 5 pointers,
# 4 int32, 12 int64 strides, 1 float. Each field sits at its natural alignment, as in the
# kernel's parameter space.
_ARGS = struct.Struct("=5Q4i12qf")
_ARG_OFFSETS = (*range(0, 40, 8), *range(40, 56, 4), *range(56, 152, 8), 152)


class NoKernelError(ValueError):
    """No tuned kernel serves this call (dtype, head dim, causal, or the GPU itself)."""


class IntegrityError(RuntimeError):
    """An embedded CUDA source or cubin does not match the hash recorded when exporting."""


class Problem(NamedTuple):
    """The shapes of one call, read off the tensors."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, head_dim: int | None = None,
                 dtype: str | None = None, any_float: bool = False,
                 pointers: bool = True) -> Problem:
    """Reject what the kernels cannot take, naming what was expected; return the shapes.

    ``any_float`` lets float32/float64 through (for a fallback that is not a kernel);
    ``pointers=False`` skips the alignment of the data pointers (fake tensors have none).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], "
                             f"got {tuple(t.shape)}")
        kernel_dtype = t.dtype in _DTYPE_NAMES
        if not kernel_dtype and not (any_float and t.dtype.is_floating_point):
            raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
        strides = t.stride()
        if strides[-1] != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {strides}")
        if kernel_dtype and (strides[0] % 8 or strides[1] % 8 or strides[2] % 8
                             or (pointers and t.data_ptr() % 16)):
            raise ValueError(f"{name} must be 16-byte aligned with strides a multiple of 8 "
                             f"elements, got strides {strides}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if dtype is not None and dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(KERNEL_DTYPES)}, got {dtype!r}")
    if dtype is not None and q.dtype != KERNEL_DTYPES[dtype]:
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


def _rows_aligned(t: Tensor) -> bool:
    """A contiguous last dim, other strides a multiple of 8 values, a 16-byte aligned start."""
    strides = t.stride()
    return strides[-1] == 1 and not any(s % 8 for s in strides[:-1]) and not t.data_ptr() % 16


def check_out(out: Tensor, q: Tensor, lse: Tensor | None, p: Problem) -> None:
    """Reject an output buffer (and log-sum-exp buffer) that the kernel cannot write."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: {tuple(q.shape)} {q.dtype} on {q.device}")
    if not _rows_aligned(out):
        raise ValueError("out must have a contiguous last dim and 16-byte aligned rows")
    if lse is not None and (lse.shape != (p.batch, p.heads, p.seq_q) or
                            lse.dtype != torch.float32 or not lse.is_contiguous()
                            or lse.device != q.device):
        raise ValueError(f"lse must be a contiguous float32 [{p.batch}, {p.heads}, {p.seq_q}] "
                         f"on {q.device}")


def softmax_scale(scale: float | None, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                   scale: float | None = None) -> Tensor:
    """torch SDPA with the kernels' semantics: GQA, causal aligned bottom-right, and rows
    that see no key equal to zero."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if not causal:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    rows = torch.arange(q.shape[2], device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = cols <= rows + (k.shape[2] - q.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.nan_to_num(out, nan=0.0)  # rows with no key: defined as zero


def sdpa_attention_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *, causal: bool,
                         scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of ``sdpa_attention`` through torch SDPA's own backward, in the inputs' dtype.

    Causal rows that see no key (the first seq_q - seq_k) are left out of SDPA's call, whose
    fully masked rows would give NaN, and get the zero gradient they have by definition; the
    rest keep the bottom-right alignment (their count equals seq_k).
    """
    first = max(0, q.shape[2] - k.shape[2]) if causal else 0

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    def grads() -> tuple[Tensor, ...]:
        # torch.func, not torch.autograd: inside a custom op (the backward's fallback) the
        # autograd keys are excluded and enable_grad records nothing.
        _, vjp = torch.func.vjp(attend, q[:, :, first:].detach(), k.detach(), v.detach())
        return vjp(dout[:, :, first:])

    gq, gk, gv = grads()
    if not all(bool(torch.isfinite(g).all()) for g in (gq, gk, gv)):
        # Seen on the H100 (2026-11-24): SDPA's fused backward gives NaN for a negative
        # scale; its math backend, in the same dtype, serves then.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            gq, gk, gv = grads()
    if not first:
        return gq, gk, gv
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dq[:, :, first:] = gq
    return dq, gk, gv


# ---- devices ------------------------------------------------------------------------------

@functools.cache
def device_arch(index: int) -> str:
    """The compile target of CUDA device ``index``: sm_90a on Hopper, sm_XY elsewhere."""
    major, minor = torch.cuda.get_device_capability(index)
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def _sm(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def cubin_runs_on(cubin_arch: str, arch: str) -> bool:
    """Whether machine code for ``cubin_arch`` runs on a device of ``arch``: the same major
    version and no newer minor one; arch-specific targets (sm_90a) only on their own."""
    if cubin_arch.endswith("a"):
        return cubin_arch == arch
    return _sm(cubin_arch) // 10 == _sm(arch) // 10 and _sm(cubin_arch) <= _sm(arch)


try:  # what inductor uses: the raw cudaStream_t as an int, without a Stream object
    _raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


# ---- TMA tensor maps (the wgmma family) -----------------------------------------------------

TMA_FAMILIES = ("wgmma",)
TMA_Q_ROWS = 64  # rows of Q per consumer warpgroup: the box the kernel loads Q in
# cuda.h's enum values (a stable ABI): CUtensorMapDataType, CUtensorMapSwizzle, and the
# 256-byte CUtensorMapL2promotion; interleave and out-of-bounds fill are 0 (none, zeros).
_TMA_DTYPE = {"fp16": 6, "bf16": 9}
_TMA_SWIZZLE = {32: 1, 64: 2, 128: 3}
_TMA_L2_256B = 3
# The TMA launch arguments: 3 tensor maps, O and LSE, 5 int32, 3 int64 strides, 1 float,
# the tile counter (a pointer, 8-byte aligned after the float).
_TMA_ARGS = struct.Struct("=128s128s128s2Q5i4x3qf4xQ")
_TMA_ARG_OFFSETS = (0, 128, 256, 384, 392, *range(400, 420, 4), *range(424, 448, 8), 448, 456)


class TmaParams(NamedTuple):
    """How a TMA kernel is launched, from its family's parameters."""

    swizzle: int  # bytes: the tensor maps' swizzle, whose width (in values) is the box's
    block_n: int  # rows of K and V per box
    persistent: bool  # one block per SM, each looping over tiles
    dynamic: bool = False  # persistent blocks draw tiles from a zeroed counter in global memory


def tma_params(family: str, params: Mapping[str, Any]) -> TmaParams | None:
    """The TMA launch of a candidate of ``family``, or None for a pointer-ABI family.

    Specs exported before the wgmma space had SCHEDULER lack it: those kernels are static.
    """
    if family not in TMA_FAMILIES:
        return None
    return TmaParams(int(params["SWIZZLE"]), int(params["BLOCK_N"]), bool(params["PERSISTENT"]),
                     params.get("SCHEDULER", "static") == "dynamic")


class TmaGeometry(NamedTuple):
    """What ``cuTensorMapEncodeTiled`` gets for one tensor, innermost dimension first."""

    dims: tuple[int, int, int, int]  # (head_dim, seq, heads, batch)
    strides: tuple[int, int, int]  # bytes, of dims 1..3
    box: tuple[int, int, int, int]
    swizzle: int  # bytes


def tma_geometry(shape: tuple[int, ...], strides: tuple[int, ...], elem_bytes: int, rows: int,
                 swizzle: int) -> TmaGeometry:
    """The tiled view of a ``[B, H, S, D]`` tensor with element ``strides``: boxes of one
    swizzle panel (swizzle / elem_bytes values) by ``rows`` rows.

    TMA wants byte strides that are multiples of 16 below 2^40; a dimension of size 1 is
    never stepped over, so its stride (which torch leaves arbitrary) is replaced by a legal
    one. Strides need not be ordered: [B, S, H, D] storage seen as [B, H, S, D] is fine.
    """
    b, h, s, d = shape
    if swizzle not in _TMA_SWIZZLE:
        raise ValueError(f"swizzle must be one of {sorted(_TMA_SWIZZLE)} bytes, got {swizzle}")
    panel = swizzle // elem_bytes
    if d % panel:
        raise ValueError(f"head_dim {d} is not a whole number of {panel}-value panels")
    if strides[3] != 1:
        raise ValueError(f"the last dim must be contiguous, got strides {strides}")
    out = []
    for size, stride in ((s, strides[2]), (h, strides[1]), (b, strides[0])):
        nbytes = stride * elem_bytes
        if size == 1:
            nbytes = 16 * max(1, -(-nbytes // 16))
        if nbytes <= 0 or nbytes % 16 or nbytes >= 1 << 40:
            raise ValueError(f"TMA needs byte strides that are positive multiples of 16, "
                             f"got element strides {strides}")
        out.append(nbytes)
    return TmaGeometry((d, s, h, b), (out[0], out[1], out[2]), (panel, rows, 1, 1), swizzle)


def tma_grid(block_m: int, seq_q: int, heads: int, batch: int, persistent: bool,
             sms: int) -> tuple[int, int]:
    """(blocks, tiles): one block per tile, or at most one per SM when persistent."""
    tiles = -(-seq_q // block_m) * heads * batch
    return (min(tiles, sms) if persistent else tiles), tiles


@functools.cache
def _tensor_map_encoder() -> Callable[..., int]:
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch and cupy already use
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tensor_map(address: int, geometry: TmaGeometry, dtype: str) -> bytes:
    """The 128 bytes of a CUtensorMap (zero fill out of range, 256-byte L2 promotion)."""
    raw = ctypes.create_string_buffer(128 + 64)  # the map must be 64-byte aligned
    at = -ctypes.addressof(raw) % 64 + ctypes.addressof(raw)
    err = _tensor_map_encoder()(
        at, _TMA_DTYPE[dtype], 4, address, (ctypes.c_uint64 * 4)(*geometry.dims),
        (ctypes.c_uint64 * 3)(*geometry.strides), (ctypes.c_uint32 * 4)(*geometry.box),
        (ctypes.c_uint32 * 4)(1, 1, 1, 1), 0, _TMA_SWIZZLE[geometry.swizzle], _TMA_L2_256B, 0)
    if err != 0:
        raise ValueError(f"cuTensorMapEncodeTiled refused {geometry} at {address:#x}: "
                         f"CUresult {err}")
    return ctypes.string_at(at, 128)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---- one kernel -----------------------------------------------------------------------------

class _Loaded(NamedTuple):
    """A kernel loaded on one device: what the hot path needs, and what keeps it alive."""

    fn: int  # CUfunction
    ctx: int  # the device's primary CUcontext, which torch and cupy share
    launch: Callable[..., None]  # cupy.cuda.driver.launchKernel
    get_ctx: Callable[[], int]  # cuCtxGetCurrent
    set_ctx: Callable[[int], None]  # cuCtxSetCurrent
    owner: object  # the cupy module; unloading it would free the function


class CudaKernel:
    """One attention kernel: machine code for one target and/or its CUDA source.

    Loads on first use per device: the cubin where it runs on that device, otherwise the
    source compiled there with cupy's NVRTC. ``kernel(q, k, v, scale=, out=, lse=)`` is the
    call the validation criterion makes; ``launch`` is the unchecked hot path.
    """

    def __init__(self, name: str, *, head_dim: int, dtype: str, causal: bool, block_m: int,
                 threads: int, smem_bytes: int, arch: str | None = None,
                 cubin: bytes | None = None, source: str | None = None,
                 defines: Mapping[str, int] | None = None,
                 tma: TmaParams | None = None, entry: str = KERNEL_NAME) -> None:
        if cubin is None and source is None:
            raise ValueError(f"kernel {name} needs a cubin or a source")
        if cubin is not None and arch is None:
            raise ValueError(f"kernel {name}: a cubin needs the arch it was built for")
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"kernel {name}: dtype must be one of {sorted(KERNEL_DTYPES)}")
        self.name = name
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self.causal = bool(causal)
        self.block_m = int(block_m)
        self.threads = int(threads)
        self.smem_bytes = int(smem_bytes)
        self.arch = arch
        self.cubin = cubin
        self.source = source
        self.defines = dict(defines or {})
        self.tma = tma
        self.entry = entry  # the function of the cubin or source (a backward has several)
        self._maps: dict[tuple, bytes] = {}  # tensor maps by (pointer, shape, strides, rows)
        self._loaded: dict[int, _Loaded] = {}
        self._load_lock = threading.Lock()
        # One argument buffer per kernel, and the array of pointers into it that
        # cuLaunchKernel takes; the lock keeps a packed buffer intact until the launch.
        packing, offsets = (_TMA_ARGS, _TMA_ARG_OFFSETS) if tma else (_ARGS, _ARG_OFFSETS)
        self._args = ctypes.create_string_buffer(packing.size)
        base = ctypes.addressof(self._args)
        self._argv = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CudaKernel({self.name!r})"

    def load(self, index: int) -> _Loaded:
        """Load on CUDA device ``index`` (once); raises ``NoKernelError`` where it cannot run."""
        loaded = self._loaded.get(index)
        if loaded is not None:
            return loaded
        with self._load_lock:
            if index not in self._loaded:
                self._loaded[index] = self._load(index)
        return self._loaded[index]

    def _load(self, index: int) -> _Loaded:
        import cupy
        from cupy.cuda import driver, runtime

        arch = device_arch(index)
        if _sm(arch) < MIN_SM:
            raise NoKernelError(f"kernel {self.name} needs sm_{MIN_SM} or newer; cuda:{index} "
                                f"is {arch}")
        if self.tma is not None and arch != "sm_90a":  # wgmma, setmaxnreg: Hopper's own
            raise NoKernelError(f"kernel {self.name} needs sm_90a (wgmma and TMA); cuda:{index} "
                                f"is {arch}")
        with cupy.cuda.Device(index):
            runtime.setDevice(index)  # binds the primary context, even in a fresh thread
            limit = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               index)
            if self.smem_bytes > limit:
                raise NoKernelError(f"kernel {self.name} needs {self.smem_bytes} bytes of shared "
                                    f"memory; cuda:{index} ({arch}) offers {limit}")
            fn, owner = None, None
            if self.cubin is not None and cubin_runs_on(self.arch or "", arch):
                try:
                    owner = cupy.cuda.function.Module()
                    owner.load(self.cubin)
                    fn = owner.get_function(self.entry)
                except driver.CUDADriverError as e:
                    if self.source is None:
                        raise
                    warnings.warn(f"evoengine: the driver refused the cubin of {self.name} "
                                  f"({e}); compiling its source instead", RuntimeWarning,
                                  stacklevel=3)
            if fn is None:
                if self.source is None:
                    raise NoKernelError(f"kernel {self.name} was built for {self.arch} and "
                                        f"carries no source to build for cuda:{index} ({arch})")
                if self.cubin is not None and not cubin_runs_on(self.arch or "", arch):
                    warnings.warn(f"evoengine: kernel {self.name} was tuned and built for "
                                  f"{self.arch}; compiling its source for {arch} (its timings "
                                  "may differ there)", RuntimeWarning, stacklevel=3)
                fn, owner = self._compile(arch, limit)
            driver.funcSetAttribute(
                fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem_bytes)
            return _Loaded(fn.ptr, driver.ctxGetCurrent(), driver.launchKernel,
                           driver.ctxGetCurrent, driver.ctxSetCurrent, (owner, fn))

    def _compile(self, arch: str, smem_limit: int) -> tuple[Any, Any]:
        import cupy

        # The target is named: cupy's own choice for a 9.0 device is plain sm_90, without
        # wgmma/setmaxnreg.
        defines = {**self.defines, "EVO_SMEM_LIMIT": smem_limit}
        options = (*NVRTC_OPTIONS, f"-arch={arch}", *(f"-D{k}={v}" for k, v in defines.items()))
        try:
            module = cupy.RawModule(code=self.source, options=options)
            kernel = module.get_function(self.entry)  # a RawKernel; .kernel compiles it
            return kernel.kernel, module
        except Exception as e:  # cupy's CompileException carries the log
            raise RuntimeError(f"compiling kernel {self.name} for {arch} failed: {e}") from e

    def launch(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor | None,
               p: Problem, scale: float) -> None:
        """Launch on torch's current stream, without checks (inputs already validated)."""
        if self.tma is not None:
            self._launch_tma(q, k, v, out, lse, p, scale)
            return
        index = q.get_device()
        loaded = self._loaded.get(index) or self.load(index)
        qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
        stream = _raw_stream(index)
        grid_x = (p.seq_q + self.block_m - 1) // self.block_m
        with self._lock:
            _ARGS.pack_into(
                self._args, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                0 if lse is None else lse.data_ptr(), p.seq_q, p.seq_k, p.heads,
                p.heads // p.kv_heads, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1],
                vs[2], os_[0], os_[1], os_[2], scale * LOG2E)
            _launch_in_context(loaded, (loaded.fn, grid_x, p.heads, p.batch, self.threads, 1, 1,
                                        self.smem_bytes, stream, self._argv_ptr, 0))

    def _tensor_map(self, t: Tensor, rows: int) -> bytes:
        assert self.tma is not None
        key = (t.data_ptr(), tuple(t.shape), t.stride(), rows)
        found = self._maps.get(key)
        if found is None:
            geometry = tma_geometry(tuple(t.shape), t.stride(), t.element_size(), rows,
                                    self.tma.swizzle)
            found = encode_tensor_map(t.data_ptr(), geometry, self.dtype)
            if len(self._maps) >= 64:  # lengths vary without bound; keep the cache small
                self._maps.clear()
            self._maps[key] = found
        return found

    def _launch_tma(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor | None,
                    p: Problem, scale: float) -> None:
        assert self.tma is not None
        index = q.get_device()
        loaded = self._loaded.get(index) or self.load(index)
        grid, tiles = tma_grid(self.block_m, p.seq_q, p.heads, p.batch, self.tma.persistent,
                               _sm_count(index))
        maps = (self._tensor_map(q, TMA_Q_ROWS), self._tensor_map(k, self.tma.block_n),
                self._tensor_map(v, self.tma.block_n))
        os_ = out.stride()
        stream = _raw_stream(index)
        # A fresh counter per launch, zeroed on this stream before the kernel runs: launches on
        # other streams, replays of a captured graph, and a launch after one that trapped each
        # start from zero. Dropping it after the launch is enqueued is safe: the caching
        # allocator hands the block out again only to work ordered after this stream's kernel.
        counter = torch.zeros(1, dtype=torch.int32, device=q.device) if self.tma.dynamic else None
        with self._lock:
            _TMA_ARGS.pack_into(
                self._args, 0, *maps, out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                p.seq_q, p.seq_k, p.heads, p.heads // p.kv_heads, tiles, os_[0], os_[1], os_[2],
                scale * LOG2E, 0 if counter is None else counter.data_ptr())
            _launch_in_context(loaded, (loaded.fn, grid, 1, 1, self.threads, 1, 1,
                                        self.smem_bytes, stream, self._argv_ptr, 0))
        del counter  # only now: the launch has read its address

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                 out: Tensor | None = None, lse: Tensor | None = None) -> Tensor:
        """Attention of q over k, v. ``lse`` (float32 [B, H, Sq]) receives the log-sum-exp."""
        p = check_inputs(q, k, v, head_dim=self.head_dim, dtype=self.dtype)
        _check_grid(p)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        check_out(out, q, lse, p)
        self.launch(q, k, v, out, lse, p, softmax_scale(scale, p.head_dim))
        return out


def _launch_in_context(loaded: _Loaded, args: tuple) -> None:
    """cuLaunchKernel in the kernel's device context, whatever context the thread has."""
    current = loaded.get_ctx()
    if current == loaded.ctx:
        loaded.launch(*args)
    elif current == 0:  # a thread with no context yet: bind it, as the runtime would
        loaded.set_ctx(loaded.ctx)
        loaded.launch(*args)
    else:  # another device is current: launch in this one's, then give it back
        loaded.set_ctx(loaded.ctx)
        try:
            loaded.launch(*args)
        finally:
            loaded.set_ctx(current)


def _check_grid(p: Problem) -> None:
    if p.heads > _MAX_GRID_YZ or p.batch > _MAX_GRID_YZ:
        raise ValueError(f"batch and heads must be at most {_MAX_GRID_YZ} (CUDA grid limit), "
                         f"got batch {p.batch}, heads {p.heads}")


# ---- the backward pass ----------------------------------------------------------------------

BACKWARD_ENTRIES = ("attn_bwd_pre", "attn_bwd", "attn_bwd_post")
# The launch shapes of the first and last kernels, as the template's cfg::PRE_THREADS,
# PRE_ROWS and POST_THREADS (tests/test_backward.py reads them from a rendered source).
PRE_THREADS = 256
PRE_ROWS = 32
POST_THREADS = 256


class ParamBuffer:
    """One kernel's parameter layout: fields at their natural alignment, as the kernel's
    parameter space lays them out (``codes``: struct letters, Q a pointer, q an int64, i an
    int32, f a float)."""

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
        """(buffer, pointer array that cuLaunchKernel takes); both must live until the launch
        has been enqueued."""
        buf = ctypes.create_string_buffer(self.struct.size)
        self.struct.pack_into(buf, 0, *values)
        base = ctypes.addressof(buf)
        argv = (ctypes.c_void_p * len(self.offsets))(*(base + o for o in self.offsets))
        return buf, argv


BWD_PRE_ARGS = ParamBuffer("QQQQQQ" + "iii" + "q" * 6)
BWD_MAIN_ARGS = ParamBuffer("Q" * 10 + "i" * 5 + "q" * 18 + "ff")
BWD_POST_ARGS = ParamBuffer("QQQ" + "iii" + "qqq" + "f")


def check_like(name: str, t: object, like: Tensor, like_name: str) -> Tensor:
    """``t`` must have ``like``'s shape, dtype and device, a contiguous last dim and 16-byte
    aligned rows (any other strides)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must match {like_name}: {tuple(like.shape)} {like.dtype} on "
                         f"{like.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if not _rows_aligned(t):
        raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows, "
                         f"got strides {t.stride()}")
    return t


class CudaBackward:
    """One backward kernel (three entries of one cubin or source):
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)``.

    ``out`` and ``lse`` are the forward's output and natural-log log-sum-exp (float32
    [B, H, Sq], contiguous; -inf on rows that see no key), as the forward kernels write them.
    ``deterministic=True`` (or a kernel built with ``dq_accum="separate"``) stores dQ per key
    block and sums the parts in order: bit-identical results run to run, at the cost of one
    fp32 dQ per key block of workspace. Loads on first use per device.
    """

    def __init__(self, name: str, *, head_dim: int, dtype: str, causal: bool, block_m: int,
                 block_n: int, threads: int, smem_bytes: int, dq_accum: str,
                 arch: str | None = None, cubin: bytes | None = None,
                 source: str | None = None,
                 defines: Mapping[str, int] | None = None) -> None:
        if dq_accum not in ("atomic", "separate"):
            raise ValueError(f"kernel {name}: dq_accum must be 'atomic' or 'separate', "
                             f"got {dq_accum!r}")
        common: dict[str, Any] = dict(head_dim=head_dim, dtype=dtype, causal=causal,
                                      block_m=block_m, arch=arch, cubin=cubin, source=source,
                                      defines=defines)
        pre, main, post = BACKWARD_ENTRIES
        self.pre = CudaKernel(f"{name}:{pre}", threads=PRE_THREADS, smem_bytes=0, entry=pre,
                              **common)
        self.main = CudaKernel(name, threads=threads, smem_bytes=smem_bytes, entry=main,
                               **common)
        self.post = CudaKernel(f"{name}:{post}", threads=POST_THREADS, smem_bytes=0,
                               entry=post, **common)
        self.name, self.arch, self.cubin, self.source = name, arch, cubin, source
        self.head_dim, self.dtype, self.causal = self.main.head_dim, dtype, self.main.causal
        self.block_m, self.block_n = self.main.block_m, int(block_n)
        self.dq_accum = dq_accum

    def __repr__(self) -> str:
        return f"CudaBackward({self.name!r})"

    def load(self, index: int) -> None:
        """Load the three kernels on CUDA device ``index`` (once each); raises
        ``NoKernelError`` where they cannot run."""
        for kernel in (self.pre, self.main, self.post):
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
        check_like("out", out, q, "q")
        check_like("dout", dout, q, "q")
        if not isinstance(lse, Tensor):
            raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
        if (lse.shape != (p.batch, p.heads, p.seq_q) or lse.dtype != torch.float32
                or not lse.is_contiguous() or lse.device != q.device):
            raise ValueError(f"lse must be a contiguous float32 [{p.batch}, {p.heads}, "
                             f"{p.seq_q}] on {q.device}, got {tuple(lse.shape)} {lse.dtype} "
                             f"on {lse.device}")
        scale = softmax_scale(scale, p.head_dim)
        new = dict(memory_format=torch.contiguous_format)
        dq = torch.empty_like(q, **new) if dq is None else check_like("dq", dq, q, "q")
        dk = torch.empty_like(k, **new) if dk is None else check_like("dk", dk, k, "k")
        dv = torch.empty_like(v, **new) if dv is None else check_like("dv", dv, v, "v")
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
        pre, main, post = (kernel.load(index) for kernel in (self.pre, self.main, self.post))
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

        args = BWD_PRE_ARGS.pack(out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                                 lse2.data_ptr(), delta.data_ptr(), acc_ptr, sq, h, seq_q_pad,
                                 *out.stride()[:3], *dout.stride()[:3])
        _launch_in_context(pre, (pre.fn, -(-seq_q_pad // PRE_ROWS), h, b, PRE_THREADS, 1, 1,
                                 0, stream, ctypes.addressof(args[1]), 0))
        strides = [s for t in (q, k, v, dout, dk, dv) for s in t.stride()[:3]]
        args = BWD_MAIN_ARGS.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(),
                                  lse2.data_ptr(), delta.data_ptr(), acc_ptr, part_ptr,
                                  dk.data_ptr(), dv.data_ptr(), sq, sk, h, h // hkv, seq_q_pad,
                                  *strides, scale, scale * LOG2E)
        _launch_in_context(main, (main.fn, n_blocks, hkv, b, self.main.threads, 1, 1,
                                  self.main.smem_bytes, stream, ctypes.addressof(args[1]), 0))
        args = BWD_POST_ARGS.pack(acc_ptr, part_ptr, dq.data_ptr(), sq, sk, h,
                                  *dq.stride()[:3], scale)
        chunks = sq * (d // 8)
        _launch_in_context(post, (post.fn, -(-chunks // POST_THREADS), h, b, POST_THREADS, 1, 1,
                                  0, stream, ctypes.addressof(args[1]), 0))
        del rows, acc, part  # only now: every launch has read their addresses


# ---- what an export carries -----------------------------------------------------------------

def pack_cubin(cubin: bytes) -> str:
    """Cubin bytes as compressed base64 text, 76 characters a line, for a Python literal."""
    return base64.encodebytes(zlib.compress(cubin, 9)).decode()


def unpack_cubin(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def kernel_from_spec(spec: Mapping[str, Any], arch: str | None) -> CudaKernel | CudaBackward:
    """A kernel from an export's spec (a ``CudaBackward`` where its ``kind`` is ``bwd``; specs
    exported before kinds existed are forward), after checking its source and cubin against
    their recorded sha256; an altered one raises ``IntegrityError``."""
    name = spec["name"]
    source, cubin = spec.get("source"), spec.get("cubin")
    if source is not None and sha256(source) != spec["source_sha256"]:
        raise IntegrityError(f"the CUDA source of kernel {name} does not match its recorded "
                             "sha256: this module was altered; export it again")
    if isinstance(cubin, str):
        try:
            cubin = unpack_cubin(cubin)
        except (ValueError, zlib.error):
            raise IntegrityError(f"the cubin of kernel {name} is corrupt: this module was "
                                 "altered; export it again") from None
    if cubin is not None and sha256(cubin) != spec["cubin_sha256"]:
        raise IntegrityError(f"the cubin of kernel {name} does not match its recorded sha256: "
                             "this module was altered; export it again")
    problem, kind = spec["problem"], spec.get("kind", "fwd")
    if kind == "bwd":
        params = spec["params"]
        return CudaBackward(name, head_dim=problem["HEAD_DIM"], dtype=problem["DTYPE"],
                            causal=problem["CAUSAL"], block_m=spec["block_m"],
                            block_n=params["BLOCK_N"], threads=spec["threads"],
                            smem_bytes=spec["smem_bytes"], dq_accum=params["DQ_ACCUM"],
                            arch=arch, cubin=cubin, source=source,
                            defines=spec.get("defines"))
    if kind != "fwd":
        raise ValueError(f"kernel {name} is of kind {kind!r}; this launcher knows "
                         f"{', '.join(KINDS)}")
    return CudaKernel(name, head_dim=problem["HEAD_DIM"], dtype=problem["DTYPE"],
                      causal=problem["CAUSAL"], block_m=spec["block_m"],
                      threads=spec["threads"], smem_bytes=spec["smem_bytes"], arch=arch,
                      cubin=cubin, source=source, defines=spec.get("defines"),
                      tma=tma_params(spec.get("family", ""), spec.get("params", {})))


@dataclass(frozen=True)
class Entry:
    """One line of the dispatch table: the kernel tuned for one workload."""

    kernel: int  # index into the kernel list
    dtype: str
    head_dim: int
    causal: bool
    seq_q: int
    seq_k: int
    batch: int
    heads: int
    median_us: float | None = None
    workload: str = ""
    kind: str = "fwd"  # which problem the kernel solves: "fwd" or "bwd" (KINDS)

    @property
    def key(self) -> tuple[str, int, bool]:
        return (self.dtype, self.head_dim, self.causal)


def dispatch_table(entries: Iterable[Entry],
                   kind: str = "fwd") -> dict[tuple[str, int, bool], tuple[Entry, ...]]:
    """The entries of ``kind`` grouped by (dtype, head_dim, causal), each group sorted by
    tuned length."""
    table: dict[tuple[str, int, bool], list[Entry]] = {}
    for e in entries:
        if e.kind == kind:
            table.setdefault(e.key, []).append(e)
    return {key: tuple(sorted(group, key=lambda e: (e.seq_k, e.seq_q, e.batch * e.heads)))
            for key, group in sorted(table.items())}


def nearest(entries: Iterable[Entry], seq_q: int, seq_k: int, rows: int) -> Entry:
    """The entry tuned nearest the call: closest (seq_q, seq_k) in log scale (sum of the
    absolute log ratios); among entries at the same lengths, closest batch x heads. Ties go
    to the entry listed first (the shorter)."""
    def distance(e: Entry) -> tuple[float, float]:
        return (abs(math.log(seq_q / e.seq_q)) + abs(math.log(seq_k / e.seq_k)),
                abs(math.log(rows / (e.batch * e.heads))))
    return min(entries, key=distance)


def describe(key: tuple[str, int, bool]) -> str:
    dtype, head_dim, causal = key
    return f"{dtype} head_dim {head_dim} {'causal' if causal else 'non-causal'}"


# ---- the tuned attention function ---------------------------------------------------------

# How many TorchDispatchModes are active (FakeTensorMode, FlopCounterMode, ...): calls under
# one go through the custom op, so that the mode sees it.
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_mode", lambda: 0)


class TunedAttention:
    """``attention(q, k, v, causal=False, scale=None)`` over a table of tuned kernels.

    Picks the kernel tuned for the call's (dtype, head_dim, causal) at the nearest sequence
    lengths (``nearest``). Eager calls launch directly; under ``torch.compile``, a dispatch
    mode or autograd the call goes through the ``torch.library`` custom op
    ``<namespace>::attention``, which does the same thing and is differentiable: its
    autograd formula is the custom op ``<namespace>::attention_backward``, which launches
    the backward kernel tuned nearest the call (entries of kind ``bwd``).
    """

    def __init__(self, kernels: list[CudaKernel | CudaBackward], entries: Iterable[Entry], *,
                 namespace: str, provenance: Mapping[str, Any] | None = None) -> None:
        self.kernels = list(kernels)
        self.entries = tuple(entries)
        self.table = dispatch_table(self.entries)
        self.backward_table = dispatch_table(self.entries, "bwd")
        self._tables = {"fwd": self.table, "bwd": self.backward_table}
        for e in self.entries:
            if e.kind not in KINDS:
                raise ValueError(f"dispatch entry {e.workload} is of kind {e.kind!r}; this "
                                 f"launcher knows {', '.join(KINDS)}")
            k = self.kernels[e.kernel]
            if (isinstance(k, CudaBackward) != (e.kind == "bwd")
                    or (k.dtype, k.head_dim, k.causal) != e.key):
                raise ValueError(f"dispatch entry {e.workload} names kernel {k.name}, "
                                 f"which is compiled for another problem")
        self.provenance = dict(provenance or {})
        self._choices: dict[tuple, Any] = {}
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

    def _kernel_for(self, q: Tensor, p: Problem, causal: bool, kind: str = "fwd") -> Any:
        """The kernel of ``kind`` for a call, or None (no kernel for its key, or a GPU it
        cannot run on); memoised, since a model makes the same calls over and over."""
        index = q.get_device()
        key = (q.dtype, p.head_dim, causal, p.seq_q, p.seq_k, p.batch * p.heads, index, kind)
        try:
            return self._choices[key]
        except KeyError:
            pass
        dtype = _DTYPE_NAMES.get(q.dtype)
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
        what = "kernel" if kind == "fwd" else "backward kernel"
        have = "; ".join(describe(key) for key in self._tables[kind]) or "none"
        return (f"no tuned {what} for {q.dtype} head_dim {head_dim} "
                f"{'causal' if causal else 'non-causal'}; this module has {what}s for: "
                f"{have}." + hint)

    def _plan(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None,
              fallback: str | None) -> tuple[Problem, bool, float, CudaKernel | None]:
        """A forward call's checked shapes, causal flag, scale and kernel (None: SDPA)."""
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be None or 'sdpa', got {fallback!r}")
        p = check_inputs(q, k, v, any_float=fallback is not None)
        _check_grid(p)
        causal = bool(causal)
        scale = softmax_scale(scale, p.head_dim)
        kernel = self._kernel_for(q, p, causal)
        if kernel is None and fallback is None:
            raise NoKernelError(self.no_kernel(q, p.head_dim, causal))
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
        if out is None:
            out = self._output(q, p, bshd)
        else:
            check_out(out, q, lse, p)
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
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be None or 'sdpa', got {fallback!r}")
        p = check_inputs(q, k, v, any_float=fallback is not None)
        causal = bool(causal)
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
        if not _rows_aligned(dout):  # autograd hands out what it has: expanded ones, views
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
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad)
        # The custom op costs tens of microseconds per eager call in the dispatcher, so plain
        # tensors outside compile, dispatch modes and autograd skip it and run the same code.
        if (not compiling and not grad and type(q) is Tensor and type(k) is Tensor
                and type(v) is Tensor and not _dispatch_modes()):
            return self.forward(q, k, v, causal=causal, scale=scale, fallback=fallback,
                                bshd=bshd)
        return self._op(q, k, v, causal, scale, fallback, bshd, grad)[0]

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
        check_inputs(q, k, v, any_float=fallback is not None, pointers=False)
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


# ---- Hugging Face Transformers --------------------------------------------------------------

# Keyword arguments of Transformers' attention calls that change the result: a kernel that
# ignored them would be silently wrong.
_HF_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def transformers_attention(attention_fn: Callable[..., Tensor], *,
                           fallback: str | None = None) -> Callable[..., tuple[Tensor, None]]:
    """A Transformers attention function (``AttentionInterface``) around
    ``attention_fn(q, k, v, causal=, scale=) -> [B, H, S, D]``.

    Mirrors Transformers' SDPA integration: causal comes from ``is_causal`` or
    ``module.is_causal``, holds only with more than one query and no mask, and a causal
    call with more keys than queries is a prefill into an empty static cache (aligned
    top-left), so the keys past the queries are dropped. Masks, dropout, sliding windows,
    soft-capping and sinks are refused, or handed to Transformers' SDPA with
    ``fallback='sdpa'``.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be None or 'sdpa', got {fallback!r}")

    def evoengine_attention(module: torch.nn.Module, query: Tensor, key: Tensor,
                            value: Tensor, attention_mask: Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None,
                            **kwargs: Any) -> tuple[Tensor, None]:
        unsupported = [name for name in _HF_UNSUPPORTED if kwargs.get(name) is not None]
        if attention_mask is not None:
            unsupported.append("an attention mask (padding or a custom pattern)")
        if dropout:
            unsupported.append(f"dropout {dropout}")
        if unsupported:
            if fallback == "sdpa":
                from transformers.integrations.sdpa_attention import sdpa_attention_forward

                return sdpa_attention_forward(module, query, key, value, attention_mask,
                                              dropout=dropout, scaling=scaling,
                                              is_causal=is_causal, **kwargs)
            raise ValueError(f"evoengine attention cannot serve {', '.join(unsupported)}; "
                             "register it with fallback='sdpa' to let SDPA serve such calls")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = q_len > 1 and bool(causal)
        if causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = attention_fn(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2), None

    return evoengine_attention


def register_hf(attention_fn: Callable[..., Tensor], name: str = "evoengine", *,
                fallback: str | None = None) -> str:
    """Register ``attention_fn`` as ``attn_implementation=name`` in Transformers.

    The mask function registered beside it is SDPA's, which builds no mask where causality
    alone describes the call and a real one where there is padding: without it Transformers
    would build no mask at all for an unknown implementation, and padding would be ignored.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if isinstance(attention_fn, TunedAttention):  # write straight into [B, S, H, D] storage
        attention_fn = functools.partial(attention_fn, bshd=True, fallback=fallback)
    AttentionInterface.register(name, transformers_attention(attention_fn, fallback=fallback))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
