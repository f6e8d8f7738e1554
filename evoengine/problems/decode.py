"""Decode over a KV cache: q_len (1..16) new tokens per sequence against a cache of
``cache_len`` keys, contiguous or paged (``evoengine.launch.decode`` has the layouts).

The workload is ``DecodeWorkload`` (keys read ``decode-b8-q1-h32-kv8-d128-c32768-paged64-fp16``);
the criterion is ``validate.check_decode_workload`` (float64 reference, SDPA per sequence as
the baseline, ragged lengths with 0 and queries that see no key, shuffled pages, everything
past a sequence poisoned with NaN); kernels are ``evoengine.decode.DecodeKernel``; the anchors
are SDPA's cuDNN and flash backends with ``enable_gqa`` on a contiguous cache (a gathered copy
of a paged one) and FlashAttention-4's paged/varlen call where it imports. Every contender is
timed by CUDA-graph replay: a decode step is microseconds, which launch gaps would swamp.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from evoengine.argtypes import positive_int
from evoengine.problems.base import Problem, Rate, TimedCall
from evoengine.workload import DTYPES

if TYPE_CHECKING:
    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict

PREFIX = "decode-"
LAYOUTS = ("paged", "contiguous")
MAX_Q_LEN = 16
TUNE_MAX_KV_BYTES = 16 << 30  # a tune's decode steps: K and V of at most this many bytes
_KEY = re.compile(r"decode-b(\d+)-q(\d+)-h(\d+)-kv(\d+)-d(\d+)-c(\d+)-(paged(\d+)|contig)-(\w+)")


@dataclass(frozen=True)
class DecodeWorkload:
    """q [batch, q_len, q_heads, head_dim]; a cache of ``cache_len`` keys per sequence, with
    kv_heads heads, contiguous [batch, cache_len, kv_heads, D] or in pages of ``page_size``
    (0 for a contiguous cache). Causal, aligned bottom-right."""

    kind: ClassVar[str] = "decode"

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    cache_len: int
    layout: str = "paged"
    page_size: int = 64
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("batch", "q_len", "q_heads", "kv_heads", "head_dim", "cache_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_len > MAX_Q_LEN:
            raise ValueError(f"q_len must be at most {MAX_Q_LEN} for decode, got {self.q_len} "
                             "(longer chunks are the forward's: --kind fwd)")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"query heads ({self.q_heads}) must be a multiple of kv heads "
                             f"({self.kv_heads})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "contiguous":
            object.__setattr__(self, "page_size", 0)
        elif (isinstance(self.page_size, bool) or not isinstance(self.page_size, int)
              or self.page_size <= 0 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of 2, got {self.page_size!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def paged(self) -> bool:
        return self.layout == "paged"

    # As a dispatch entry names a workload (launch.dispatch.Entry): the q_len, the cache
    # length and the query heads; decode is causal.
    @property
    def seq_q(self) -> int:
        return self.q_len

    @property
    def seq_k(self) -> int:
        return self.cache_len

    @property
    def heads(self) -> int:
        return self.q_heads

    @property
    def causal(self) -> bool:
        return True

    @property
    def capacity(self) -> int:
        """Keys a sequence's cache holds: cache_len, in whole pages when paged."""
        if not self.paged:
            return self.cache_len
        return -(-self.cache_len // self.page_size) * self.page_size

    @classmethod
    def from_key(cls, key: str) -> DecodeWorkload:
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a decode workload key: {key!r} (expected "
                             "decode-b8-q1-h32-kv8-d128-c32768-paged64-fp16 or ...-contig-fp16)")
        b, q, h, kv, d, c = (int(x) for x in m.groups()[:6])
        paged = m.group(8) is not None
        return cls(batch=b, q_len=q, q_heads=h, kv_heads=kv, head_dim=d, cache_len=c,
                   layout="paged" if paged else "contiguous",
                   page_size=int(m.group(8)) if paged else 0, dtype=m.group(9))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecodeWorkload:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def key(self) -> str:
        layout = f"paged{self.page_size}" if self.paged else "contig"
        return (f"{PREFIX}b{self.batch}-q{self.q_len}-h{self.q_heads}-kv{self.kv_heads}"
                f"-d{self.head_dim}-c{self.cache_len}-{layout}-{self.dtype}")

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (1: MHA)."""
        return self.q_heads // self.kv_heads

    def problem(self) -> dict[str, object]:
        """The dimensions compiled into a kernel: results across them are incomparable."""
        return {"HEAD_DIM": self.head_dim, "DTYPE": self.dtype, "PAGED": self.paged}

    def visible_pairs(self) -> int:
        """(query, key) pairs per query head and sequence: query i sees
        cache_len - q_len + i + 1 keys."""
        return sum(max(0, self.cache_len - self.q_len + i + 1) for i in range(self.q_len))

    def flops(self) -> float:
        """Matrix FLOPs (Q.K^T and P.V over the keys each query sees)."""
        return 4.0 * self.batch * self.q_heads * self.visible_pairs() * self.head_dim

    def kv_bytes(self) -> int:
        """Bytes of K and V a decode step must read: every sequence's cache_len keys."""
        return 2 * 2 * self.batch * self.cache_len * self.kv_heads * self.head_dim

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, **asdict(self)}


