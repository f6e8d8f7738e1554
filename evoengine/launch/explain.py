"""Which dispatch entry serves a call, and why: ``TunedAttention.explain``.

A module exported by ``evoengine tune`` holds, per (dtype, head dim, causal), entries that a
search tuned and entries derived at export (``Entry.tuned`` false: a tuned kernel's
parameters compiled for a dtype or mask nothing was tuned for). ``explain`` says which one a
call gets, from the tensors' shapes and dtype alone (CPU and meta tensors too), running
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from evoengine.launch.core import DTYPE_NAMES, check_flag
from evoengine.launch.dispatch import KINDS, Entry

# The kinds attention's calls dispatch on; decode calls are attention_decode's (TunedDecode).
EXPLAINED_KINDS = tuple(k for k in KINDS if k != "decode")


@dataclass(frozen=True)
class Explanation:
    """Which entry serves a call; ``str()`` is one line. ``source`` is the tuned entry a
    derived one (``tuned=False``) was compiled from; ``why_none`` why there is no entry."""

    kind: str
    call: str
    entry: Entry | None
    kernel: str | None
    source: Entry | None = None
    why_none: str = ""

    @property
    def tuned(self) -> bool | None:
        return None if self.entry is None else self.entry.tuned

    @property
    def measured_us(self) -> float | None:
        """The search's time of the serving kernel at the workload it was tuned for (for a
        derived entry, its source's, on the source's dtype and mask)."""
        if self.entry is None:
            return None
        if self.entry.tuned:
            return self.entry.median_us
        return self.source.median_us if self.source is not None else None

    def __str__(self) -> str:
        if self.entry is None:
            return f"{self.call}: no kernel ({self.why_none})"
        us = self.measured_us
        at = f" ({us:.1f} us measured there)" if us is not None else ""
        if self.entry.tuned:
            return f"{self.call}: tuned at {self.entry.workload}{at}, kernel {self.kernel}"
        mask = "causal" if self.entry.causal else "non-causal"
        return (f"{self.call}: derived (not tuned for {self.entry.dtype} {mask}) from the "
                f"kernel tuned at {self.entry.derived_from}{at}, kernel {self.kernel}")


def explain_call(tuned: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                 kind: str = "fwd") -> Explanation:
    """``TunedAttention.explain``: the entry of ``kind`` that ``tuned`` picks for the call."""
    if kind not in EXPLAINED_KINDS:
        raise ValueError(f"kind must be one of {', '.join(EXPLAINED_KINDS)}, got {kind!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # any device: CPU and meta tensors too
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got "
                             f"{tuple(t.shape)}")
    b, h, sq, d = q.shape
    sk = k.shape[2]
    causal = check_flag("causal", causal)
    dtype = DTYPE_NAMES.get(q.dtype)
    call = (f"{kind} {dtype or q.dtype} head_dim {d} {'causal' if causal else 'non-causal'} "
            f"b{b} h{h} sq{sq} sk{sk}")
    entry = None if dtype is None else tuned.select(dtype, d, causal, sq, sk, b * h, kind)
    if entry is None:
        why = tuned.no_kernel(q, d, causal, kind).split(" Pass fallback")[0].rstrip(".")
        return Explanation(kind, call, None, None, why_none=why)
    source = None
    if not entry.tuned:
        source = next((e for e in tuned.entries if e.tuned and e.kind == kind
                       and e.workload == entry.derived_from), None)
    return Explanation(kind, call, entry, tuned.kernels[entry.kernel].name, source)
