"""What every launcher module shares: the errors, the input checks, SDPA with the kernels'
semantics (the reference and the fallback), devices, loading a cubin or compiling a source
with cupy, launching in a device's context, and packing kernel parameters.

``evoengine.launch`` is the one launcher of the project (its ``__init__`` says how the modules
fit together). Like every module of the package it imports nothing but torch, cupy (lazily: a
module built on it still imports on a machine without a GPU) and the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import struct
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")  # what a call made in a kernel's context returns

LOG2E = 1.4426950408889634
KERNEL_NAME = "attn_fwd"
KERNEL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in KERNEL_DTYPES.items()}
FALLBACKS = (None, "sdpa")
MIN_SM = 80  # cp.async and mma.sync m16n8k16
# NVRTC's options for every kernel, besides the target and the defines: the one list, which
# evoengine.compile reads from this file (offline builds) and exported modules carry (builds
# on another GPU). -default-device: NVRTC 13.0 (the GPU box's) treats a lambda in a kernel as
# a host function unless told that unannotated functions are device code; 13.5 does not care.
NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization")
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z: heads and batch


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


# What the SDPA fallback takes besides the kernels' dtypes.
FALLBACK_DTYPES = (torch.float32, torch.float64)


def check_tensor(name: str, t: object, rank: int, layout: str) -> Tensor:
    """``t`` a CUDA tensor of ``rank`` dims (``layout`` names them), in one line naming
    ``name`` and what was expected."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got {tuple(t.shape)}")
    return t


def check_dtype(name: str, t: Tensor, any_float: bool = False) -> None:
    """A kernel dtype, or with ``any_float`` (the SDPA fallback) float32/float64 too."""
    if t.dtype in DTYPE_NAMES or (any_float and t.dtype in FALLBACK_DTYPES):
        return
    if any_float:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")


def check_aligned(name: str, t: Tensor, *, pointers: bool = True) -> None:
    """What every kernel reads rows with (16-byte copies): a contiguous last dim, the other
    strides multiples of 8 elements, a 16-byte aligned start (``pointers=False``: fake
    tensors have none). A head dim that is not a multiple of 8 is named as such."""
    if rows_aligned(t, pointers=pointers):
        return
    strides = t.stride()
    if strides[-1] != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {strides}")
    if t.shape[-1] % 8:
        raise ValueError(f"{name}'s head_dim ({t.shape[-1]}) must be a multiple of 8 for the "
                         "kernels (fallback='sdpa' runs SDPA for it)")
    raise ValueError(f"{name} must be 16-byte aligned with strides a multiple of 8 "
                     f"elements, got strides {strides}")


def check_shared(names: str, *tensors: Tensor) -> None:
    """One dtype and one device for ``tensors`` (``names`` says which, e.g. "q, k, v")."""
    dtype, device = tensors[0].dtype, tensors[0].device
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise ValueError(f"{names} must share a dtype, got "
                             f"{', '.join(str(t.dtype) for t in tensors)}")
        if t.device != device:
            raise ValueError(f"{names} must be on one device, got "
                             f"{', '.join(str(t.device) for t in tensors)}")


