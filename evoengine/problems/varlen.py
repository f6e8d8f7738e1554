"""Ragged (variable-length) prefill: the forward over a batch of sequences of their own lengths.

Q is packed ``[total_q, heads, head_dim]`` and K, V ``[total_k, kv_heads, head_dim]`` (any
strides, last dim contiguous); int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[batch + 1]`` say
where each sequence's rows start (FlashAttention's ``flash_attn_varlen_func`` convention),
``max_seqlen_q`` / ``max_seqlen_k`` bound the lengths. Causal masking is per sequence, aligned
bottom-right where a sequence's query and key lengths differ; a sequence may be empty (an
empty-key sequence's rows output 0, log-sum-exp -inf). The log-sum-exp, where asked, is float32
``[heads, total_q]``.

Kernels are the forward families compiled with ``VARLEN`` (a space's ``kinds = ["fwd",
"varlen"]``, ``[kind_problem.varlen]``): per batch index the kernel reads its sequence's rows
and lengths from cu_seqlens, skips query blocks past its length and masks keys past it. The
criterion is ``validate.check_varlen_workload``; the anchors are SDPA's cuDNN and flash
backends on the batch padded to its longest sequence, and FlashAttention-4's
``flash_attn_varlen_func`` where it imports.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from evoengine.argtypes import positive_int
from evoengine.problems.base import Problem, TimedCall
from evoengine.workload import DTYPES

if TYPE_CHECKING:
    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict

# random:N:LO:HI:SEED: N sequences, each random.Random(SEED).randint(LO, HI) long (queries and
# keys alike), drawn in order.
_RANDOM = re.compile(r"random:(\d+):(\d+):(\d+):(\d+)")
# A key after its kind's prefix (``varlen-``, ``varlen_bwd-``).
_KEY = re.compile(r"(?P<lengths>r\d+x\d+x\d+s\d+|n\d+-t\d+-[0-9a-f]{10})-h(\d+)-kv(\d+)"
                  r"-d(\d+)-(causal|full)-(\w+)")
MAX_SEQUENCES = 65535  # CUDA's grid limit on the batch dimension (mma's gridDim.z)

SeqLens = tuple[tuple[int, int], ...]


def parse_seqlens(text: str) -> tuple[SeqLens, str]:
    """``(lengths, source)`` from ``--seqlens``: ``L1,L2,...`` (each ``L`` or ``Lq:Lk``), or
    ``random:N:LO:HI:SEED`` (the source kept, as the workload's key names it)."""
    text = text.strip()
    m = _RANDOM.fullmatch(text)
    if m:
        n, lo, hi, seed = (int(x) for x in m.groups())
        if not 0 < n <= MAX_SEQUENCES or lo > hi:
            raise ValueError(f"--seqlens random:N:LO:HI:SEED needs 0 < N <= {MAX_SEQUENCES} "
                             f"and LO <= HI, got {text!r}")
        rng = random.Random(seed)
        lengths = [rng.randint(lo, hi) for _ in range(n)]
        return tuple((x, x) for x in lengths), text
    out = []
    for item in text.split(","):
        q, _, k = item.partition(":")
        try:
            lq, lk = int(q), int(k or q)
        except ValueError:
            raise ValueError(f"--seqlens must be L1,L2,... (each L or Lq:Lk, integers >= 0) or "
                             f"random:N:LO:HI:SEED, got {text!r}") from None
        out.append((lq, lk))
    return tuple(out), ""


def causal_pairs(len_q: int, len_k: int) -> int:
    """(query, key) pairs a bottom-right causal mask keeps: query i sees keys
    [0, i + len_k - len_q], at most len_k, at least none."""
    off = len_k - len_q
    # Rows i with 0 <= i + off + 1 <= len_k see i + off + 1 keys; rows past that see all.
    first = max(0, -off)  # the first row that sees a key (when off < 0)
    full_from = max(first, min(len_q, len_k - off))  # rows from here see all len_k keys
    partial = sum_range(first + off + 1, full_from + off)  # counts first+off+1 .. full_from+off
    return partial + (len_q - full_from) * len_k


def sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when hi < lo)."""
    return 0 if hi < lo else (lo + hi) * (hi - lo + 1) // 2


@dataclass(frozen=True)
class VarlenWorkload:
    """A ragged batch: ``seqlens`` ((len_q, len_k) per sequence), heads, head dim, dtype."""

    kind: ClassVar[str] = "varlen"

    seqlens: SeqLens
    heads: int
    head_dim: int
    kv_heads: int | None = None
    causal: bool = False
    dtype: str = "fp16"
    source: str = ""  # the random:N:LO:HI:SEED spec the lengths came from, if any

    def __post_init__(self) -> None:
        lengths = tuple((int(q), int(k)) for q, k in self.seqlens)
        object.__setattr__(self, "seqlens", lengths)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if not 0 < len(lengths) <= MAX_SEQUENCES:
            raise ValueError(f"a varlen batch needs 1 to {MAX_SEQUENCES} sequences, got "
                             f"{len(lengths)}")
        if any(q < 0 or k < 0 for q, k in lengths) or self.total_q == 0:
            raise ValueError(f"sequence lengths must be >= 0 with some query rows, got "
                             f"{lengths[:8]}{'...' if len(lengths) > 8 else ''}")
        for name in ("heads", "head_dim", "kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:  # type: ignore[operator]
            raise ValueError(f"query heads ({self.heads}) must be a multiple of kv heads "
                             f"({self.kv_heads})")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.source and parse_seqlens(self.source)[0] != lengths:
            raise ValueError(f"source {self.source!r} does not give these lengths")

    # ---- shape ----------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.seqlens)

    @property
    def total_q(self) -> int:
        return sum(q for q, _ in self.seqlens)

    @property
    def total_k(self) -> int:
        return sum(k for _, k in self.seqlens)

    @property
    def max_seqlen_q(self) -> int:
        return max(q for q, _ in self.seqlens)

    @property
    def max_seqlen_k(self) -> int:
        return max(k for _, k in self.seqlens)

    # The longest lengths, under the forward's names: what generic code (result rows, the
    # CUDA-graph rule) reads as the shape of the call.
    seq_q = max_seqlen_q
    seq_k = max_seqlen_k

    def cu_seqlens(self) -> tuple[list[int], list[int]]:
        """cu_seqlens_q and cu_seqlens_k as lists (batch + 1 entries, from 0)."""
        from evoengine.validate import cumulative

        return cumulative(self.seqlens)

    # ---- the Workload contract -------------------------------------------------------------

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (1: MHA)."""
        return self.heads // self.kv_heads

    def problem(self) -> dict[str, object]:
        """The dimensions compiled into a kernel: the forward's, and VARLEN."""
        return {"HEAD_DIM": self.head_dim, "DTYPE": self.dtype, "CAUSAL": self.causal,
                "VARLEN": True}

    def lengths_tag(self) -> str:
        """The lengths in a key: the random spec (``r16x128x4096s0``) or the count, total
        query rows and a hash of every (len_q, len_k)."""
        m = _RANDOM.fullmatch(self.source)
        if m:
            return "r{}x{}x{}s{}".format(*m.groups())
        digest = hashlib.sha256(repr(self.seqlens).encode()).hexdigest()[:10]
        return f"n{self.batch}-t{self.total_q}-{digest}"

    def key(self) -> str:
        return (f"{self.kind}-{self.lengths_tag()}-h{self.heads}-kv{self.kv_heads}-d{self.head_dim}"
                f"-{'causal' if self.causal else 'full'}-{self.dtype}")

    def pairs(self) -> int:
        """(query, key) pairs computed over the batch: the ones the mask keeps."""
        if not self.causal:
            return sum(q * k for q, k in self.seqlens)
        return sum(causal_pairs(q, k) for q, k in self.seqlens)

    def flops(self) -> float:
        """Useful matrix FLOPs (two GEMMs over exactly the unmasked pairs of every sequence)."""
        return 4.0 * self.heads * self.pairs() * self.head_dim

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "seqlens": [list(x) for x in self.seqlens],
                "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "causal": self.causal, "dtype": self.dtype, "source": self.source}

    @classmethod
    def of(cls, workload: VarlenWorkload) -> VarlenWorkload:
        """``workload``'s call, as a workload of this class's kind."""
        return cls.from_dict(workload.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VarlenWorkload:
        try:
            return cls(seqlens=tuple(tuple(x) for x in data["seqlens"]),  # type: ignore[misc]
                       heads=data["heads"], head_dim=data["head_dim"],
                       kv_heads=data.get("kv_heads"), causal=data.get("causal", False),
                       dtype=data.get("dtype", "fp16"), source=data.get("source", ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a varlen workload: {e}") from None

    @classmethod
    def from_key(cls, key: str) -> VarlenWorkload:
        """The workload a key names; only keys of a random spec name their lengths (a hashed
        key's workload is in its run's row: ``from_dict``)."""
        prefix = cls.kind + "-"
        m = _KEY.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
        if m is None:
            raise ValueError(f"not a {cls.kind} workload key: {key!r} (expected "
                             f"{prefix}r16x128x4096s0-h32-kv8-d128-causal-fp16)")
        tag = m.group("lengths")
        if not tag.startswith("r"):
            raise ValueError(f"{cls.kind} key {key!r} names its lengths by hash: read the workload "
                             "from its run (to_dict) instead")
        n, lo, hi, seed = re.findall(r"\d+", tag)
        source = f"random:{n}:{lo}:{hi}:{seed}"
        h, kv, d = (int(m.group(i)) for i in (2, 3, 4))
        return cls(parse_seqlens(source)[0], heads=h, kv_heads=kv, head_dim=d,
                   causal=m.group(5) == "causal", dtype=m.group(6), source=source)


class Varlen(Problem):
    kind = "varlen"
    summary = "ragged prefill forward: packed q, k, v with cu_seqlens (flash_attn_varlen_func)"
    # SDPA's backends on the batch padded to its longest sequence; FA4's varlen entry point.
    anchors = ("cudnn_padded", "flash_padded", "fa4")

    def method(self) -> str:
        from evoengine import measure

        return (f"{measure.METHOD}; ours on packed [total, H, D] inputs with cu_seqlens, next "
                "to SDPA cuDNN and flash on the batch padded to its longest sequence ([B, H, "
                "max, D], causal by is_causal where every sequence's lengths agree, else an "
                "explicit bottom-right and padding mask) and FlashAttention-4's "
                "flash_attn_varlen_func where it imports, interleaved in one process")

    def workload_from_dict(self, data: Mapping[str, Any]) -> VarlenWorkload:
        return VarlenWorkload.from_dict(data)

    def tune_workloads(self, geometry: ModelGeometry) -> list[VarlenWorkload]:
        """A model's ragged prefills for ``evoengine tune``: per rung of the prefill ladder
        (longest length ``s``, ``b`` sequences of it per call), twice as many sequences of
        lengths drawn from ``[s/8, s]`` (``random:2b:s/8:s:0``: about the rung's tokens)."""
        out = []
        for call in geometry.prefill_calls():
            s = int(call["seq_q"])
            source = f"random:{max(2, 2 * int(call['batch']))}:{max(1, s // 8)}:{s}:0"
            out.append(VarlenWorkload(parse_seqlens(source)[0], heads=geometry.heads,
                                      kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                                      causal=geometry.causal, dtype=geometry.dtype,
                                      source=source))
        return out

    def workload_from_key(self, key: str) -> VarlenWorkload:
        return VarlenWorkload.from_key(key)

    def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
        # The forward's flags (--shape, --kv-heads, --causal, --dtype) are shared; a varlen
        # workload takes the heads and head dim from --heads/--head-dim or --shape's H and D.
        parser.add_argument("--seqlens", metavar="L,L,...|random:N:LO:HI:SEED",
                            help="varlen: sequence lengths (each L or Lq:Lk), or N random "
                                 "lengths in LO..HI drawn with random.Random(SEED)")
        parser.add_argument("--heads", type=positive_int, metavar="H",
                            help="varlen: query heads")
        parser.add_argument("--head-dim", type=positive_int, metavar="D",
                            help="varlen: head dim")

    def workload_from_arguments(self, args: argparse.Namespace) -> VarlenWorkload:
        if getattr(args, "seqlens", None) is None:
            raise ValueError("--kind varlen needs --seqlens L,L,... or random:N:LO:HI:SEED")
        heads, head_dim = getattr(args, "heads", None), getattr(args, "head_dim", None)
        shape = getattr(args, "shape", None)
        if shape is not None and (heads is None or head_dim is None):
            try:
                _, h, _, d = (int(x) for x in shape.split(","))
            except ValueError:
                raise ValueError(f"shape must be B,H,S,D (four integers), got {shape!r}") from None
            heads, head_dim = heads or h, head_dim or d
        if heads is None or head_dim is None:
            raise ValueError("--kind varlen needs --heads H and --head-dim D")
        lengths, source = parse_seqlens(args.seqlens)
        return VarlenWorkload(lengths, heads=heads, head_dim=head_dim,
                              kv_heads=getattr(args, "kv_heads", None),
                              causal=bool(getattr(args, "causal", False)),
                              dtype=getattr(args, "dtype", "fp16"), source=source)

    # ---- on the GPU ----------------------------------------------------------------------

    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        from evoengine.runtime import VarlenKernel

        return VarlenKernel(candidate, compiled)

    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        from evoengine import validate

        return validate.check_varlen_workload(kernel, workload, device=device)

    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        """Sets of (q, k, v, cu_seqlens_q, cu_seqlens_k, out), packed and contiguous, enough
        to rotate past L2."""
        import torch

        from evoengine import measure
        from evoengine.launch import KERNEL_DTYPES

        w = workload
        dtype = KERNEL_DTYPES[w.dtype]
        cq, ck = w.cu_seqlens()
        per_set = 2 * w.head_dim * (2 * w.heads * w.total_q + 2 * w.kv_heads * w.total_k)
        sets = []
        for _ in range(measure.copies_needed(per_set)):
            q = torch.randn(w.total_q, w.heads, w.head_dim, device=device, dtype=dtype)
            k = torch.randn(w.total_k, w.kv_heads, w.head_dim, device=device, dtype=dtype)
            v = torch.randn_like(k)
            cu_q = torch.tensor(cq, dtype=torch.int32, device=device)
            cu_k = torch.tensor(ck, dtype=torch.int32, device=device)
            sets.append((q, k, v, cu_q, cu_k, torch.empty_like(q)))
        return sets

    def timed_call(self, kernel: Any, workload: Any,
                   sets: Sequence[tuple[Any, ...]]) -> TimedCall:
        scale = 1.0 / math.sqrt(workload.head_dim)
        max_q, max_k = workload.max_seqlen_q, workload.max_seqlen_k

        def call(i: int) -> None:
            q, k, v, cu_q, cu_k, out = sets[i]
            kernel.launch(q, k, v, cu_q, cu_k, max_q, max_k, out, None, scale)
        return call

    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        from evoengine import measure

        if anchor == "fa4":
            return time_fa4_varlen(workload, sets, **timing)
        backend = anchor.removesuffix("_padded")
        padded = [padded_inputs(workload, s) for s in sets]
        call = padded_sdpa_call(workload, padded)
        try:
            with measure.sdpa_backend(backend):
                call(0)
                return measure.time_calls(call, len(padded), **timing)
        except RuntimeError:
            return None


# ---- anchors ------------------------------------------------------------------------------

def padded_inputs(workload: VarlenWorkload, packed: tuple[Any, ...]) -> tuple[Any, ...]:
    """The batch padded to its longest sequence: (q [B, H, max_q, D], k, v [B, KV, max_k, D],
    mask or None), zeros past each length. The mask (bool [B, 1, max_q, max_k]: padding keys
    out, bottom-right causal per sequence) is None where SDPA's own is exact on every real
    row: causal with each sequence's query and key lengths equal (is_causal's top-left
    diagonal is then each sequence's, and a real row never reaches a padding key), or full with
    no key padding. SDPA's fused kernels run fastest without a mask: the anchor is as fast as
    SDPA honestly gets on the padded batch."""
    import torch

    w = workload
    q, k, v = packed[:3]
    mq, mk = w.max_seqlen_q, w.max_seqlen_k
    cq, ck = w.cu_seqlens()
    mask = None
    if not padded_without_mask(w):
        lq = torch.tensor([x for x, _ in w.seqlens], device=q.device)[:, None, None]
        lk = torch.tensor([x for _, x in w.seqlens], device=q.device)[:, None, None]
        rows = torch.arange(mq, device=q.device)[None, :, None]
        cols = torch.arange(mk, device=q.device)[None, None, :]
        mask = cols < lk
        if w.causal:
            mask = mask & (cols <= rows + (lk - lq))
        mask = mask[:, None]
    return padded(q, cq, mq), padded(k, ck, mk), padded(v, ck, mk), mask


def padded(x: Any, cu: list[int], longest: int) -> Any:
    """Packed rows ``x`` [total, H, D] of the sequences ``cu`` delimits, as [B, H, longest,
    D] (a view of [B, longest, H, D]), zeros past each sequence's length."""
    out = x.new_zeros(len(cu) - 1, longest, *x.shape[1:])
    for i in range(len(cu) - 1):
        out[i, :cu[i + 1] - cu[i]] = x[cu[i]:cu[i + 1]]
    return out.transpose(1, 2)


def padded_without_mask(w: VarlenWorkload) -> bool:
    """Whether SDPA's is_causal (or no mask) is exact on every real row of the padded batch."""
    if w.causal:
        return all(lq == lk for lq, lk in w.seqlens)
    return all(lk == w.max_seqlen_k for _, lk in w.seqlens)


def padded_sdpa_call(workload: VarlenWorkload, padded: Sequence[tuple[Any, ...]]) -> TimedCall:
    """``fn(i)``: SDPA on padded set ``i`` (under ``measure.sdpa_backend`` to pin one)."""
    import torch.nn.functional as F

    gqa = workload.kv_heads != workload.heads

    def call(i: int) -> None:
        q, k, v, mask = padded[i]
        if mask is None:
            F.scaled_dot_product_attention(q, k, v, is_causal=workload.causal, enable_gqa=gqa)
        else:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return call


def fa4_varlen() -> Any:
    """FlashAttention-4's ``flash_attn_varlen_func``, or None (said once, as measure does)."""
    from evoengine import measure

    if measure.fa4_attention() is None:
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


def time_fa4_varlen(workload: VarlenWorkload, sets: Sequence[tuple[Any, ...]],
                    **kw: Any) -> Timing | None:
    """FA4's varlen forward on the packed sets, eager (its JIT launches are not known to
    capture); None where it does not import or refuses the workload."""
    from evoengine import measure

    fn = fa4_varlen()
    if fn is None:
        return None
    kw["graph"] = False
    max_q, max_k, causal = workload.max_seqlen_q, workload.max_seqlen_k, workload.causal

    def call(i: int) -> None:
        q, k, v, cu_q, cu_k = sets[i][:5]
        fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
           max_seqlen_k=max_k, causal=causal)
    try:
        call(0)  # the first call compiles
        return measure.time_calls(call, len(sets), **kw)
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        import sys

        print(f"evoengine: FlashAttention-4 cannot run {workload.key()}: {e}", file=sys.stderr)
        return None
