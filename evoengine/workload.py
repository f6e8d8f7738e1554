"""The attention problem a kernel is searched for."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

DTYPES = ("fp16", "bf16")
# The problem kind (evoengine.problems) of whatever predates kinds: the forward's.
DEFAULT_KIND = "fwd"
_KEY = re.compile(r"b(\d+)-h(\d+)-kv(\d+)-sq(\d+)-sk(\d+)-d(\d+)-(causal|full)-(\w+)")


@dataclass(frozen=True)
class Workload:
    """Q is [batch, heads, seq_q, head_dim]; K and V are [batch, kv_heads, seq_k, head_dim].

    The forward's workload (``evoengine.problems.forward``); its keys predate problem kinds
    and carry no kind prefix."""

    kind: ClassVar[str] = DEFAULT_KIND

    batch: int
    heads: int
    seq_q: int
    head_dim: int
    kv_heads: int | None = None
    seq_k: int | None = None
    causal: bool = False
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.seq_k is None:
            object.__setattr__(self, "seq_k", self.seq_q)
        for name in ("batch", "heads", "seq_q", "head_dim", "kv_heads", "seq_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"query heads ({self.heads}) must be a multiple of kv heads ({self.kv_heads})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def parse(cls, shape: str, **kw: object) -> Workload:
        """Build from ``"B,H,S,D"`` as typed on the command line."""
        try:
            b, h, s, d = (int(x) for x in shape.split(","))
        except ValueError:
            raise ValueError(f"shape must be B,H,S,D (four integers), got {shape!r}") from None
        return cls(batch=b, heads=h, seq_q=s, head_dim=d, **kw)  # type: ignore[arg-type]

    @classmethod
    def parse_spec(cls, spec: str, **kw: object) -> Workload:
        """Build from ``"B,H,S,D"`` with optional ``kvN`` (key/value heads) and ``causal``
        after it, as the benchmarks list them: ``"8,16,2048,64,kv1,causal"``."""
        parts = spec.split(",")
        extra: dict[str, object] = {}
        for part in parts[4:]:
            if part == "causal":
                extra["causal"] = True
            elif re.fullmatch(r"kv\d+", part):
                extra["kv_heads"] = int(part[2:])
            else:
                raise ValueError(f"workload {spec!r}: {part!r} is neither 'causal' nor kvN "
                                 "(key/value heads)")
        return cls.parse(",".join(parts[:4]), **extra, **kw)

    @classmethod
    def from_key(cls, key: str) -> Workload:
        """The workload that ``key()`` names."""
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a workload key: {key!r} (expected b1-h8-kv8-sq512-sk512-d64-"
                             "full-fp16)")
        b, h, kv, sq, sk, d = (int(x) for x in m.groups()[:6])
        return cls(batch=b, heads=h, kv_heads=kv, seq_q=sq, seq_k=sk, head_dim=d,
                   causal=m.group(7) == "causal", dtype=m.group(8))

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Workload:
        """The workload ``to_dict()`` wrote; other keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (1: MHA)."""
        return self.heads // self.kv_heads

    def problem(self) -> dict[str, object]:
        """The dimensions compiled into a kernel: results across them are incomparable."""
        return {"HEAD_DIM": self.head_dim, "DTYPE": self.dtype, "CAUSAL": self.causal}

    def key(self) -> str:
        """A readable identity of the workload, for elites and reports."""
        return (
            f"b{self.batch}-h{self.heads}-kv{self.kv_heads}-sq{self.seq_q}-sk{self.seq_k}"
            f"-d{self.head_dim}-{'causal' if self.causal else 'full'}-{self.dtype}"
        )

    def flops(self) -> float:
        """Matrix FLOPs of the forward pass (two GEMMs), halved by causal masking."""
        pairs = self.seq_q * self.seq_k
        if self.causal:
            # Bottom-right aligned: query i sees keys 0..i+(seq_k-seq_q).
            off = self.seq_k - self.seq_q
            pairs = sum(max(0, min(self.seq_k, i + off + 1)) for i in range(self.seq_q))
        return 4.0 * self.batch * self.heads * pairs * self.head_dim

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, **asdict(self)}
