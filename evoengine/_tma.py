"""Host side of the ``wgmma`` family: TMA tensor maps and the launch.

The wgmma kernels read Q, K and V through TMA tensor maps (a 128-byte ``CUtensorMap`` each,
passed by value as a ``__grid_constant__`` parameter) instead of raw pointers, so their ABI
differs from the other families' (see ``templates/wgmma/kernel.cu.j2``)::

    attn_fwd(CUtensorMap q, CUtensorMap k, CUtensorMap v, T* out, float* lse,
             int seq_q, int seq_k, int heads, int kv_group, int total_tiles,
             long long out_sb, long long out_sh, long long out_ss, float scale_log2)

Each map views a ``[batch, heads, seq, head_dim]`` tensor (any strides, last dim contiguous)
as a rank-4 tiled tensor of dims ``(head_dim, seq, heads, batch)``, innermost first, with a
box of ``(panel, rows, 1, 1)``: ``panel`` is the swizzle width in values (SWIZZLE / 2),
``rows`` 64 for Q (one consumer warpgroup's rows) and BLOCK_N for K and V. The TMA engine
zero-fills rows past ``seq``, which handles every length tail. The grid is 1-D over tiles
(query block, head, batch), or one block per SM when the candidate is persistent.

Building the map needs the CUDA driver (``cuTensorMapEncodeTiled``), so only
:class:`TmaLauncher` touches the GPU stack; the geometry helpers are plain Python.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evoengine.render import Candidate

if TYPE_CHECKING:
    import torch

    from evoengine.runtime import Problem

LOG2E = 1.4426950408889634
Q_BOX_ROWS = 64  # one consumer warpgroup's rows: the kernel loads Q per warpgroup
_SWIZZLES = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
             128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_MAP_CACHE_SIZE = 64


@dataclass(frozen=True)
class MapGeometry:
    """What ``cuTensorMapEncodeTiled`` gets for one tensor, innermost dimension first."""

    dims: tuple[int, int, int, int]  # (head_dim, seq, heads, batch)
    strides: tuple[int, int, int]  # bytes, of dims 1..3
    box: tuple[int, int, int, int]
    swizzle: int  # bytes


def map_geometry(shape: tuple[int, ...], strides: tuple[int, ...], elem_bytes: int, rows: int,
                 swizzle: int) -> MapGeometry:
    """The tiled view of a ``[B, H, S, D]`` tensor with element ``strides`` for TMA.

    TMA wants byte strides that are multiples of 16 below 2^40; a dimension of size 1 is
    never stepped over, so its stride (which torch leaves arbitrary) is replaced by a legal
    one.
    """
    b, h, s, d = shape
    if swizzle not in _SWIZZLES:
        raise ValueError(f"swizzle must be one of {sorted(_SWIZZLES)} bytes, got {swizzle}")
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
    return MapGeometry((d, s, h, b), (out[0], out[1], out[2]), (panel, rows, 1, 1), swizzle)


@dataclass(frozen=True)
class LaunchGeometry:
    grid: int
    total_tiles: int


def launch_geometry(candidate: Candidate, seq_q: int, heads: int, batch: int,
                    sms: int) -> LaunchGeometry:
    """One block per tile, or at most one per SM (each loops over tiles) when persistent."""
    m_blocks = -(-seq_q // candidate.block_m)
    tiles = m_blocks * heads * batch
    grid = min(tiles, sms) if candidate.params["PERSISTENT"] else tiles
    return LaunchGeometry(grid, tiles)


@functools.cache
def _driver():  # type: ignore[no-untyped-def]
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)  # idempotent; torch has normally initialised the driver already
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit failed: {err}")
    return driver


def encode_map(address: int, geometry: MapGeometry, bf16: bool) -> bytes:
    """The 128 bytes of a CUtensorMap (zero fill out of range, 256-byte L2 promotion)."""
    cu = _driver()
    dtype = (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if bf16
             else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    err, tmap = cu.cuTensorMapEncodeTiled(
        dtype, 4, address,
        [cu.cuuint64_t(x) for x in geometry.dims],
        [cu.cuuint64_t(x) for x in geometry.strides],
        [cu.cuuint32_t(x) for x in geometry.box],
        [cu.cuuint32_t(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, _SWIZZLES[geometry.swizzle]),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused {geometry} at {address:#x}: {err}")
    return ctypes.string_at(tmap.getPtr(), 128)


class TmaLauncher:
    """Launches one compiled wgmma candidate: tensor maps, grid, and the raw parameter block."""

    def __init__(self, candidate: Candidate, function_ptr: int, device_index: int) -> None:
        import torch

        self.candidate = candidate
        self.function_ptr = function_ptr
        self.swizzle = int(candidate.params["SWIZZLE"])  # type: ignore[call-overload]
        self.block_n = int(candidate.params["BLOCK_N"])  # type: ignore[call-overload]
        self.bf16 = candidate.problem["DTYPE"] == "bf16"
        self.sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        self._maps: dict[tuple, bytes] = {}

    def _map(self, t: torch.Tensor, rows: int) -> bytes:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), rows)
        found = self._maps.get(key)
        if found is None:
            geometry = map_geometry(tuple(t.shape), tuple(t.stride()), t.element_size(), rows,
                                    self.swizzle)
            found = encode_map(t.data_ptr(), geometry, self.bf16)
            if len(self._maps) >= _MAP_CACHE_SIZE:
                self._maps.pop(next(iter(self._maps)))
            self._maps[key] = found
        return found

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, p: Problem, scale: float) -> None:
        """Launch on torch's current stream (inputs already validated by the caller)."""
        import cupy
        import torch

        if not scale > 0:
            # The kernel scales inside the exponent after taking the row maximum of raw scores.
            raise ValueError(f"the wgmma kernels take a positive softmax scale, got {scale}")
        c = self.candidate
        geo = launch_geometry(c, p.seq_q, p.heads, p.batch, self.sms)
        args: list = [
            ctypes.create_string_buffer(self._map(q, Q_BOX_ROWS), 128),
            ctypes.create_string_buffer(self._map(k, self.block_n), 128),
            ctypes.create_string_buffer(self._map(v, self.block_n), 128),
            ctypes.c_uint64(out.data_ptr()),
            ctypes.c_uint64(lse.data_ptr() if lse is not None else 0),
            ctypes.c_int32(p.seq_q), ctypes.c_int32(p.seq_k), ctypes.c_int32(p.heads),
            ctypes.c_int32(p.heads // p.kv_heads), ctypes.c_int32(geo.total_tiles),
            *(ctypes.c_int64(s) for s in out.stride()[:3]),
            ctypes.c_float(scale * LOG2E),
        ]
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = torch.cuda.current_stream(q.device)
        with cupy.cuda.Device(q.device.index):
            cupy.cuda.driver.launchKernel(
                self.function_ptr, geo.grid, 1, 1, c.threads, 1, 1, c.smem_bytes,
                stream.cuda_stream, ctypes.addressof(params), 0)
