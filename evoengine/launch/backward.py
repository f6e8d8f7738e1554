"""The backward kernel's launcher: ``CudaBackward``, three (or four) kernels of one cubin.

Backward ABI (mma_bwd, wgmma_bwd): three kernels of one cubin, launched in order on torch's
current stream; the first and last are one source for every backward family
(``templates/common/bwd_prepost.cuh``):

- ``attn_bwd_pre(O, dO, LSE, LSE2, DELTA, dQacc, seq_q, heads, seq_q_pad, o_sb, o_sh, o_ss,
  do_sb, do_sh, do_ss)`` on (ceil(seq_q_pad / 32), heads, batch) blocks of 256 threads: per
  query row, delta = rowsum(dO * O) and the log-sum-exp in base 2, padded to whole query
  blocks (seq_q_pad); zeroes the fp32 dQ accumulator (dQacc, null when dQ is stored in parts);
- ``attn_bwd([tm_q, tm_dO,] Q, K, V, dO, LSE2, DELTA, dQacc, dQpart, dK, dV, seq_q, seq_k,
  heads, kv_group, seq_q_pad, <q, k, v, dO, dK, dV strides: batch, head, seq each>, scale,
  scale_log2)`` on
  (ceil(seq_k / block_n), kv_heads, batch) blocks of the candidate's threads and shared memory:
  dK and dV (summed over each key/value head's query heads), and dQ added into dQacc with
  atomics, or, when dQpart is given, stored per key block into dQpart [key blocks, B, H, Sq, D]
  (fp32). A kernel whose ring a TMA producer loads (``loader="tma"``) takes first two
  128-byte ``__grid_constant__`` CUtensorMaps of Q and dO over (head_dim, seq, heads, batch)
  with the tensors' own strides, boxes of one swizzle panel by block_m rows (``tma.py``);
- ``attn_bwd_post(dQacc, dQpart, dQ, seq_q, seq_k, heads, dq_sb, dq_sh, dq_ss, scale)`` on
  (ceil(seq_q * head_dim / 8 / 256), heads, batch) blocks of 256 threads: dQ to fp16/bf16,
  scaled, the parts summed in key order.

A kernel with a group split (wgmma_bwd's GROUP_SPLIT s > 1) runs ``attn_bwd`` on (key blocks,
kv_heads x s, batch) blocks, block (kv head h, split j) taking its share of h's query heads,
and gets, in place of dK and dV, an fp32 workspace of s shares each, [batch, kv_heads x s, seq_k,
head_dim] with those strides (in floats); a fourth kernel, ``attn_bwd_kv_post(dKpart, dVpart,
dK, dV, seq_k, splits, part_sb, part_sh, part_split, <dK, dV strides>)`` on (ceil(seq_k *
head_dim / 8 / 256), kv_heads, batch) blocks of 256 threads, adds each row's shares in split
order into dK and dV.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from evoengine.launch.core import (
    LOG2E,
    Loaded,
    ParamBuffer,
    check_grid,
    check_inputs,
    check_like,
    check_out,
    launch_in_context,
    launch_programmatic_in_context,
    raw_stream,
    softmax_scale,
)
from evoengine.launch.forward import CudaKernel
from evoengine.launch.tma import TmaParams

BACKWARD_ENTRIES = ("attn_bwd_pre", "attn_bwd", "attn_bwd_post")
# The launch shapes of the first and last kernels, as the template's cfg::PRE_THREADS,
# PRE_ROWS and POST_THREADS (tests/test_backward.py reads them from a rendered source).
PRE_THREADS = 256
PRE_ROWS = 32
POST_THREADS = 256



BWD_PRE_ARGS = ParamBuffer("QQQQQQ" + "iii" + "q" * 6)
BWD_MAIN_ARGS = ParamBuffer("Q" * 10 + "i" * 5 + "q" * 18 + "ff")
BWD_MAIN_TMA_ARGS = ParamBuffer("MM" + "Q" * 10 + "i" * 5 + "q" * 18 + "ff")
# ... with K and V loaded by the producer too (KV_LOAD "producer"): their maps after Q's and dO's.
BWD_MAIN_TMA_KV_ARGS = ParamBuffer("MM" + BWD_MAIN_TMA_ARGS.codes)
LOADERS = ("cp_async", "tma")  # wgmma_bwd's LOADER; mma_bwd's kernels are all cp_async
# wgmma_bwd's MAIN_LAUNCH: the main kernel after the first in stream order, or as its
# programmatic dependent (sm_90: it starts as the first one's blocks finish and waits for its
# results by griddepcontrol.wait); mma_bwd's are all "stream".
MAIN_LAUNCHES = ("stream", "programmatic")
KV_LOADS = ("consumers", "producer")  # wgmma_bwd's KV_LOAD: "producer" takes K's and V's maps
BWD_POST_ARGS = ParamBuffer("QQQ" + "iii" + "qqq" + "f")
BWD_KV_POST = "attn_bwd_kv_post"  # the fourth kernel, of kernels with a group split
BWD_KV_POST_ARGS = ParamBuffer("QQQQ" + "ii" + "qqq" + "q" * 6)
# ... compiled with VARLEN: then cu_seqlens_q, cu_seqlens_k, total_q (launch/varlen_backward.py)
BWD_KV_POST_RAGGED_ARGS = ParamBuffer(BWD_KV_POST_ARGS.codes + "QQi")



class CudaBackward:
    """One backward kernel (three entries of one cubin or source):
    ``kernel(q, k, v, out, lse, dout, causal=...) -> (dq, dk, dv)``.

    ``out`` and ``lse`` are the forward's output and natural-log log-sum-exp (float32
    [B, H, Sq], contiguous; -inf on rows that see no key), as the forward kernels write them.
    ``deterministic=True`` (or a kernel built with ``dq_accum="separate"``) stores dQ per key
    block and sums the parts in order: bit-identical results run to run, at the cost of one
    fp32 dQ per key block of workspace. ``loader="tma"``: the kernel takes tensor maps of
    Q and dO with the tensor maps' ``swizzle`` (bytes). ``main_launch="programmatic"``: the
    main kernel is launched as a programmatic dependent of the first (built with MAIN_LAUNCH
    "programmatic", it waits for the first's results). Loads on first use per device.
    """

    kind = "bwd"  # the problem it solves (dispatch.KERNEL_CLASSES)

    def __init__(self, name: str, *, head_dim: int, dtype: str, causal: bool, block_m: int,
                 block_n: int, threads: int, smem_bytes: int, dq_accum: str,
                 arch: str | None = None, cubin: bytes | None = None,
                 source: str | None = None,
                 defines: Mapping[str, int] | None = None, loader: str = "cp_async",
                 swizzle: int | None = None, group_split: int = 1,
                 main_launch: str = "stream", kv_load: str = "consumers") -> None:
        if dq_accum not in ("atomic", "separate"):
            raise ValueError(f"kernel {name}: dq_accum must be 'atomic' or 'separate', "
                             f"got {dq_accum!r}")
        if loader not in LOADERS:
            raise ValueError(f"kernel {name}: loader must be one of {LOADERS}, got {loader!r}")
        if main_launch not in MAIN_LAUNCHES:
            raise ValueError(f"kernel {name}: main_launch must be one of {MAIN_LAUNCHES}, got "
                             f"{main_launch!r}")
        if kv_load not in KV_LOADS or (kv_load == "producer" and loader != "tma"):
            raise ValueError(f"kernel {name}: kv_load must be one of {KV_LOADS} ('producer' "
                             f"with a TMA loader), got {kv_load!r}")
        if loader == "tma" and not isinstance(swizzle, int):
            raise ValueError(f"kernel {name}: a TMA loader needs the tensor maps' swizzle "
                             f"(bytes), got {swizzle!r}")
        common: dict[str, Any] = dict(head_dim=head_dim, dtype=dtype, causal=causal,
                                      block_m=block_m, arch=arch, cubin=cubin, source=source,
                                      defines=defines)
        pre, main, post = BACKWARD_ENTRIES
        self.pre = CudaKernel(f"{name}:{pre}", threads=PRE_THREADS, smem_bytes=0, entry=pre,
                              **common)
        # A TMA kernel's main entry carries the tensor-map cache and the sm_90a check of the
        # forward's TMA kernels (its own launch is never used: launch() packs the arguments).
        tma = TmaParams(int(swizzle), int(block_n), False) if loader == "tma" else None
        self.main = CudaKernel(name, threads=threads, smem_bytes=smem_bytes, entry=main,
                               tma=tma, **common)
        self.post = CudaKernel(f"{name}:{post}", threads=POST_THREADS, smem_bytes=0,
                               entry=post, **common)
        if isinstance(group_split, bool) or not isinstance(group_split, int) or group_split < 1:
            raise ValueError(f"kernel {name}: group_split must be a positive int, got "
                             f"{group_split!r}")
        self.group_split = group_split
        self.kv_post = (CudaKernel(f"{name}:{BWD_KV_POST}", threads=POST_THREADS, smem_bytes=0,
                                   entry=BWD_KV_POST, **common) if group_split > 1 else None)
        self.name, self.arch, self.cubin, self.source = name, arch, cubin, source
        self.head_dim, self.dtype, self.causal = self.main.head_dim, dtype, self.main.causal
        self.block_m, self.block_n = self.main.block_m, int(block_n)
        self.dq_accum = dq_accum
        self.loader = loader
        self.main_launch = main_launch
        self.kv_load = kv_load

    @classmethod
    def spec_args(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's arguments but the name, arch, cubin and source, from a kernel spec
        (an export's, or ``Candidate.spec()``)."""
        problem, params = spec["problem"], spec["params"]
        loader = str(params.get("LOADER", "cp_async"))  # mma_bwd, and specs exported before it
        return dict(head_dim=int(problem["HEAD_DIM"]), dtype=str(problem["DTYPE"]),
                    causal=bool(problem["CAUSAL"]), block_m=int(spec["block_m"]),
                    block_n=int(params["BLOCK_N"]), threads=int(spec["threads"]),
                    smem_bytes=int(spec["smem_bytes"]), dq_accum=str(params["DQ_ACCUM"]),
                    defines=spec.get("defines"), loader=loader,
                    swizzle=int(params["SWIZZLE"]) if loader == "tma" else None,
                    group_split=int(params.get("GROUP_SPLIT", 1)),
                    main_launch=str(params.get("MAIN_LAUNCH", "stream")),
                    kv_load=str(params.get("KV_LOAD", "consumers")))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], arch: str | None, *, cubin: bytes | None,
                  source: str | None) -> CudaBackward:
        """The kernel an export's spec describes (``dispatch.kernel_from_spec``)."""
        return cls(spec["name"], arch=arch, cubin=cubin, source=source, **cls.spec_args(spec))

    def __repr__(self) -> str:
        return f"CudaBackward({self.name!r})"

    def load(self, index: int) -> None:
        """Load the kernels on CUDA device ``index`` (once each); raises ``NoKernelError``
        where they cannot run."""
        for kernel in self.kernels():
            kernel.load(index)

    def kernels(self) -> tuple[CudaKernel, ...]:
        """The entries a launch runs, in order (the fourth only with a group split)."""
        return (self.pre, self.main, self.post, *((self.kv_post,) if self.kv_post else ()))

    def split_outputs(self, dk: Tensor, dv: Tensor, kv_heads: int, rows: int, batch: int,
                      strides: list[int],
                      ragged: bool = False) -> tuple[Tensor | None, list[int], list[int]]:
        """Where the main kernel writes dK and dV: their pointers and ``strides`` (dK's then
        dV's batch, head and row strides, as the kernel takes them), or, with a group split,
        an fp32 workspace of the splits' shares ``[2, batch, kv_heads x splits, rows,
        head_dim]`` (``ragged``: batch 1, rows total_k, and a batch stride of 0: the kernel's
        batch index is the sequence) with its strides in floats. Returns (workspace or None,
        pointers, strides)."""
        if self.kv_post is None:
            return None, [dk.data_ptr(), dv.data_ptr()], strides
        parts = torch.empty((2, batch, kv_heads * self.group_split, rows, dk.shape[-1]),
                            dtype=torch.float32, device=dk.device)
        sb, sh, ss = parts.stride()[1:4]
        pointers = [parts[0].data_ptr(), parts[1].data_ptr()]
        return parts, pointers, [0 if ragged else sb, sh, ss] * 2

    def kv_operands(self, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """K and V as the producer's tensor maps describe them ([B, Hkv, Sk, D]; a ragged
        launcher passes [1, Hkv, total_k, D] views), or () where the consumers load them."""
        return tuple(tma_operand(t) for t in (k, v)) if self.kv_load == "producer" else ()

    def launch_main(self, main: Loaded, gx: int, gy: int, gz: int, stream: int,
                    args: Any) -> None:
        """The main kernel on a (gx, gy, gz) grid with the packed ``args``: after the first
        kernel in stream order, or as its programmatic dependent (``main_launch``)."""
        config = (main.fn, gx, gy, gz, self.main.threads, 1, 1, self.main.smem_bytes, stream,
                  ctypes.addressof(args[1]))
        if self.main_launch == "programmatic":
            launch_programmatic_in_context(main, config)
        else:
            launch_in_context(main, (*config, 0))

    def launch_kv_post(self, parts: Tensor, dk: Tensor, dv: Tensor, seq_k: int, batch: int,
                       stream: int, index: int, strides: list[int],
                       ragged: tuple[int, ...] = ()) -> None:
        """The fourth kernel: the splits' shares in ``parts`` added into dK and dV (``strides``:
        theirs as the main kernel would have taken them; ``ragged``: cu_seqlens_q,
        cu_seqlens_k and total_q, each sequence's shares from its first key row)."""
        assert self.kv_post is not None
        loaded = self.kv_post.load(index)
        hkv = parts.shape[2] // self.group_split
        sb, sh = (0 if ragged else parts.stride(1)), parts.stride(2)
        buffer = BWD_KV_POST_RAGGED_ARGS if ragged else BWD_KV_POST_ARGS
        args = buffer.pack(parts[0].data_ptr(), parts[1].data_ptr(), dk.data_ptr(),
                           dv.data_ptr(), seq_k, self.group_split, sb, sh * self.group_split, sh,
                           *strides, *ragged)
        chunks = seq_k * (dk.shape[-1] // 8)
        launch_in_context(loaded, (loaded.fn, -(-chunks // POST_THREADS), hkv, batch,
                                   POST_THREADS, 1, 1, 0, stream, ctypes.addressof(args[1]), 0))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dout: Tensor, *, causal: bool, scale: float | None = None,
                 dq: Tensor | None = None, dk: Tensor | None = None, dv: Tensor | None = None,
                 deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of attention(q, k, v) for the output gradient ``dout``, written into
        ``dq``, ``dk``, ``dv`` where given (any strides, contiguous last dim)."""
        p = check_inputs(q, k, v, head_dim=self.head_dim, dtype=self.dtype)
        check_grid(p)
        if bool(causal) != self.causal:
            raise ValueError(f"this kernel is compiled for causal={self.causal}, "
                             f"got causal={bool(causal)}")
        check_like("out", out, q, "q")
        check_like("dout", dout, q, "q")
        if not isinstance(lse, Tensor):  # required here: what the forward wrote
            raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
        check_out(None, q, lse, p)
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
        """Launch the kernels on torch's current stream, without checks."""
        b, h, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        index = q.get_device()
        pre, main, post = (kernel.load(index) for kernel in (self.pre, self.main, self.post))
        stream = raw_stream(index)
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
        launch_in_context(pre, (pre.fn, -(-seq_q_pad // PRE_ROWS), h, b, PRE_THREADS, 1, 1,
                                 0, stream, ctypes.addressof(args[1]), 0))
        grad_strides = [*dk.stride()[:3], *dv.stride()[:3]]
        shares, (dk_ptr, dv_ptr), out_strides = self.split_outputs(dk, dv, hkv, sk, b,
                                                                   grad_strides)
        strides = [s for t in (q, k, v, dout) for s in t.stride()[:3]] + out_strides
        main_args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse2.data_ptr(),
                     delta.data_ptr(), acc_ptr, part_ptr, dk_ptr, dv_ptr, sq, sk,
                     h, h // hkv, seq_q_pad, *strides, scale, scale * LOG2E)
        if self.loader == "tma":
            q_tma, dout_tma = tma_operand(q), tma_operand(dout)
            maps = [self.main._tensor_map(q_tma, self.block_m),
                    self.main._tensor_map(dout_tma, self.block_m)]
            kv_tma = self.kv_operands(k, v)
            maps += [self.main._tensor_map(t, self.block_n) for t in kv_tma]
            buffer = BWD_MAIN_TMA_KV_ARGS if kv_tma else BWD_MAIN_TMA_ARGS
            args = buffer.pack(*maps, *main_args)
        else:
            q_tma = dout_tma = kv_tma = None
            args = BWD_MAIN_ARGS.pack(*main_args)
        self.launch_main(main, n_blocks, hkv * self.group_split, b, stream, args)
        if shares is not None:
            self.launch_kv_post(shares, dk, dv, sk, b, stream, index, grad_strides)
        args = BWD_POST_ARGS.pack(acc_ptr, part_ptr, dq.data_ptr(), sq, sk, h,
                                  *dq.stride()[:3], scale)
        chunks = sq * (d // 8)
        launch_in_context(post, (post.fn, -(-chunks // POST_THREADS), h, b, POST_THREADS, 1, 1,
                                  0, stream, ctypes.addressof(args[1]), 0))
        del rows, acc, part, q_tma, dout_tma, kv_tma, shares  # every launch has read them


def tma_operand(t: Tensor) -> Tensor:
    """``t`` where a tensor map can describe it (byte strides positive multiples of 16 on every
    dim longer than 1), else a contiguous copy: an output gradient that autograd expanded
    from a scalar has stride 0 (the cp.async kernels read it as it is)."""
    elem = t.element_size()
    if all(size == 1 or (stride > 0 and stride * elem % 16 == 0)
           for size, stride in zip(t.shape[:3], t.stride()[:3], strict=True)):
        return t
    return t.contiguous()

