"""TMA tensor maps for the wgmma family: the tiled view of a [B, H, S, D] tensor, the driver's
``cuTensorMapEncodeTiled`` through ctypes, the grid of a TMA launch and its parameter layout.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

TMA_FAMILIES = ("wgmma",)
TMA_Q_ROWS = 64  # rows of Q per consumer warpgroup: the box the kernel loads Q in
# cuda.h's enum values (a stable ABI): CUtensorMapDataType, CUtensorMapSwizzle, and the
# 256-byte CUtensorMapL2promotion; interleave and out-of-bounds fill are 0 (none, zeros).
_TMA_DTYPE = {"fp16": 6, "bf16": 9}
_TMA_SWIZZLE = {32: 1, 64: 2, 128: 3}
_TMA_L2_256B = 3
# The TMA launch arguments: 3 tensor maps, O and LSE, 5 int32, 3 int64 strides, 1 float,
# the tile counter (a pointer, 8-byte aligned after the float).
TMA_ARGS = struct.Struct("=128s128s128s2Q5i4x3qf4xQ")
TMA_ARG_OFFSETS = (0, 128, 256, 384, 392, *range(400, 420, 4), *range(424, 448, 8), 448, 456)
# O_STORE "tma": the same, then O's tensor map (64-byte aligned) as the last argument.
_TMA_O_AT = -(-TMA_ARGS.size // 64) * 64
TMA_O_ARGS = struct.Struct(f"{TMA_ARGS.format}{_TMA_O_AT - TMA_ARGS.size}x128s")
TMA_O_ARG_OFFSETS = (*TMA_ARG_OFFSETS, _TMA_O_AT)
TMA_O_ROWS = 16  # rows of O per store: each consumer warp's


class TmaParams(NamedTuple):
    """How a TMA kernel is launched, from its family's parameters."""

    swizzle: int  # bytes: the tensor maps' swizzle, whose width (in values) is the box's
    block_n: int  # rows of K and V per box
    persistent: bool  # one block per SM, each looping over tiles
    dynamic: bool = False  # persistent blocks draw tiles from a zeroed counter in global memory
    pack: bool = False  # PACK_GQA: a tile's rows are pack_heads(kv_group) heads per token
    o_store: bool = False  # O_STORE "tma": O goes out by TMA stores through a map of its own

    def pack_heads(self, kv_group: int) -> int:
        """P, the query heads a tile packs per token: 1, or (PACK_GQA) the lowest set bit of
        the group, at most 64, so a consumer's 64 rows are whole tokens (the kernel's
        ``pack_log2``)."""
        return min(kv_group & -kv_group, 64) if self.pack else 1


def tma_params(family: str, params: Mapping[str, Any]) -> TmaParams | None:
    """The TMA launch of a candidate of ``family``, or None for a pointer-ABI family.

    Specs exported before the wgmma space had SCHEDULER (or PACK_GQA, O_STORE) lack it: those
    kernels are static (unpacked, and store O from every lane).
    """
    if family not in TMA_FAMILIES:
        return None
    return TmaParams(int(params["SWIZZLE"]), int(params["BLOCK_N"]), bool(params["PERSISTENT"]),
                     params.get("SCHEDULER", "static") == "dynamic",
                     bool(params.get("PACK_GQA", False)), params.get("O_STORE") == "tma")


class TmaGeometry(NamedTuple):
    """What ``cuTensorMapEncodeTiled`` gets for one tensor, innermost dimension first: rank 4,
    (head_dim, seq, heads, batch), or with ``pack`` heads per token rank 5, (head_dim, heads in
    a block, seq, head blocks, batch)."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, of dims 1..
    box: tuple[int, ...]
    swizzle: int  # bytes


def tma_geometry(shape: tuple[int, ...], strides: tuple[int, ...], elem_bytes: int, rows: int,
                 swizzle: int, pack: int = 0) -> TmaGeometry:
    """The tiled view of a ``[B, H, S, D]`` tensor with element ``strides``: boxes of one
    swizzle panel (swizzle / elem_bytes values) by ``rows`` rows. ``pack`` P > 0 gives the
    rank-5 view of a PACK_GQA kernel's Q: a box's rows are P heads of each of rows / P tokens,
    head fastest (0: the rank-4 view).

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
    if not pack:
        return TmaGeometry((d, s, h, b), (out[0], out[1], out[2]), (panel, rows, 1, 1), swizzle)
    if h % pack or rows % pack:
        raise ValueError(f"{pack} heads per token must divide the {h} heads and {rows} rows")
    # (d, heads in a block, seq, head blocks, batch): a block's heads are pack head strides
    # apart; a size-1 dimension's stride is legal already (above).
    head = strides[1] * elem_bytes if h > 1 else out[1]
    return TmaGeometry((d, pack, s, h // pack, b), (head, out[0], pack * head, out[2]),
                       (panel, pack, rows // pack, 1, 1), swizzle)


def tma_grid(block_m: int, seq_q: int, heads: int, batch: int, persistent: bool,
             sms: int, pack: int = 1) -> tuple[int, int]:
    """(blocks, tiles): one block per tile, or at most one per SM when persistent. With
    ``pack`` heads per token, a tile's rows are packed: seq_q x pack rows per head block."""
    tiles = -(-seq_q * pack // block_m) * (heads // pack) * batch
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
    rank = len(geometry.dims)
    err = _tensor_map_encoder()(
        at, _TMA_DTYPE[dtype], rank, address, (ctypes.c_uint64 * rank)(*geometry.dims),
        (ctypes.c_uint64 * (rank - 1))(*geometry.strides),
        (ctypes.c_uint32 * rank)(*geometry.box), (ctypes.c_uint32 * rank)(*([1] * rank)), 0,
        _TMA_SWIZZLE[geometry.swizzle], _TMA_L2_256B, 0)
    if err != 0:
        raise ValueError(f"cuTensorMapEncodeTiled refused {geometry} at {address:#x}: "
                         f"CUresult {err}")
    return ctypes.string_at(at, 128)
