"""Decode over a KV cache: a few new query tokens per sequence against a contiguous or paged
cache of per-sequence length (the ``decode`` problem kind; kernels of ``templates/decode``).

Layouts, as FlashAttention's ``flash_attn_with_kvcache`` and vLLM take them: q
[batch, q_len, q_heads, D] (q_len 1..16); a contiguous cache k, v [batch, max_len, kv_heads, D]
or a paged one [num_pages, page_size, kv_heads, D] with an int32 ``block_table``
[batch, max_pages] (page j of sequence b is ``block_table[b, j]``; pages anywhere in memory);
int32 ``cache_seqlens`` [batch], each sequence's length including the new tokens. Causal is
aligned bottom-right: query i of q_len sees the first ``cache_len - q_len + i + 1`` keys.

Kernel ABI (two entries of one cubin, launched in order on torch's current stream):

- ``attn_decode(Q, K, V, O, LSE, O_part, LSE_part, counters, seqlens, block_table, q_len,
  q_heads, kv_group, row_chunks, causal, page_log2, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss,
  v_sh, o_sb, o_ss, o_sh, bt_stride, scale_log2)`` on (splits, kv_heads * row_chunks, batch)
  blocks: each takes ``block_m`` of one key/value head's q_len x group packed query rows and
  one split of its cache. k_sb/v_sb are the page strides of a paged cache. With one split it
  writes O (and LSE, natural log, float32 [B, H, q_len], when not null); with several, O_part
  [parts, B, q_len, H, D] (normalised, fp32) and LSE_part [parts, B, q_len, H] (log2), a
  part per split, or per cluster of ``cluster`` splits where the kernel runs in clusters
  (CLUSTER; splits are then a multiple of it, and one cluster of every split writes O itself),
  which a ``fused`` kernel (COMBINE) then merges itself: ``counters`` holds an int32 per
  (batch, kv head x row chunk), zero before the launch and zero again after it (the last
  block of a group to finish resets it), one set per (device, stream) (``split_counters``);
  a ``cooperative`` kernel, launched cooperatively (every block resident), merges them with
  every block of the group once all have written theirs: two counters a group (arrive, then
  depart past every group's), zero before and after likewise; null for a ``kernel`` combine,
  which launches
- ``attn_decode_combine(O_part, LSE_part, O, LSE, batch, q_len, q_heads, parts, o_sb, o_ss,
  o_sh)`` on ceil(B * q_len * H * D / 4 / 256) blocks of 256 threads: merges the parts.
  Built with COMBINE_LAUNCH "programmatic" (sm_90), it is launched as attn_decode's
  programmatic dependent (``launch_programmatic``): attn_decode lets it launch once all its
  blocks have started, its blocks ask for the shared memory that spreads them over the SMs
  (``combine_spread_smem``), and each waits for attn_decode's completion
  (griddepcontrol.wait) before reading a part.

Value checks (``check=True``, the default): cache lengths within [0, capacity] and the block
table entries that a sequence's length reaches within [0, num_pages) are checked on the
device with one small reduction and one ``.item()`` (a host sync, some microseconds);
``check=False`` skips it (the shapes, dtypes and devices are always checked). Entries past a
sequence's length are never read and not checked.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from evoengine.launch.core import (
    DTYPE_NAMES,
    KERNEL_DTYPES,
    LOG2E,
    MAX_GRID_YZ,
    LaunchConfig,
    NoKernelError,
    ParamBuffer,
    check_aligned,
    check_dtype,
    check_fallback,
    check_flag,
    check_grid_dims,
    check_shared,
    in_context,
    launch_cooperative_in_context,
    launch_in_context,
    launch_programmatic_in_context,
    libcuda,
    raw_stream,
    sdpa_attention,
    sm_count,
    softmax_scale,
)
from evoengine.launch.forward import CudaKernel

DECODE_ENTRIES = ("attn_decode", "attn_decode_combine")
DECODE_MAIN_ARGS = ParamBuffer("Q" * 10 + "i" * 6 + "q" * 13 + "f")
DECODE_COMBINE_ARGS = ParamBuffer("QQQQ" + "iiii" + "qqq")
DECODE_COMBINE_THREADS = 256  # the template's cfg::DECODE_COMBINE_THREADS
MAX_DECODE_Q_LEN = 16
MAX_DECODE_SPLITS = 256  # parts are fp32 [splits, B, q_len, H, D]: bounded memory
SPLIT_POLICIES = ("waves", "fixed")
COMBINES = ("kernel", "fused", "cooperative")
# How the combine kernel is launched: "stream", after the main kernel ends; "programmatic"
# (sm_90, COMBINE "kernel"), as the main kernel's dependent, so its launch overlaps the main
# kernel's and it waits (griddepcontrol.wait) only for that kernel's completion.
COMBINE_LAUNCHES = ("stream", "programmatic")


class DecodeShape(NamedTuple):
    """The shapes of one decode call, read off the tensors."""

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    page_size: int  # 0 for a contiguous cache
    capacity: int  # the most keys a sequence can have: max_len, or max_pages * page_size
    num_pages: int  # 0 for a contiguous cache


def check_decode_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                        block_table: Tensor | None = None, *, head_dim: int | None = None,
                        dtype: str | None = None, paged: bool | None = None,
                        any_float: bool = False, aligned: bool = True) -> DecodeShape:
    """Reject what the decode kernels cannot take, in one line naming what was expected, and
    return the shapes. Looks at shapes, dtypes, strides and, last, devices (no sync).
    ``any_float`` and ``aligned=False``: as ``check_inputs``'s, for the SDPA fallback."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if block_table is not None and not isinstance(block_table, Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got "
                        f"{type(block_table).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [batch, q_len, q_heads, head_dim], got {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            what = "num_pages, page_size" if block_table is not None else "batch, max_len"
            raise ValueError(f"{name} must be 4-D [{what}, kv_heads, head_dim], "
                             f"got {tuple(t.shape)}")
    check_dtype("q", q, any_float)
    check_shared("q, k_cache, v_cache", q, k_cache, v_cache)
    if dtype is not None and q.dtype != KERNEL_DTYPES[dtype]:
        raise ValueError(f"this kernel takes {dtype}, got {q.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    batch, q_len, q_heads, d = q.shape
    rows, per_row, kv_heads, kd = k_cache.shape
    if q.numel() == 0 or k_cache.numel() == 0:  # batch, q_len, heads, head_dim, pages
        raise ValueError(f"q and the cache must not be empty, got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    if q_len > MAX_DECODE_Q_LEN:
        raise ValueError(f"q_len must be at most {MAX_DECODE_Q_LEN} for decode, got {q_len}: for "
                         "longer prefill chunks use the forward attention (evoengine's "
                         "attention or SDPA) over the cache")
    if kd != d:
        raise ValueError(f"the cache's head_dim must be q's ({d}), got {kd}")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"this kernel takes head_dim {head_dim}, got {d}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if aligned and q.dtype in DTYPE_NAMES:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_aligned(name, t)
    if (cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,)
            or not cache_seqlens.is_contiguous()):
        raise ValueError(f"cache_seqlens must be a contiguous int32 [{batch}], got "
                         f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}")
    if block_table is None:
        if paged:
            raise ValueError("this kernel reads a paged cache: pass block_table")
        if rows != batch:
            raise ValueError(f"a contiguous cache must be [{batch}, max_len, kv_heads, {d}], "
                             f"got {tuple(k_cache.shape)} (pass block_table for a paged one)")
        shape = DecodeShape(batch, q_len, q_heads, kv_heads, d, False, 0, per_row, 0)
    else:
        if paged is False:
            raise ValueError("this kernel reads a contiguous cache: pass block_table=None")
        if (block_table.dtype != torch.int32 or block_table.dim() != 2
                or block_table.shape[0] != batch or block_table.shape[1] == 0
                or block_table.stride(1) != 1):
            raise ValueError(f"block_table must be int32 [{batch}, max_pages] with a contiguous "
                             f"last dim, got {tuple(block_table.shape)} {block_table.dtype}")
        if per_row & (per_row - 1):
            raise ValueError(f"page_size (k_cache.shape[1]) must be a power of 2, got {per_row}")
        shape = DecodeShape(batch, q_len, q_heads, kv_heads, d, True, per_row,
                            block_table.shape[1] * per_row, rows)
    if aligned:  # else checked where a kernel, not SDPA, takes the call
        check_cache_strides(k_cache, v_cache, shape)
    check_grid_dims(batch, kv_heads, "kv heads")
    tensors = [q, k_cache, v_cache, cache_seqlens] + ([block_table] if block_table is not None
                                                      else [])
    if not q.is_cuda or any(t.device != q.device for t in tensors):
        raise ValueError("q, k_cache, v_cache, cache_seqlens and block_table must be on one "
                         f"CUDA device, got {', '.join(str(t.device) for t in tensors)}")
    return shape


def check_cache_strides(k_cache: Tensor, v_cache: Tensor, shape: DecodeShape) -> None:
    """The kernels form a key row's offset from 32-bit products: a page's stride, and a key
    row's stride times the rows of a page (paged) or the row index (contiguous), must stay
    below 2^31 elements. Any cache whose pages or rows are stored whole passes; only views
    with gaps of gigabytes between rows would not."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        pages, rows = t.shape[:2]
        spans = ([t.stride(0) if pages > 1 else 0, t.stride(1) * (rows - 1)] if shape.paged
                 else [t.stride(1) if rows > 1 else 0])
        if max(spans) >= 2**31:
            what = "page and key-row strides" if shape.paged else "key-row stride"
            raise ValueError(f"{name}'s {what} {tuple(t.stride()[:2])} reach past 2^31 "
                             "elements: pass a cache whose rows lie closer (.contiguous())")


def check_decode_values(shape: DecodeShape, cache_seqlens: Tensor,
                        block_table: Tensor | None) -> None:
    """Cache lengths in [0, capacity] and every block-table entry a sequence reaches in
    [0, num_pages): one reduction on the device and one ``.item()`` (a host sync)."""
    lens = cache_seqlens
    bad = ((lens < 0) | (lens > shape.capacity)).any().to(torch.int32)
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < (
            (lens.clamp(min=0) + shape.page_size - 1) // shape.page_size)[:, None]
        out = ((block_table < 0) | (block_table >= shape.num_pages)) & used
        bad = bad + 2 * out.any().to(torch.int32)
    code = int(bad.item())
    if code & 1:
        what = (f"max_pages x page_size = {shape.capacity}" if shape.paged
                else f"max_len = {shape.capacity}")
        raise ValueError(f"cache_seqlens must lie in [0, {what}], got "
                         f"min {int(lens.min())}, max {int(lens.max())}")
    if code & 2:
        raise ValueError(f"block_table entries within a sequence's length must lie in "
                         f"[0, num_pages = {shape.num_pages})")


def check_decode_out(name: str, t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device, contiguous: bool = False) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {list(shape)} {dtype} on {device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if not contiguous:
        check_aligned(name, t)


def decode_splits(policy: str, splits: int, *, units: int, tiles: int, slots: int) -> int:
    """How many splits of the cache a call gets. ``fixed``: ``splits``. ``waves``: as many
    as fit ``splits`` whole waves of the GPU's ``slots`` (blocks of one wave: ``wave_slots``) when
    each split is ``units`` blocks (batch x kv heads x row chunks), at least one: a partial
    last wave of a memory-bound kernel leaves SMs idle while it streams. Capped at one
    split per tile of the capacity and at MAX_DECODE_SPLITS."""
    if policy == "fixed":
        n = splits
    elif policy == "waves":
        n = splits * slots // max(1, units)
    else:
        raise ValueError(f"split policy must be one of {SPLIT_POLICIES}, got {policy!r}")
    return max(1, min(n, tiles, MAX_DECODE_SPLITS))


def cluster_splits(splits: int, cluster: int) -> int:
    """``splits`` made a whole number of clusters of ``cluster`` (the grid's x dimension must
    be): rounded down, at least one cluster. Splits past the cache's tiles are empty and merge
    as nothing (an LSE of -inf)."""
    return max(cluster, splits - splits % cluster)


@functools.cache
def sm_shared_memory(index: int) -> int:
    """Shared memory of one SM of CUDA device ``index``, in bytes."""
    from cupy.cuda import runtime

    return int(runtime.deviceGetAttribute(
        runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, index))


def resident_blocks(fn: int, threads: int, smem_bytes: int, index: int) -> int:
    """Blocks of a kernel that one SM of device ``index`` holds at once (the driver's
    occupancy calculator; from shared memory alone where cupy lacks it)."""
    from cupy.cuda import driver

    try:
        return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, threads,
                                                                           smem_bytes)))
    except AttributeError:  # 1 KB the runtime keeps per block
        return max(1, sm_shared_memory(index) // max(1, smem_bytes + 1024))


def resident_clusters(fn: int, threads: int, smem_bytes: int, cluster: int) -> int | None:
    """Thread block clusters of ``cluster`` blocks of a kernel (built with that cluster shape)
    that the current device holds at once: the driver's cuOccupancyMaxActiveClusters, called
    through ctypes as this package calls nothing but torch, cupy and the standard library; None
    where the driver cannot say. A cluster stays inside one GPC, so fewer fit than SMs x blocks
    per SM / cluster: 15 of 8 on the H100's 132 SMs."""
    try:
        config = LaunchConfig((cluster, 1, 1), (threads, 1, 1), smem_bytes, None, None, 0)
        n = ctypes.c_int(0)
        err = libcuda().cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn),
                                                   ctypes.byref(config))
    except (OSError, AttributeError):  # no driver, or one without clusters
        return None
    return n.value if err == 0 and n.value > 0 else None