def parse_decode(spec: str, **kw: Any) -> DecodeWorkload:
    """Build from ``"B,Q,H,KV,D"`` (batch, q_len, query heads, kv heads, head dim)."""
    try:
        b, q, h, kv, d = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--decode must be B,Q,H,KV,D (five integers), got {spec!r}") from None
    return DecodeWorkload(batch=b, q_len=q, q_heads=h, kv_heads=kv, head_dim=d, **kw)


class Decode(Problem):
    kind = "decode"
    summary = "decode over a KV cache, contiguous or paged: q_len 1..16 new tokens per sequence"
    anchors = ("cudnn", "flash", "fa4", "flashinfer")

    def method(self) -> str:
        from evoengine import measure

        return (f"{measure.TIMING}, graph replay of {measure.GRAPH_CALLS} calls for every "
                "contender, inputs rotated over >= L2 where a set is smaller; anchors: SDPA's "
                "cuDNN and flash backends with enable_gqa on a contiguous cache (causal lower "
                "right for q_len > 1), FlashAttention-4's paged call and FlashInfer's paged "
                "decode (q_len 1) or prefill (causal, q_len > 1) wrappers where they import")

    def workload_from_dict(self, data: Mapping[str, Any]) -> DecodeWorkload:
        return DecodeWorkload.from_dict(data)

    def tune_workloads(self, geometry: ModelGeometry) -> list[DecodeWorkload]:
        """A model's decode steps for ``evoengine tune``: one new token per sequence against a
        paged cache (64-key pages) of 4K, 32K and the model's longest context (those up to
        it), at batch 1 and 8 where K and V fit TUNE_MAX_KV_BYTES; none for an encoder."""
        if not geometry.causal:
            return []  # an encoder has no cache to decode against
        caches = sorted({c for c in (4096, 32768) if c < geometry.max_seq} | {geometry.max_seq})
        calls = []
        for cache in caches:
            for batch in (1, 8):
                w = DecodeWorkload(batch=batch, q_len=1, q_heads=geometry.heads,
                                   kv_heads=int(geometry.kv_heads or geometry.heads),
                                   head_dim=geometry.head_dim, cache_len=cache,
                                   layout="paged", page_size=64, dtype=geometry.dtype)
                if w.kv_bytes() <= TUNE_MAX_KV_BYTES:
                    calls.append(w)
        return calls

    def workload_from_key(self, key: str) -> DecodeWorkload:
        return DecodeWorkload.from_key(key)

    def rate(self, workload: Any) -> Rate:
        """K and V bytes read per second (memory-bound: its FLOPs say little)."""
        return Rate(workload.kv_bytes() / 1e3, "GB/s")

    # Decode is causal by definition; a model's server keeps its cache paged or contiguous.
    variants = ("DTYPE", "PAGED")

    def variant(self, workload: Any, values: Mapping[str, Any]) -> DecodeWorkload:
        paged = bool(values["PAGED"])
        return replace(workload, dtype=values["DTYPE"], layout="paged" if paged else "contiguous",
                       page_size=(workload.page_size or 64) if paged else 0)

    def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
        parser.add_argument("--decode", metavar="B,Q,H,KV,D", help="decode (--kind decode): "
                            "batch, new tokens per sequence (1..16), query heads, kv heads, "
                            "head dim; with --cache-len, --layout, --page-size and --dtype")
        parser.add_argument("--cache-len", type=positive_int, metavar="N",
                            help="decode: keys per sequence's cache")
        parser.add_argument("--layout", choices=LAYOUTS, default="paged",
                            help="decode: paged (vLLM block table) or contiguous cache")
        parser.add_argument("--page-size", type=positive_int, default=64, metavar="N",
                            help="decode: keys per page of a paged cache (a power of 2)")

    def workload_from_arguments(self, args: argparse.Namespace) -> DecodeWorkload:
        if getattr(args, "decode", None) is None or getattr(args, "cache_len", None) is None:
            raise ValueError("--kind decode needs --decode B,Q,H,KV,D and --cache-len N")
        return parse_decode(args.decode, cache_len=args.cache_len, layout=args.layout,
                            page_size=args.page_size, dtype=getattr(args, "dtype", "fp16"))

    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        import torch

        from evoengine.decode import DecodeKernel

        kernel = DecodeKernel(candidate, compiled)
        kernel.load(torch.cuda.current_device())  # a bad cubin fails here
        return kernel

    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        from evoengine import validate

        return validate.check_decode_workload(kernel, workload, device=device)

    def graph_for(self, workload: Any) -> bool:
        return True

    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        """Sets of (q, k_cache, v_cache, cache_seqlens, block_table, out): every sequence at
        cache_len, pages shuffled; one set where a set alone passes L2, else enough to
        rotate past it."""
        import torch

        from evoengine import measure
        from evoengine.launch import KERNEL_DTYPES
        from evoengine.validate import decode_cache

        w = workload
        dtype = KERNEL_DTYPES[w.dtype]
        per_set = w.kv_bytes() + 4 * w.batch * w.q_len * w.q_heads * w.head_dim
        n = 1 if per_set >= measure.L2_FLUSH_BYTES else measure.copies_needed(per_set)
        sets = []
        for _ in range(n):
            q = torch.randn((w.batch, w.q_len, w.q_heads, w.head_dim), device=device,
                            dtype=dtype)
            k, v, lens, table = decode_cache(w.batch, [w.cache_len] * w.batch, w.capacity,
                                             w.kv_heads, w.head_dim, dtype, paged=w.paged,
                                             page_size=w.page_size or 1, device=str(device),
                                             poison=False)
            sets.append((q, k, v, lens, table, torch.empty_like(q)))
        return sets

    def timed_call(self, kernel: Any, workload: Any,
                   sets: Sequence[tuple[Any, ...]]) -> TimedCall:
        from evoengine.launch import softmax_scale
        from evoengine.launch.decode import check_decode_inputs

        q, k, v, lens, table, _ = sets[0]
        shape = check_decode_inputs(q, k, v, lens, table, head_dim=kernel.head_dim,
                                    dtype=kernel.dtype, paged=kernel.paged)
        scale = softmax_scale(None, workload.head_dim)

        def call(i: int) -> None:
            q, k, v, lens, table, out = sets[i]
            kernel.launch(q, k, v, lens, table, out, None, shape, causal=True, scale=scale)
        return call

    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        if anchor == "fa4":
            return time_fa4_decode(workload, sets, **timing)
        if anchor == "flashinfer":
            return time_flashinfer_decode(workload, sets, **timing)
        return time_sdpa_decode(anchor, workload, sets, **timing)