def check_fallback(fallback: object) -> None:
    """What serves a call that no tuned kernel fits: ``None`` (``NoKernelError``) or
    ``"sdpa"``."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be None or 'sdpa', got {fallback!r}")


def check_flag(name: str, value: object) -> bool:
    """A bool (or 0/1): ``causal="no"`` would otherwise be truthy, silently causal."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, head_dim: int | None = None,
                 dtype: str | None = None, any_float: bool = False,
                 pointers: bool = True, aligned: bool = True) -> Problem:
    """Reject what the kernels cannot take, naming what was expected; return the shapes.

    ``any_float`` lets float32/float64 through and ``aligned=False`` any strides (for the
    SDPA fallback, which is not a kernel: a kernel chosen after that checks
    ``check_aligned`` itself); ``pointers=False`` skips the alignment of the data pointers
    (fake tensors have none).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, "[batch, heads, seq, head_dim]")
        check_dtype(name, t, any_float)
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: shape {tuple(t.shape)} (every dim must be >= 1)")
        if aligned and t.dtype in DTYPE_NAMES:
            check_aligned(name, t, pointers=pointers)
    check_shared("q, k, v", q, k, v)
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


def rows_aligned(t: Tensor, *, pointers: bool = True) -> bool:
    """A contiguous last dim, other strides a multiple of 8 values, a 16-byte aligned start
    (not looked at with ``pointers=False``: fake tensors have none)."""
    strides = t.stride()
    # On every eager call: one gcd for "all multiples of 8" (an expanded dim's 0 is one).
    return (strides[-1] == 1 and not math.gcd(*strides[:-1]) % 8
            and not (pointers and t.data_ptr() % 16))


def check_out(out: Tensor | None, q: Tensor, lse: Tensor | None, p: Problem) -> None:
    """Reject an output buffer (and log-sum-exp buffer) that the kernel cannot write; either
    may be None (not given)."""
    if out is not None:
        check_like("out", out, q, "q", none_ok=True)
    if lse is not None:
        if not isinstance(lse, Tensor):
            raise TypeError(f"lse must be a torch.Tensor or None, got {type(lse).__name__}")
        if (lse.shape != (p.batch, p.heads, p.seq_q) or lse.dtype != torch.float32
                or not lse.is_contiguous() or lse.device != q.device):
            raise ValueError(f"lse must be a contiguous float32 [{p.batch}, {p.heads}, "
                             f"{p.seq_q}] on {q.device}, got {tuple(lse.shape)} {lse.dtype} "
                             f"on {lse.device}")


def softmax_scale(scale: object, head_dim: int) -> float:
    """The softmax scale of a call: 1/sqrt(head_dim) for None, else a finite real number
    (negative and zero too: the kernels take them); a string or a tensor is refused, not
    converted (float("0.1") would pass here and fail under torch.compile)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if type(scale) is not float and (isinstance(scale, bool)
                                     or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                   scale: float | None = None) -> Tensor:
    """torch SDPA with the kernels' semantics: GQA, causal aligned bottom-right, and rows
    that see no key equal to zero."""
    import torch.nn.functional as F

    if scale is not None and scale < 0:
        # A negative scale is the positive one applied to -q (negation is exact), as the
        # kernels take it; seen on the H100 (torch 2.11, 2026-11-24), SDPA's causal forward
        # gave NaN for scale -0.2 at 300 x 300, d64.
        q, scale = -q, -scale
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
    # Rows with no key (the first seq_q - seq_k) are defined as zero; SDPA gives NaN on the
    # CPU but, seen on the H100 (torch 2.11, 2026-11-24), values off by up to 0.9 there.
    out = torch.nan_to_num(out, nan=0.0)
    if q.shape[2] > k.shape[2]:
        out[:, :, :q.shape[2] - k.shape[2]] = 0
    return out


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


def sm_number(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def cubin_runs_on(cubin_arch: str, arch: str) -> bool:
    """Whether machine code for ``cubin_arch`` runs on a device of ``arch``: the same major
    version and no newer minor one; arch-specific targets (sm_90a) only on their own."""
    if cubin_arch.endswith("a"):
        return cubin_arch == arch
    have, want = sm_number(cubin_arch), sm_number(arch)
    return have // 10 == want // 10 and have <= want


try:  # what inductor uses: the raw cudaStream_t as an int, without a Stream object
    raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:
    def raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count



# ---- loading and launching -----------------------------------------------------------------

class Loaded(NamedTuple):
    """A kernel loaded on one device: what the hot path needs, and what keeps it alive."""

    fn: int  # CUfunction
    ctx: int  # the device's primary CUcontext, which torch and cupy share
    launch: Callable[..., None]  # cupy.cuda.driver.launchKernel
    get_ctx: Callable[[], int]  # cuCtxGetCurrent
    set_ctx: Callable[[int], None]  # cuCtxSetCurrent
    owner: object  # the cupy module; unloading it would free the function
    # cupy.cuda.driver.launchCooperativeKernel (every block resident at once, or an error)
    launch_cooperative: Callable[..., None] | None = None



def launch_in_context(loaded: Loaded, args: tuple) -> None:
    """cuLaunchKernel in the kernel's device context, whatever context the thread has."""
    in_context(loaded, loaded.launch, *args)


def launch_cooperative_in_context(loaded: Loaded, args: tuple) -> None:
    """cuLaunchCooperativeKernel in the kernel's device context: ``args`` as
    ``launch_in_context``'s, without the trailing ``extra``."""
    if loaded.launch_cooperative is None:
        raise RuntimeError("this kernel was loaded without a cooperative launch")
    in_context(loaded, loaded.launch_cooperative, *args)


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), for the driver's calls that cupy does not wrap. A kernel built
    with __cluster_dims__ carries its cluster shape, which the driver takes from the kernel."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padded to 8 bytes, then a 64-byte union of values."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]


# cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The driver library (OSError where there is none)."""
    return ctypes.CDLL("libcuda.so.1")


def launch_programmatic(fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                        smem_bytes: int, stream: int, params: int) -> None:
    """cuLaunchKernelEx with programmatic stream serialization (sm_90): the kernel may start
    once every block of the kernel before it on the stream has started or run
    ``griddepcontrol.launch_dependents``, and must run ``griddepcontrol.wait`` (which returns
    when that kernel has completed and its writes are visible) before it reads what that kernel
    wrote. Captured into a CUDA graph, it is a programmatic edge. ``params``: the address of
    the kernel's pointer array, as cuLaunchKernel takes it."""
    attr = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = LaunchConfig((gx, gy, gz), (bx, by, bz), smem_bytes, stream,
                          ctypes.addressof(attr), 1)
    err = libcuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(fn),
                                     ctypes.c_void_p(params), None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx with programmatic serialization failed: "
                           f"CUDA driver error {err}")


def launch_programmatic_in_context(loaded: Loaded, args: tuple) -> None:
    """``launch_programmatic`` in the kernel's device context: ``args`` as
    ``launch_in_context``'s, without the trailing ``extra``."""
    in_context(loaded, launch_programmatic, *args)


def in_context(loaded: Loaded, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a driver or runtime call) in the kernel's device context, whatever
    context the thread has; its result."""
    current = loaded.get_ctx()
    if current == loaded.ctx:
        return fn(*args)
    loaded.set_ctx(loaded.ctx)
    if current == 0:  # a thread with no context yet: bind it, as the runtime would
        return fn(*args)
    try:  # another device is current: call in this one's, then give it back
        return fn(*args)
    finally:
        loaded.set_ctx(current)


def zero_int32(address: int, stream: int) -> None:
    """Zero the int32 at ``address`` on ``stream`` (cudaMemsetAsync; in the current context)."""
    _memset_async()(address, 0, 4, stream)


@functools.cache
def _memset_async() -> Callable[[int, int, int, int], None]:
    from cupy.cuda import runtime

    return runtime.memsetAsync  # type: ignore[no-any-return]


def check_grid(p: Problem) -> None:
    check_grid_dims(p.batch, p.heads)


def check_grid_dims(batch: int, heads: int, heads_name: str = "heads") -> None:
    """The grid's y and z dims (heads and batch) within CUDA's limit."""
    if heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"batch and {heads_name} must be at most {MAX_GRID_YZ} (CUDA grid "
                         f"limit), got batch {batch}, {heads_name} {heads}")



class ParamBuffer:
    """One kernel's parameter layout: fields at their natural alignment, as the kernel's
    parameter space lays them out (``codes``: struct letters, Q a pointer, q an int64, i an
    int32, f a float; M a 128-byte CUtensorMap, 64-byte aligned, packed from ``bytes``)."""

    def __init__(self, codes: str) -> None:
        fmt, offsets, at = "=", [], 0
        for code in codes:
            field, size, align = (("128s", 128, 64) if code == "M" else
                                  (code, struct.calcsize("=" + code), struct.calcsize("=" + code)))
            pad = -at % align
            fmt += f"{pad}x{field}" if pad else field
            offsets.append(at + pad)
            at += pad + size
        self.codes = codes
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



def check_like(name: str, t: object, like: Tensor, like_name: str, *,
               none_ok: bool = False) -> Tensor:
    """``t`` must have ``like``'s shape, dtype and device, a contiguous last dim and 16-byte
    aligned rows (any other strides). ``none_ok``: the argument may be None (the caller
    handles that), as the type error says."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if none_ok else ''}, "
                        f"got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must match {like_name}: {tuple(like.shape)} {like.dtype} on "
                         f"{like.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if not rows_aligned(t):
        raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows, "
                         f"got strides {t.stride()}")
    return t
