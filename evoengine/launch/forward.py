"""The forward kernel's launcher: ``CudaKernel``, one compiled attention forward.

Kernel ABI (mma, wmma): ``extern "C" __global__ attn_fwd(Q, K, V, O, LSE, seq_q, seq_k,
heads, kv_group, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss,
scale_log2)`` on a grid of (ceil(seq_q / block_m), heads, batch) blocks; LSE may be null.

TMA ABI (wgmma, sm_90a): ``attn_fwd(CUtensorMap q, k, v, O, LSE, seq_q, seq_k, heads,
kv_group, total_tiles, o_sb, o_sh, o_ss, scale_log2, tile_counter)`` on a 1-D grid of tiles
(query block, head, batch), or one block per SM when persistent. The tensor maps are 128-byte
``__grid_constant__`` parameters built per call with the driver's ``cuTensorMapEncodeTiled``
(``tma.py``) over (head_dim, seq, heads, batch) with the tensors' own strides.
``tile_counter`` (int32*) is where a dynamically scheduled kernel draws its tiles: one int32
per (kernel, device, stream), zeroed on the stream right before each launch (a memset node
when a graph is captured, so every replay starts from zero too); null for every other kernel.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from evoengine.launch.core import (
    KERNEL_DTYPES,
    KERNEL_NAME,
    LOG2E,
    MIN_SM,
    NVRTC_OPTIONS,
    Loaded,
    NoKernelError,
    Problem,
    check_grid,
    check_inputs,
    check_out,
    cubin_runs_on,
    device_arch,
    in_context,
    launch_in_context,
    raw_stream,
    sm_count,
    sm_number,
    softmax_scale,
    zero_int32,
)
from evoengine.launch.tma import (
    TMA_ARG_OFFSETS,
    TMA_ARGS,
    TMA_O_ARG_OFFSETS,
    TMA_O_ARGS,
    TMA_O_ROWS,
    TMA_Q_ROWS,
    TmaParams,
    encode_tensor_map,
    tma_geometry,
    tma_grid,
    tma_params,
)

# The launch arguments, packed once per call into a buffer the driver reads: 5 pointers,
# 4 int32, 12 int64 strides, 1 float. Each field sits at its natural alignment, as in the
# kernel's parameter space.
_ARGS = struct.Struct("=5Q4i12qf")
_ARG_OFFSETS = (*range(0, 40, 8), *range(40, 56, 4), *range(56, 152, 8), 152)



class CudaKernel:
    """One attention kernel: machine code for one target and/or its CUDA source.

    Loads on first use per device: the cubin where it runs on that device, otherwise the
    source compiled there with cupy's NVRTC. ``kernel(q, k, v, scale=, out=, lse=)`` is the
    call the validation criterion makes; ``launch`` is the unchecked hot path.
    """

    kind = "fwd"  # the problem it solves (dispatch.KERNEL_CLASSES)

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
        # dynamic schedule: the tile counter of each (device, stream), kept for the kernel's life
        self._counters: dict[tuple[int, int], Tensor] = {}
        self._loaded: dict[int, Loaded] = {}
        self._load_lock = threading.Lock()
        # One argument buffer per kernel, and the array of pointers into it that
        # cuLaunchKernel takes; the lock keeps a packed buffer intact until the launch.
        packing, offsets = ((TMA_O_ARGS, TMA_O_ARG_OFFSETS) if tma and tma.o_store
                            else (TMA_ARGS, TMA_ARG_OFFSETS) if tma else (_ARGS, _ARG_OFFSETS))
        self._args = ctypes.create_string_buffer(packing.size)
        base = ctypes.addressof(self._args)
        self._argv = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()

    @classmethod
    def spec_args(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's arguments but the name, arch, cubin and source, from a kernel spec
        (an export's, or ``Candidate.spec()``)."""
        problem = spec["problem"]
        return dict(head_dim=int(problem["HEAD_DIM"]), dtype=str(problem["DTYPE"]),
                    causal=bool(problem["CAUSAL"]), block_m=int(spec["block_m"]),
                    threads=int(spec["threads"]), smem_bytes=int(spec["smem_bytes"]),
                    defines=spec.get("defines"),
                    tma=tma_params(spec.get("family", ""), spec.get("params", {})))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], arch: str | None, *, cubin: bytes | None,
                  source: str | None) -> CudaKernel:
        """The kernel an export's spec describes (``dispatch.kernel_from_spec``)."""
        return cls(spec["name"], arch=arch, cubin=cubin, source=source, **cls.spec_args(spec))

    def __repr__(self) -> str:
        return f"CudaKernel({self.name!r})"

    def load(self, index: int) -> Loaded:
        """Load on CUDA device ``index`` (once); raises ``NoKernelError`` where it cannot run."""
        loaded = self._loaded.get(index)
        if loaded is not None:
            return loaded
        with self._load_lock:
            if index not in self._loaded:
                self._loaded[index] = self._load(index)
        return self._loaded[index]

    def _load(self, index: int) -> Loaded:
        import cupy
        from cupy.cuda import driver, runtime

        arch = device_arch(index)
        if sm_number(arch) < MIN_SM:
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
            return Loaded(fn.ptr, driver.ctxGetCurrent(), driver.launchKernel,
                           driver.ctxGetCurrent, driver.ctxSetCurrent, (owner, fn),
                           driver.launchCooperativeKernel)

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
        stream = raw_stream(index)
        grid_x = (p.seq_q + self.block_m - 1) // self.block_m
        with self._lock:
            _ARGS.pack_into(
                self._args, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                0 if lse is None else lse.data_ptr(), p.seq_q, p.seq_k, p.heads,
                p.heads // p.kv_heads, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1],
                vs[2], os_[0], os_[1], os_[2], scale * LOG2E)
            launch_in_context(loaded, (loaded.fn, grid_x, p.heads, p.batch, self.threads, 1, 1,
                                        self.smem_bytes, stream, self._argv_ptr, 0))

    def _tensor_map(self, t: Tensor, rows: int, pack: int = 0) -> bytes:
        """The map of ``t`` in boxes of ``rows`` rows (``pack`` > 0: a PACK_GQA kernel's Q,
        ``pack`` heads per token)."""
        assert self.tma is not None
        key = (t.data_ptr(), tuple(t.shape), t.stride(), rows, pack)
        found = self._maps.get(key)
        if found is None:
            geometry = tma_geometry(tuple(t.shape), t.stride(), t.element_size(), rows,
                                    self.tma.swizzle, pack)
            found = encode_tensor_map(t.data_ptr(), geometry, self.dtype)
            if len(self._maps) >= 64:  # lengths vary without bound; keep the cache small
                self._maps.clear()
            self._maps[key] = found
        return found

    def _q_map(self, q: Tensor, kv_group: int) -> tuple[bytes, int]:
        """Q's tensor map and the heads per token its tiles pack (1: unpacked, the rank-4
        map; PACK_GQA: ``TmaParams.pack_heads``, the rank-5 map even when that is 1)."""
        assert self.tma is not None
        pack = self.tma.pack_heads(kv_group)
        return self._tensor_map(q, TMA_Q_ROWS, pack if self.tma.pack else 0), pack

    def _launch_tma(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor | None,
                    p: Problem, scale: float) -> None:
        assert self.tma is not None
        index = q.get_device()
        loaded = self._loaded.get(index) or self.load(index)
        q_map, pack = self._q_map(q, p.heads // p.kv_heads)
        grid, tiles = tma_grid(self.block_m, p.seq_q, p.heads, p.batch, self.tma.persistent,
                               sm_count(index), pack)
        maps = (q_map, self._tensor_map(k, self.tma.block_n), self._tensor_map(v, self.tma.block_n))
        os_ = out.stride()
        stream = raw_stream(index)
        with self._lock:  # the argument buffer and the counters: one launch at a time
            counter = self._counter(q.device, stream) if self.tma.dynamic else 0
            args = (*maps, out.data_ptr(), 0 if lse is None else lse.data_ptr(), p.seq_q, p.seq_k,
                    p.heads, p.heads // p.kv_heads, tiles, os_[0], os_[1], os_[2], scale * LOG2E,
                    counter)
            if self.tma.o_store:
                TMA_O_ARGS.pack_into(self._args, 0, *args, self._tensor_map(out, TMA_O_ROWS))
            else:
                TMA_ARGS.pack_into(self._args, 0, *args)
            if counter:  # zeroed on this stream right before the launch that draws from it
                in_context(loaded, zero_int32, counter, stream)
            launch_in_context(loaded, (loaded.fn, grid, 1, 1, self.threads, 1, 1,
                                        self.smem_bytes, stream, self._argv_ptr, 0))

    def _counter(self, device: torch.device, stream: int) -> int:
        """The address of this kernel's tile counter for launches on ``stream``: launches on
        one stream run in order, so one int32 zeroed before each serves them all (and graph
        replays, and a launch after one that trapped); streams have their own, as their
        launches may overlap. A graph captures the memset with the launch. (Two graphs
        captured on one stream and replayed at once on two streams would share it.)"""
        key = (device.index if device.index is not None else -1, stream)
        found = self._counters.get(key)
        if found is None:
            found = self._counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
        return found.data_ptr()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                 out: Tensor | None = None, lse: Tensor | None = None) -> Tensor:
        """Attention of q over k, v. ``lse`` (float32 [B, H, Sq]) receives the log-sum-exp."""
        p = check_inputs(q, k, v, head_dim=self.head_dim, dtype=self.dtype)
        check_grid(p)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        check_out(out, q, lse, p)
        self.launch(q, k, v, out, lse, p, softmax_scale(scale, p.head_dim))
        return out