def contiguous_sets(workload: DecodeWorkload,
                    sets: Sequence[tuple[Any, ...]]) -> list[tuple[Any, Any, Any]]:
    """(q, k, v) of each set as SDPA takes them: [B, H, S, D] views of a contiguous
    [B, cache_len, KV, D] cache (gathered from the pages of a paged one)."""
    out = []
    for q, k, v, _lens, table, _ in sets:
        if table is not None:
            rows = (workload.batch, -1, *k.shape[2:])
            k = k[table.long()].reshape(rows)[:, :workload.cache_len]
            v = v[table.long()].reshape(rows)[:, :workload.cache_len]
        out.append((q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    return out


def sdpa_mask(workload: DecodeWorkload) -> Any:
    """SDPA's mask for a decode step: none at q_len 1, else causal aligned lower right."""
    if workload.q_len == 1:
        return None
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(workload.q_len, workload.cache_len)


ANCHOR_TOLERANCE = 2e-2  # an anchor's call that misreads the layout is refused, not timed


def refused_output(name: str, workload: DecodeWorkload, sets: Sequence[tuple[Any, ...]],
                   got: Any) -> bool:
    """Whether an anchor's output for the first sequence of ``sets[0]`` (``got``, [1, q_len,
    q_heads, D]) is off from SDPA in float32 on a float copy of that sequence's cache (not of
    the whole batch's); if so it says so in one line, and the anchor is not timed."""
    import torch

    q, k, v, lens, table, _ = sets[0]
    first = (q[:1], k if table is not None else k[:1], v if table is not None else v[:1],
             lens[:1], None if table is None else table[:1], None)
    q, k, v = (x.float() for x in contiguous_sets(replace(workload, batch=1), [first])[0])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=sdpa_mask(workload),
        enable_gqa=workload.q_heads != workload.kv_heads).transpose(1, 2)
    err = (got.float() - want).abs().max().item()
    if err <= ANCHOR_TOLERANCE:
        return False
    print(f"evoengine: {name}'s output on {workload.key()} is off by {err:.3g}: not timed",
          file=sys.stderr)
    return True


def time_sdpa_decode(backend: str, workload: DecodeWorkload, sets: Sequence[tuple[Any, ...]],
                     **timing: Any) -> Timing | None:
    """SDPA restricted to ``backend`` with enable_gqa on a contiguous cache; q_len > 1 takes
    a lower-right causal mask (torch.nn.attention.bias.causal_lower_right), as ours. None
    where the backend refuses the call."""
    import torch

    from evoengine import measure

    views = contiguous_sets(workload, sets)
    gqa = workload.q_heads != workload.kv_heads
    mask = sdpa_mask(workload)

    def call(i: int) -> None:
        q, k, v = views[i]
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         enable_gqa=gqa)
    try:
        with measure.sdpa_backend(backend):
            return measure.time_calls(call, len(views), **timing)
    except (RuntimeError, ValueError, TypeError) as e:
        print(f"evoengine: SDPA {backend} cannot run {workload.key()}: "
              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return None


def graph_or_eager(call: Any, n_sets: int, **timing: Any) -> Timing:
    """``measure.time_calls``; where graph replay was asked and the call does not capture
    (an anchor's host work inside), the same call timed eagerly (its Timing says which)."""
    from evoengine import measure

    try:
        return measure.time_calls(call, n_sets, **timing)
    except RuntimeError:
        if not timing.get("graph"):
            raise
        return measure.time_calls(call, n_sets, **{**timing, "graph": False})


def fa4_decode() -> Any:
    """FlashAttention-4's call for a paged or contiguous cache with per-sequence lengths:
    ``flash_attn_with_kvcache`` where the cute interface has it, else its
    ``flash_attn_varlen_func`` (``seqused_k``, ``page_table``); None where neither imports."""
    from evoengine import measure

    if measure.fa4_attention() is None:
        return None
    import flash_attn.cute as cute  # type: ignore[import-not-found]

    return getattr(cute, "flash_attn_with_kvcache", None) or getattr(
        cute, "flash_attn_varlen_func", None)


def time_fa4_decode(workload: DecodeWorkload, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
    """FA4 on the same tensors as ours (BSHD q, the cache as is, int32 lengths and block
    table), checked once against SDPA (``refused_output``); by graph replay where it captures,
    else eager (the result says which)."""
    from evoengine import measure

    fn = fa4_decode()
    if fn is None:
        return None
    names = set(inspect.signature(fn).parameters)

    def kwargs(lens: Any, table: Any) -> dict[str, Any]:
        if "cache_seqlens" in names:  # flash_attn_with_kvcache
            kw = {"cache_seqlens": lens, "causal": True}
            if table is not None:
                kw["page_table" if "page_table" in names else "block_table"] = table
            return kw
        kw = {"seqused_k": lens, "causal": True}
        if table is not None:
            kw["page_table"] = table
        return kw

    calls = [(q, k, v, kwargs(lens, table)) for q, k, v, lens, table, _ in sets]

    def call(i: int) -> Any:
        q, k, v, kw = calls[i]
        return fn(q, k, v, **kw)
    try:
        got = measure.fa4_output(call(0))[:1]  # the first call compiles
        if refused_output("FlashAttention-4", workload, sets, got):
            return None
        return graph_or_eager(call, len(calls), **timing)
    except (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError) as e:
        print(f"evoengine: FlashAttention-4 cannot run {workload.key()}: {e}", file=sys.stderr)
        return None


FLASHINFER_WORKSPACE_BYTES = 128 << 20  # its recommended float workspace (split-KV partials)


@functools.cache
def flashinfer_module() -> Any:
    """``flashinfer`` where it imports (a wheel and its JIT toolchain), else None (said once)."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 (any failure to import means: not this anchor)
        print(f"evoengine: FlashInfer not timed ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return flashinfer


def flashinfer_calls(fi: Any, workload: DecodeWorkload,
                     sets: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One planned FlashInfer call per set, on the same tensors as ours: the vLLM layout is
    its NHD one ([pages, page_size, kv_heads, D] for K and V apart); a contiguous cache
    [batch, capacity, kv_heads, D] is batch pages of its capacity. q_len 1: the paged decode
    wrapper (tensor cores for grouped heads); q_len > 1: the paged prefill wrapper, causal
    (FlashInfer aligns the mask bottom-right, as ours). Each set plans its own wrapper over
    one shared float workspace (the calls run one after another). Every sequence must hold a
    key (the benchmark's do): a last page of no entry is not a plan FlashInfer takes."""
    import torch

    w = workload
    dev = sets[0][0].device
    dtype = sets[0][0].dtype
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    calls = []
    for q, k, v, lens, table, _out in sets:
        if table is None:  # contiguous: sequence b is page b
            page_size = k.shape[1]
            pages = torch.arange(w.batch, dtype=torch.int32, device=dev)[:, None]
        else:
            page_size = w.page_size
            pages = table
        if bool((lens <= 0).any()):
            raise ValueError("an empty sequence")
        used = (lens + page_size - 1) // page_size  # pages per sequence
        indptr = torch.zeros(w.batch + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(used, 0)
        width = torch.arange(pages.shape[1], device=dev)[None, :]
        indices = pages[width < used[:, None]].to(torch.int32).contiguous()
        last = (lens - (used - 1) * page_size).to(torch.int32)
        if w.q_len == 1:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=w.q_heads != w.kv_heads)
            wrapper.plan(indptr, indices, last, w.q_heads, w.kv_heads, w.head_dim, page_size,
                         q_data_type=dtype, kv_data_type=dtype)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            qo = torch.arange(0, (w.batch + 1) * w.q_len, w.q_len, dtype=torch.int32,
                              device=dev)
            wrapper.plan(qo, indptr, indices, last, w.q_heads, w.kv_heads, w.head_dim,
                         page_size, causal=True, q_data_type=dtype, kv_data_type=dtype)
        flat_q = q.reshape(w.batch * w.q_len, w.q_heads, w.head_dim)
        calls.append((wrapper, flat_q, (k, v)))
    return calls


def time_flashinfer_decode(workload: DecodeWorkload, sets: Sequence[tuple[Any, ...]],
                           **timing: Any) -> Timing | None:
    """FlashInfer's paged wrappers on the same tensors as ours (``flashinfer_calls``), checked
    once against SDPA (``refused_output``), then timed by graph replay where the call
    captures, else eagerly (the result says which). None where it does not import or run."""
    fi = flashinfer_module()
    if fi is None:
        return None
    w = workload
    try:
        calls = flashinfer_calls(fi, w, sets)

        def call(i: int) -> Any:
            wrapper, flat_q, cache = calls[i]
            return wrapper.run(flat_q, cache)
        got = call(0).reshape(w.batch, w.q_len, w.q_heads, w.head_dim)[:1]  # compiles (JIT)
        if refused_output("FlashInfer", w, sets, got):
            return None
        return graph_or_eager(call, len(calls), **timing)
    except Exception as e:  # noqa: BLE001 (an anchor that cannot run this row is left out)
        print(f"evoengine: FlashInfer cannot run {w.key()}: {type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return None


def time_copy(workload: DecodeWorkload, sets: Sequence[tuple[Any, ...]], *,
              kernel: bool = False, **timing: Any) -> Timing:
    """A device-to-device copy of the K and V bytes a decode step reads (each set's cache
    into one destination), graph-replayed: the bandwidth the kernel is measured against.
    ``kernel``: the same bytes through an elementwise kernel (``torch.neg``) instead of
    ``copy_``, whose graph node is a memcpy: on the H200 (2026-11-28) that node moved 2.7 TB/s
    (read + write) at 1 GB and more, the kernel 4.1 TB/s. Rows divide by the faster."""
    import torch

    from evoengine import measure

    n = workload.kv_bytes() // 4  # elements of K (or V) a step reads
    flat = [(k.reshape(-1)[:n], v.reshape(-1)[:n]) for _q, k, v, *_ in sets]
    dst = torch.empty(2 * n, dtype=sets[0][1].dtype, device=sets[0][1].device)
    to_k, to_v = dst[:n], dst[n:]
    copy = (lambda src, to: torch.neg(src, out=to)) if kernel else (lambda src, to: to.copy_(src))

    def call(i: int) -> None:
        k, v = flat[i]
        copy(k, to_k)
        copy(v, to_v)
    return measure.time_calls(call, len(flat), **timing)


def bandwidth_fraction(workload: DecodeWorkload, ours_us: float, copy_us: float) -> float:
    """(K/V bytes read / ours) over the copy's (read + write) bytes per second."""
    return (workload.kv_bytes() / ours_us) / (2 * workload.kv_bytes() / copy_us)