def wave_slots(block_slots: int, clusters: int | None, cluster: int) -> int:
    """Blocks that one wave of the GPU holds: SMs x blocks per SM, or for a kernel in clusters
    of ``cluster`` blocks, the clusters that fit (``resident_clusters``) times their size where
    known and fewer."""
    if cluster > 1 and clusters:
        return min(block_slots, clusters * cluster)
    return block_slots


def combine_spread_smem(blocks: int, sms: int, sm_smem: int) -> int:
    """Dynamic shared memory (bytes, unused) for a programmatic combine launch of ``blocks``
    blocks on ``sms`` SMs of ``sm_smem`` bytes each, so that an SM holds at most
    ceil(blocks / sms) of them: launched while the main kernel runs, they would otherwise pile
    onto the few SMs it leaves free and merge there (on the H200, 2026-11-28, 32 blocks of the
    q_len-4 batch-1 combine took 0.76-0.90x the stream launch's time that way, 1.02-1.05x spread;
    ``experiments/2026-11-28-decode-programmatic/``). 0 where the threads bound it anyway."""
    cap = -(-blocks // max(1, sms))
    if cap * DECODE_COMBINE_THREADS >= 2048:  # an SM's threads (sm_80 to sm_90)
        return 0
    return sm_smem // (cap + 1) + 1


MIN_COUNTERS = 1024  # the smallest set of fused-combine counters allocated (4 KB)
_COUNTERS: dict[tuple[int, int], Tensor] = {}  # (device index, stream) -> its counters
_OUTGROWN: list[Tensor] = []  # replaced sets: a captured CUDA graph may still use them


def split_counters(device: torch.device, stream: int, n: int) -> Tensor:
    """At least ``n`` int32 counters of the fused combine for launches on ``stream`` of
    ``device``. Each launch leaves them zero as it found them, so one set serves every
    launch on the stream in order, and CUDA-graph replays of them; streams have their own
    (launches on two streams may overlap). Created zeroed, on the stream, at first use (under
    graph capture the zeroing is part of that graph); a set outgrown is replaced, and kept
    alive, as a graph captured with it may be replayed."""
    key = (device.index if device.index is not None else -1, stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        if have is not None:
            _OUTGROWN.append(have)
        have = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = have
    return have


class CudaDecode:
    """One decode kernel (two entries of one cubin or source):
    ``kernel(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True) -> out``.

    Loads on first use per device. ``launch`` is the unchecked hot path."""

    kind = "decode"  # the problem it solves (dispatch.KERNEL_CLASSES)
    causal = True  # as dispatch entries key kernels; causal or not is a launch argument

    def __init__(self, name: str, *, head_dim: int, dtype: str, paged: bool, block_m: int,
                 block_n: int, threads: int, smem_bytes: int, split_policy: str, splits: int,
                 combine: str = "kernel", cluster: int = 1, combine_launch: str = "stream",
                 arch: str | None = None,
                 cubin: bytes | None = None, source: str | None = None,
                 defines: Mapping[str, int] | None = None) -> None:
        if split_policy not in SPLIT_POLICIES:
            raise ValueError(f"kernel {name}: split_policy must be one of {SPLIT_POLICIES}, "
                             f"got {split_policy!r}")
        if combine not in COMBINES:
            raise ValueError(f"kernel {name}: combine must be one of {COMBINES}, got {combine!r}")
        if combine_launch not in COMBINE_LAUNCHES or (combine_launch == "programmatic"
                                                      and combine != "kernel"):
            raise ValueError(f"kernel {name}: combine_launch must be one of {COMBINE_LAUNCHES}, "
                             f"'programmatic' only with the kernel combine; got "
                             f"{combine_launch!r} with {combine!r}")
        common: dict[str, Any] = dict(head_dim=head_dim, dtype=dtype, causal=True,
                                      block_m=block_m, arch=arch, cubin=cubin, source=source,
                                      defines=defines)
        main_entry, combine_entry = DECODE_ENTRIES
        self.main = CudaKernel(name, threads=threads, smem_bytes=smem_bytes, entry=main_entry,
                               **common)
        self.combine = CudaKernel(f"{name}:{combine_entry}", threads=DECODE_COMBINE_THREADS,
                                  smem_bytes=0, entry=combine_entry, **common)
        self.name, self.arch, self.cubin, self.source = name, arch, cubin, source
        self.head_dim, self.dtype, self.paged = int(head_dim), dtype, bool(paged)
        self.block_m, self.block_n = int(block_m), int(block_n)
        self.split_policy, self.splits = split_policy, int(splits)
        self.fused = combine == "fused"  # several splits merged by the main kernel's last block
        # ... or by all of the main kernel's blocks together, launched cooperatively
        self.cooperative = combine == "cooperative"
        # Splits per thread block cluster, compiled in: a call's splits are a multiple of it,
        # and each cluster writes one part.
        self.cluster = int(cluster)
        # The combine kernel launched as the main kernel's programmatic dependent (its source
        # waits with griddepcontrol.wait: built with COMBINE_LAUNCH "programmatic").
        self.programmatic = combine_launch == "programmatic"
        self._slots: dict[int, int] = {}  # per device: blocks of one wave (wave_slots)

    @classmethod
    def spec_args(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's arguments but the name, arch, cubin and source, from a kernel spec
        (an export's, or ``Candidate.spec()``); parameters a spec exported before them lacks
        take their legacy values."""
        problem, params = spec["problem"], spec["params"]
        return dict(head_dim=int(problem["HEAD_DIM"]), dtype=str(problem["DTYPE"]),
                    paged=bool(problem["PAGED"]), block_m=int(spec["block_m"]),
                    block_n=int(params["BLOCK_N"]), threads=int(spec["threads"]),
                    smem_bytes=int(spec["smem_bytes"]),
                    split_policy=str(params["SPLIT_POLICY"]), splits=int(params["SPLITS"]),
                    combine=str(params.get("COMBINE", "kernel")),
                    cluster=int(params.get("CLUSTER", 1)),
                    combine_launch=str(params.get("COMBINE_LAUNCH", "stream")),
                    defines=spec.get("defines"))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], arch: str | None, *, cubin: bytes | None,
                  source: str | None) -> CudaDecode:
        """The kernel an export's spec describes (``dispatch.kernel_from_spec``)."""
        return cls(spec["name"], arch=arch, cubin=cubin, source=source, **cls.spec_args(spec))

    def __repr__(self) -> str:
        return f"CudaDecode({self.name!r})"

    def load(self, index: int) -> None:
        """Load both entries on CUDA device ``index`` (once each); ``NoKernelError`` where
        they cannot run."""
        loaded = self.main.load(index)
        self.combine.load(index)
        if index not in self._slots:
            blocks = sm_count(index) * resident_blocks(
                loaded.fn, self.main.threads, self.main.smem_bytes, index)
            clusters = None
            if self.cluster > 1:
                clusters = in_context(loaded, resident_clusters, loaded.fn, self.main.threads,
                                      self.main.smem_bytes, self.cluster)
            self._slots[index] = wave_slots(blocks, clusters, self.cluster)
            if self.programmatic:  # the most combine_spread_smem asks for (one block an SM)
                from cupy.cuda import driver

                combine = self.combine.load(index)
                in_context(combine, driver.funcSetAttribute, combine.fn,
                           driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                           sm_shared_memory(index) // 2 + 1)

    def plan(self, shape: DecodeShape, index: int) -> tuple[int, int]:
        """(row chunks, splits) of a call: the grid's second and first dimensions' factors."""
        rows = shape.q_len * (shape.q_heads // shape.kv_heads)
        chunks = -(-rows // self.block_m)
        if shape.kv_heads * chunks > MAX_GRID_YZ:
            raise ValueError(f"kv heads x row chunks must be at most {MAX_GRID_YZ}")
        if index not in self._slots:
            self.load(index)
        splits = decode_splits(self.split_policy, self.splits,
                               units=shape.batch * shape.kv_heads * chunks,
                               tiles=-(-shape.capacity // self.block_n),
                               slots=self._slots[index])
        return chunks, cluster_splits(splits, self.cluster)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                 block_table: Tensor | None = None, *, causal: bool = True,
                 scale: float | None = None, out: Tensor | None = None,
                 lse: Tensor | None = None, check: bool = True) -> Tensor:
        """Attention of q over each sequence's cache, written into ``out`` where given (any
        strides, contiguous last dim); ``lse``: natural-log float32 [B, H, q_len]."""
        shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                    head_dim=self.head_dim, dtype=self.dtype, paged=self.paged)
        if check:
            check_decode_values(shape, cache_seqlens, block_table)
        causal = check_flag("causal", causal)
        scale = softmax_scale(scale, shape.head_dim)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        check_decode_out("out", out, tuple(q.shape), q.dtype, q.device)
        check_decode_out("lse", lse, (shape.batch, shape.q_heads, shape.q_len), torch.float32,
                         q.device, contiguous=True)
        self.launch(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, shape,
                    causal=causal, scale=scale)
        return out

    def launch(self, q: Tensor, k: Tensor, v: Tensor, seqlens: Tensor,
               block_table: Tensor | None, out: Tensor, lse: Tensor | None, shape: DecodeShape,
               *, causal: bool, scale: float) -> None:
        """Launch on torch's current stream, without checks (inputs already validated)."""
        index = q.get_device()
        main, combine = self.main.load(index), self.combine.load(index)
        if index not in self._slots:
            self.load(index)
        stream = raw_stream(index)
        chunks, splits = self.plan(shape, index)
        b, q_len, h, d = q.shape
        part = lse_part = counters = None
        parts = splits // self.cluster  # what goes through global memory: a cluster's, each
        if parts > 1:
            # From torch's stream-ordered allocator: dropped after the launches are enqueued,
            # the memory goes only to work ordered after them on this stream.
            part = torch.empty((parts, b, q_len, h, d), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((parts, b, q_len, h), dtype=torch.float32, device=q.device)
            groups = b * shape.kv_heads * chunks
            if self.fused:
                counters = split_counters(q.device, stream, groups)
            elif self.cooperative:  # an arrive and a depart counter a group
                counters = split_counters(q.device, stream, 2 * groups)
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        page_log2 = shape.page_size.bit_length() - 1 if shape.paged else 0
        args = DECODE_MAIN_ARGS.pack(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), ptr(lse), ptr(part),
            ptr(lse_part), ptr(counters), seqlens.data_ptr(), ptr(block_table), q_len, h,
            h // shape.kv_heads, chunks, int(causal), page_log2, q.stride(0), q.stride(1),
            q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            0 if block_table is None else block_table.stride(0), scale * LOG2E)
        grid = (main.fn, splits, shape.kv_heads * chunks, b, self.main.threads, 1, 1,
                self.main.smem_bytes, stream, ctypes.addressof(args[1]))
        if self.cooperative and parts > 1:
            launch_cooperative_in_context(main, grid)
        else:
            launch_in_context(main, (*grid, 0))
        if parts > 1 and not (self.fused or self.cooperative):
            cargs = DECODE_COMBINE_ARGS.pack(part.data_ptr(), lse_part.data_ptr(),  # type: ignore[union-attr]
                                             out.data_ptr(), ptr(lse), b, q_len, h, parts,
                                             out.stride(0), out.stride(1), out.stride(2))
            blocks = -(-(b * q_len * h * (d // 4)) // DECODE_COMBINE_THREADS)
            smem = (combine_spread_smem(blocks, sm_count(index), sm_shared_memory(index))
                    if self.programmatic else 0)
            cgrid = (combine.fn, blocks, 1, 1, DECODE_COMBINE_THREADS, 1, 1, smem, stream,
                     ctypes.addressof(cargs[1]))
            if self.programmatic:
                launch_programmatic_in_context(combine, cgrid)
            else:
                launch_in_context(combine, (*cgrid, 0))
        del part, lse_part  # only now: both launches have read their addresses


# ---- dispatch over tuned decode kernels -----------------------------------------------------

def nearest_decode(entries: Iterable[Any], cache_len: int, batch: int) -> Any:
    """The dispatch entry (``dispatch.Entry`` of kind ``decode``: ``seq_k`` the cache length
    it was tuned at) nearest the call: closest cache length in log scale, then closest batch
    (log scale); ties go to the entry listed first."""
    def distance(e: Any) -> tuple[float, float]:
        return (abs(math.log(max(1, cache_len) / e.seq_k)), abs(math.log(batch / e.batch)))
    return min(entries, key=distance)


class TunedDecode:
    """``attention_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True,
    scale=None, fallback=None)`` over a table of tuned decode kernels: the one tuned for the
    call's (dtype, head_dim, layout) nearest its cache capacity and batch. ``entries`` are the
    module's dispatch entries; those of kind ``decode`` are its table (``seq_q``, ``seq_k``,
    ``heads``: the q_len, cache length and query heads tuned for)."""

    def __init__(self, kernels: list[Any], entries: Iterable[Any]) -> None:
        self.kernels = list(kernels)
        self.entries = tuple(e for e in entries if e.kind == CudaDecode.kind)
        self.table: dict[tuple[str, int, bool], list[Any]] = {}
        for e in self.entries:
            k = self.kernels[e.kernel]
            if not isinstance(k, CudaDecode) or (k.dtype, k.head_dim) != (e.dtype, e.head_dim):
                raise ValueError(f"decode entry {e.workload} names kernel "
                                 f"{getattr(k, 'name', k)}, which is compiled for another "
                                 "problem")
            self.table.setdefault((e.dtype, e.head_dim, k.paged), []).append(e)

    def __repr__(self) -> str:
        keys = ", ".join(f"{d} head_dim {h} {'paged' if p else 'contiguous'}"
                         for d, h, p in self.table)
        return f"<tuned decode: {len(self.entries)} entries for {keys or 'nothing'}>"

    def select(self, dtype: str, head_dim: int, paged: bool, cache_len: int,
               batch: int) -> Any:
        """The entry for a call, or None where no kernel has its (dtype, head_dim, layout).
        Pure Python: no GPU needed."""
        group = self.table.get((dtype, head_dim, paged))
        return None if group is None else nearest_decode(group, cache_len, batch)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                 block_table: Tensor | None = None, causal: bool = True,
                 scale: float | None = None, fallback: str | None = None, *,
                 check: bool = True) -> Tensor:
        """Decode attention (module docstring); [batch, q_len, q_heads, D], contiguous.
        ``fallback='sdpa'`` runs ``sdpa_decode`` where no tuned kernel fits."""
        check_fallback(fallback)
        shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                    any_float=fallback is not None, aligned=fallback is None)
        if check:
            check_decode_values(shape, cache_seqlens, block_table)
        causal = check_flag("causal", causal)
        scale = softmax_scale(scale, shape.head_dim)
        dtype = DTYPE_NAMES.get(q.dtype)
        entry = None if dtype is None else self.select(dtype, shape.head_dim, shape.paged,
                                                       shape.capacity, shape.batch)
        kernel = None if entry is None else self.kernels[entry.kernel]
        if kernel is not None:
            try:
                kernel.load(q.get_device())
            except NoKernelError:
                if fallback is None:
                    raise
                kernel = None
        if kernel is None:
            if fallback is None:
                have = "; ".join(f"{d} head_dim {h} {'paged' if p else 'contiguous'}"
                                 for d, h, p in self.table) or "none"
                raise NoKernelError(f"no tuned decode kernel for {q.dtype} head_dim "
                                    f"{shape.head_dim} {'paged' if shape.paged else 'contiguous'}"
                                    f"; this module has: {have}. Pass fallback='sdpa' to run "
                                    "torch SDPA for such calls.")
            return sdpa_decode(q, k_cache, v_cache, cache_seqlens, block_table, causal=causal,
                               scale=scale)
        if fallback is not None:  # not checked above: SDPA might have served
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
                check_aligned(name, t)
            check_cache_strides(k_cache, v_cache, shape)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        kernel.launch(q, k_cache, v_cache, cache_seqlens, block_table, out, None, shape,
                      causal=causal, scale=scale)
        return out


def gather_cache(cache: Tensor, block_table: Tensor | None, b: int, length: int) -> Tensor:
    """Sequence ``b``'s first ``length`` keys (or values) of a contiguous or paged cache, as
    [length, kv_heads, D]."""
    if block_table is None:
        return cache[b, :length]
    page = cache.shape[1]
    pages = block_table[b, : -(-length // page)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def sdpa_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                block_table: Tensor | None = None, *, causal: bool = True,
                scale: float | None = None) -> Tensor:
    """Decode through torch SDPA, one sequence at a time (a reference and a fallback, not
    fast): same semantics as the kernels; a sequence with no key outputs zeros."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    q_len = q.shape[1]
    for b, length in enumerate(cache_seqlens.tolist()):
        if length <= 0:
            continue
        k = gather_cache(k_cache, block_table, b, length).transpose(0, 1)[None]
        v = gather_cache(v_cache, block_table, b, length).transpose(0, 1)[None]
        qb = q[b].transpose(0, 1)[None]
        if causal and q_len > length:  # queries that see no key stay zero
            first = q_len - length
            res = sdpa_attention(qb[:, :, first:], k, v, causal=True, scale=scale)
            out[b, first:] = res[0].transpose(0, 1)
        else:
            res = sdpa_attention(qb, k, v, causal=causal, scale=scale)
            out[b] = res[0].transpose(0, 1)
    return out
