"""What an export carries and how a call finds its kernel: the packed cubins and their
hashes, each kernel built back from its spec (by the spec's problem kind), and the dispatch
table (entries grouped by (dtype, head_dim, causal), the nearest tuned lengths win).
"""

from __future__ import annotations

import base64
import hashlib
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from evoengine.launch.backward import CudaBackward
from evoengine.launch.core import IntegrityError
from evoengine.launch.decode import CudaDecode
from evoengine.launch.forward import CudaKernel
from evoengine.launch.varlen import CudaVarlenKernel
from evoengine.launch.varlen_backward import CudaVarlenBackward


def pack_cubin(cubin: bytes) -> str:
    """Cubin bytes as compressed base64 text, 76 characters a line, for a Python literal."""
    return base64.encodebytes(zlib.compress(cubin, 9)).decode()


def unpack_cubin(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# The kernel class of each problem kind a module can carry: each builds itself from a spec
# (``from_spec``). A new kind of kernel adds its class here.
KERNEL_CLASSES: dict[str, Any] = {cls.kind: cls for cls in (CudaKernel, CudaBackward,
                                                             CudaVarlenKernel,
                                                             CudaVarlenBackward, CudaDecode)}
KINDS = tuple(KERNEL_CLASSES)  # the problems a module carries kernels for


def kernel_from_spec(spec: Mapping[str, Any], arch: str | None) -> Any:
    """A kernel from an export's spec, of the class of its ``kind`` (specs exported before
    kinds existed are forward), after checking its source and cubin against their recorded
    sha256; an altered one raises ``IntegrityError``."""
    name = spec["name"]
    source, cubin = spec.get("source"), spec.get("cubin")
    if source is not None and sha256(source) != spec["source_sha256"]:
        raise IntegrityError(f"the CUDA source of kernel {name} does not match its recorded "
                             "sha256: this module was altered; export it again")
    if isinstance(cubin, str):
        try:
            cubin = unpack_cubin(cubin)
        except (ValueError, zlib.error):
            raise IntegrityError(f"the cubin of kernel {name} is corrupt: this module was "
                                 "altered; export it again") from None
    if cubin is not None and sha256(cubin) != spec["cubin_sha256"]:
        raise IntegrityError(f"the cubin of kernel {name} does not match its recorded sha256: "
                             "this module was altered; export it again")
    kind = spec.get("kind", "fwd")
    if kind not in KERNEL_CLASSES:
        raise ValueError(f"kernel {name} is of kind {kind!r}; this launcher knows "
                         f"{', '.join(KINDS)}")
    return KERNEL_CLASSES[kind].from_spec(spec, arch, cubin=cubin, source=source)


@dataclass(frozen=True)
class Entry:
    """One line of the dispatch table: the kernel tuned for one workload."""

    kernel: int  # index into the kernel list
    dtype: str
    head_dim: int
    causal: bool
    seq_q: int
    seq_k: int
    batch: int
    heads: int
    median_us: float | None = None
    workload: str = ""
    # Which problem the kernel solves (KINDS). A decode entry's seq_q, seq_k and heads are
    # the q_len, cache length and query heads it was tuned at (TunedDecode dispatches them).
    kind: str = "fwd"
    # False: no search ran for this (dtype, causal); the export compiled the kernel tuned at
    # ``derived_from`` (a workload key) for it, so that every call of its head dim has one.
    tuned: bool = True
    derived_from: str = ""

    @property
    def key(self) -> tuple[str, int, bool]:
        return (self.dtype, self.head_dim, self.causal)


def dispatch_table(entries: Iterable[Entry],
                   kind: str = "fwd") -> dict[tuple[str, int, bool], tuple[Entry, ...]]:
    """The entries of ``kind`` grouped by (dtype, head_dim, causal), each group sorted by
    tuned length."""
    table: dict[tuple[str, int, bool], list[Entry]] = {}
    for e in entries:
        if e.kind == kind:
            table.setdefault(e.key, []).append(e)
    return {key: tuple(sorted(group, key=lambda e: (e.seq_k, e.seq_q, e.batch * e.heads)))
            for key, group in sorted(table.items())}


def nearest(entries: Iterable[Entry], seq_q: int, seq_k: int, rows: int) -> Entry:
    """The entry tuned nearest the call: closest (seq_q, seq_k) in log scale (sum of the
    absolute log ratios); among entries at the same lengths, closest batch x heads. Ties go
    to the entry listed first (the shorter). Empty dims count as 1 (explain reads any
    shape)."""
    seq_q, seq_k, rows = max(1, seq_q), max(1, seq_k), max(1, rows)

    def distance(e: Entry) -> tuple[float, float]:
        return (abs(math.log(seq_q / e.seq_q)) + abs(math.log(seq_k / e.seq_k)),
                abs(math.log(rows / (e.batch * e.heads))))
    return min(entries, key=distance)


def describe(key: tuple[str, int, bool]) -> str:
    dtype, head_dim, causal = key
    return f"{dtype} head_dim {head_dim} {'causal' if causal else 'non-causal'}"

