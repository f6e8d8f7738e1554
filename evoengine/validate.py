"""The one correctness criterion, used by the search, the tests and exported modules.

A kernel passes when, on fresh random inputs with its output poisoned first, every output
element is finite and its max abs error against a float64 reference is at most
``2 x (the error of torch SDPA in the same dtype on the same inputs) + 1e-5``, and its
log-sum-exp (where asked) is within LSE_ATOL + LSE_RTOL |lse|. Rows that see no key (causal
with more queries than keys) must be exactly zero, with log-sum-exp -inf, as FlashAttention
defines.
Causal masking is aligned bottom-right: query i sees keys 0 .. i + (seq_k - seq_q).

The backward criterion (``check_backward``) is the same for gradients: with the forward's
output and log-sum-exp given (from the float64 reference, so that the backward is judged
alone) and dQ, dK, dV poisoned, each gradient must be finite and within
``ERR_FACTOR x (the error of torch SDPA's own backward in the same dtype) + a floor`` of a
float64 reference (the floor: GRAD_FLOOR, or one ulp of the dtype at the reference's largest
magnitude); dQ of rows that see no key must be exactly zero.

The decode criterion (``check_decode``) is the forward's on a KV cache: ragged per-sequence
lengths (0, fewer than q_len, none a multiple of a tile or a page), pages dealt to the
sequences in a shuffled order, every position past a sequence's length (and every page it
does not reach) NaN and the block-table entries past it -1, output and log-sum-exp poisoned;
the float64 reference groups query heads by key/value head (``decode_reference``), the
baseline is SDPA per sequence in the same dtype (``launch.decode.sdpa_decode``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from evoengine.workload import Workload

ERR_FACTOR = 2.0
ERR_FLOOR = 1e-5
LSE_ATOL = 1e-3
LSE_RTOL = 1e-4
# The backward's floor: an absolute 1e-4, or one unit in the last place of the gradient's
# dtype at the reference's largest magnitude if that is more (fp16 keeps 10 mantissa bits,
# bf16 7): the error that rounding the output alone can make. It matters only where SDPA's
# own error happens to be tiny: seen on the H100 (2026-11-24), a 7x7 d128 fp16 problem where
# SDPA's dK was off by 6.6e-4 and ours by 1.55e-3, with dK near 3 (one fp16 ulp there is
# 1.95e-3). A missing or misplaced contribution is still far above it.
GRAD_FLOOR = 1e-4
MANTISSA_BITS = {"torch.float16": 10, "torch.bfloat16": 7, "torch.float32": 23}


def ulp_at(dtype: torch.dtype, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` at ``magnitude`` (0 for 0)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA_BITS[str(dtype)])
GRAD_NAMES = ("dq", "dk", "dv")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    max_err: float
    tolerance: float
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def seeded_generator(device: str, seed: int | None) -> tuple[torch.Generator, int]:
    """A generator on ``device`` seeded with ``seed``, or with a fresh one drawn here (named in
    a failure's reason, so that the inputs can be made again)."""
    import torch

    gen = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    gen.manual_seed(seed)
    return gen, seed


def cumulative(seqlens: tuple[tuple[int, int], ...]) -> tuple[list[int], list[int]]:
    """cu_seqlens_q and cu_seqlens_k of (len_q, len_k) pairs, from 0."""
    cq, ck = [0], [0]
    for lq, lk in seqlens:
        cq.append(cq[-1] + lq)
        ck.append(ck[-1] + lk)
    return cq, ck


def causal_mask(seq_q: int, seq_k: int, device: torch.device | str) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned)."""
    import torch

    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    return cols <= rows + (seq_k - seq_q)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and log-sum-exp in float64 on the inputs' device."""
    import torch

    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    seen = torch.isfinite(m)
    p = torch.exp(s - torch.where(seen, m, torch.zeros_like(m)))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.where(seen, torch.matmul(p, v64) / torch.where(seen, denom, 1.0), 0.0)
    lse = torch.where(seen, m + torch.log(denom), float("-inf")).squeeze(-1)
    return out, lse


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
         scale: float | None = None) -> torch.Tensor:
    """torch SDPA in the inputs' dtype, with the same bottom-right causal alignment (the SDPA
    fallback of exported modules is this same function)."""
    from evoengine.launch import sdpa_attention

    return sdpa_attention(q, k, v, causal=causal, scale=scale)


def judge(out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor,
          lse: torch.Tensor | None = None, ref_lse: torch.Tensor | None = None) -> Verdict:
    """Apply the criterion to an output already computed."""
    import torch

    if out.shape != ref.shape:
        return Verdict(False, math.inf, 0.0, f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    baseline_err = (baseline.double() - ref).abs().max().item()
    tol = ERR_FACTOR * baseline_err + ERR_FLOOR
    finite = torch.isfinite(out)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return Verdict(False, math.inf, tol, f"{bad} non-finite outputs (NaN/Inf or unwritten)")
    err = (out.double() - ref).abs().max().item()
    if not err <= tol:
        return Verdict(False, err, tol, f"wrong answer: max err {err:.3g} > tol {tol:.3g}")
    if ref_lse is not None:
        no_key = torch.isneginf(ref_lse)  # rows that see no key: exactly zero, lse -inf
        if bool((out[no_key] != 0).any()):
            return Verdict(False, err, tol, "rows that see no key are not exactly zero")
        if lse is not None:
            if bool(torch.isnan(lse).any()):
                return Verdict(False, err, tol, "log-sum-exp has NaN (unwritten or wrong)")
            if not bool(torch.isneginf(lse[no_key]).all()):
                return Verdict(False, err, tol, "log-sum-exp is not -inf on rows that see no key")
            seen = ~no_key
            gap = (lse[seen].double() - ref_lse[seen]).abs()
            lse_tol = LSE_ATOL + LSE_RTOL * ref_lse[seen].abs()
            if not bool((gap <= lse_tol).all()):
                worst = float(torch.nan_to_num(gap - lse_tol, nan=math.inf).max())
                return Verdict(False, err, tol,
                               f"log-sum-exp off by {worst:.3g} beyond its tolerance")
    return Verdict(True, err, tol)


AttentionFn = Callable[..., "torch.Tensor"]


def check(fn: AttentionFn, *, batch: int, heads: int, kv_heads: int, seq_q: int, seq_k: int,
          head_dim: int, causal: bool, dtype: torch.dtype, scale: float | None = None,
          with_lse: bool = True, layout: str = "bhsd", seed: int | None = None,
          device: str = "cuda") -> Verdict:
    """Run ``fn(q, k, v, scale=, out=, lse=)`` once on fresh random inputs and judge it.

    ``layout="bshd"`` passes q, k, v as transposed views of [B, S, H, D] storage, so the
    kernel sees non-contiguous strides. The output and log-sum-exp are poisoned with NaN.
    """
    import torch

    gen, seed = seeded_generator(device, seed)

    def make(h: int, s: int) -> torch.Tensor:
        shape = (batch, s, h, head_dim) if layout == "bshd" else (batch, h, s, head_dim)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.transpose(1, 2) if layout == "bshd" else x

    q, k, v = make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)
    out = torch.full((batch, heads, seq_q, head_dim), float("nan"), device=device, dtype=dtype)
    lse = None
    if with_lse:
        lse = torch.full((batch, heads, seq_q), float("nan"), device=device, dtype=torch.float32)
    fn(q, k, v, scale=scale, out=out, lse=lse)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, causal=causal, scale=scale)
    verdict = judge(out, ref, sdpa(q, k, v, causal=causal, scale=scale), lse, ref_lse)
    if not verdict.ok:
        return Verdict(False, verdict.max_err, verdict.tolerance, f"{verdict.reason} (seed {seed})")
    return verdict


# ---- the backward pass ----------------------------------------------------------------------

Grads = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                    causal: bool, scale: float | None = None) -> Grads:
    """dQ, dK, dV of ``reference`` attention for the output gradient ``dout``, in float64 on
    the inputs' device (autograd through the reference: dK and dV sum over each key/value
    head's query heads; rows that see no key have zero gradients)."""
    import torch

    with torch.enable_grad():
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out, _ = reference(q64, k64, v64, causal=causal, scale=scale)
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return dq, dk, dv


def sdpa_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
               causal: bool, scale: float | None = None) -> Grads:
    """dQ, dK, dV of torch SDPA's own backward in the inputs' dtype: the baseline error (the
    SDPA fallback of exported modules' backward is this same function). Causal rows that see
    no key get the zero gradient they have by definition, not SDPA's NaN."""
    from evoengine.launch import sdpa_attention_grads

    return sdpa_attention_grads(q, k, v, dout, causal=causal, scale=scale)


def judge_grads(grads: Grads, refs: Grads, baselines: Grads, *,
                no_key_rows: torch.Tensor | None = None) -> Verdict:
    """Apply the backward criterion to gradients already computed: each of dq, dk, dv finite
    and within ERR_FACTOR x its baseline's error + its floor (GRAD_FLOOR, or one ulp at the
    reference's magnitude); dq exactly zero on
    ``no_key_rows`` (bool [seq_q]). A pass carries the gradient nearest its tolerance."""
    import torch

    worst = Verdict(True, 0.0, math.inf)
    for name, g, ref, base in zip(GRAD_NAMES, grads, refs, baselines, strict=True):
        if g.shape != ref.shape:
            return Verdict(False, math.inf, 0.0,
                           f"{name}: shape {tuple(g.shape)} != {tuple(ref.shape)}")
        floor = max(GRAD_FLOOR, ulp_at(g.dtype, ref.abs().max().item()))
        tol = ERR_FACTOR * (base.double() - ref).abs().max().item() + floor
        finite = torch.isfinite(g)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            return Verdict(False, math.inf, tol,
                           f"{name}: {bad} non-finite values (NaN/Inf or unwritten)")
        err = (g.double() - ref).abs().max().item()
        if not err <= tol:
            return Verdict(False, err, tol, f"{name} wrong: max err {err:.3g} > tol {tol:.3g}")
        if err / tol >= worst.max_err / worst.tolerance:
            worst = Verdict(True, err, tol)
    if no_key_rows is not None and bool((grads[0][:, :, no_key_rows] != 0).any()):
        return Verdict(False, worst.max_err, worst.tolerance,
                       "dq of rows that see no key is not exactly zero")
    return worst


BackwardFn = Callable[..., tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]]


def check_backward(fn: BackwardFn, *, batch: int, heads: int, kv_heads: int, seq_q: int,
                   seq_k: int, head_dim: int, causal: bool, dtype: torch.dtype,
                   scale: float | None = None, layout: str = "bhsd", seed: int | None = None,
                   device: str = "cuda") -> Verdict:
    """Run ``fn(q, k, v, out, lse, dout, causal=, scale=, dq=, dk=, dv=)`` once on fresh random
    inputs and judge the gradients it writes into dq, dk, dv (poisoned with NaN first).

    ``out`` (dtype) and ``lse`` (float32, natural log, contiguous [B, H, Sq]) are the float64
    reference forward's, rounded. ``layout="bshd"`` passes q, k, v, out, dout and the gradient
    buffers as transposed views of [B, S, H, D] storage.
    """
    import torch

    gen, seed = seeded_generator(device, seed)

    def storage(h: int, s: int, fill: float | None = None) -> torch.Tensor:
        shape = (batch, s, h, head_dim) if layout == "bshd" else (batch, h, s, head_dim)
        if fill is None:
            x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        else:
            x = torch.full(shape, fill, device=device, dtype=dtype)
        return x.transpose(1, 2) if layout == "bshd" else x

    q, k, v = storage(heads, seq_q), storage(kv_heads, seq_k), storage(kv_heads, seq_k)
    dout = storage(heads, seq_q)
    ref_out, ref_lse = reference(q, k, v, causal=causal, scale=scale)
    out = storage(heads, seq_q, 0.0).copy_(ref_out)
    lse = ref_lse.float().contiguous()
    nan = float("nan")
    dq = storage(heads, seq_q, nan)
    dk, dv = storage(kv_heads, seq_k, nan), storage(kv_heads, seq_k, nan)
    fn(q, k, v, out, lse, dout, causal=causal, scale=scale, dq=dq, dk=dk, dv=dv)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    refs = reference_grads(q, k, v, dout, causal=causal, scale=scale)
    baselines = sdpa_grads(q, k, v, dout, causal=causal, scale=scale)
    no_key = torch.isneginf(ref_lse[0, 0]) if causal else None
    verdict = judge_grads((dq, dk, dv), refs, baselines, no_key_rows=no_key)
    if not verdict.ok:
        return Verdict(False, verdict.max_err, verdict.tolerance, f"{verdict.reason} (seed {seed})")
    return verdict


# Checks on the workload's own lengths shrink batch and heads until the float64 reference
# holds at most this many scores (512 MB for the score matrix).
MAX_REFERENCE_SCORES = 1 << 26
TAIL_LENGTH = 509  # prime: no multiple of any tile size


@dataclass(frozen=True)
class Shape:
    """One shape the criterion is applied on."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    layout: str = "bhsd"


def _odd(n: int) -> int:
    return n - 1 if n > 1 and n % 2 == 0 else n


def plan(workload: Workload) -> list[Shape]:
    """The shapes a candidate must pass for ``workload`` before it is timed.

    1. Tails: lengths cut to at most ``TAIL_LENGTH`` and made odd (so no multiple of any
       tile), keeping which of Sq, Sk is longer and their difference where it fits, two
       key/value heads with the workload's query-head group, as strided [B, S, H, D] views.
    2. The workload's own sequence lengths (tile multiples included, many key blocks),
       with batch and heads cut until the reference fits ``MAX_REFERENCE_SCORES``.
    """
    sq, sk = workload.seq_q, workload.seq_k
    group = workload.heads // workload.kv_heads  # type: ignore[operator]
    if sq == sk:
        tq = tk = _odd(min(sq, TAIL_LENGTH))
    elif sq < sk:
        tq = _odd(min(sq, TAIL_LENGTH))
        tk = _odd(min(sk, tq + sk - sq))
    else:
        tk = _odd(min(sk, TAIL_LENGTH))
        tq = _odd(min(sq, tk + sq - sk))
    kv = min(workload.kv_heads, 2)  # type: ignore[type-var]
    shapes = [Shape(min(workload.batch, 2), kv * group, kv, tq, tk, "bshd")]
    batch, kv = workload.batch, workload.kv_heads
    while batch * kv * group * sq * sk > MAX_REFERENCE_SCORES and batch > 1:  # type: ignore[operator]
        batch = (batch + 1) // 2
    while batch * kv * group * sq * sk > MAX_REFERENCE_SCORES and kv > 1:  # type: ignore[operator]
        kv = (kv + 1) // 2  # type: ignore[operator]
    if kv * group * sq * sk > MAX_REFERENCE_SCORES:  # type: ignore[operator]
        group = 1
    while sq * sk > MAX_REFERENCE_SCORES:  # keep the longer side, cut the other
        sq, sk = (sq // 2, sk) if sq >= sk else (sq, sk // 2)
    if (sq, sk) != (tq, tk):
        shapes.append(Shape(batch, kv * group, kv, sq, sk))  # type: ignore[operator]
    return shapes


def check_workload(fn: AttentionFn, workload: Workload, *, scale: float | None = None,
                   device: str = "cuda") -> Verdict:
    """Apply the criterion on every shape of ``plan(workload)``, each on fresh inputs; the
    first failure, or a pass carrying the largest error seen."""

    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    worst = Verdict(True, 0.0, 0.0)
    for shape in plan(workload):
        verdict = check(fn, batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
                        seq_q=shape.seq_q, seq_k=shape.seq_k, head_dim=workload.head_dim,
                        causal=workload.causal, dtype=dtype, scale=scale, layout=shape.layout,
                        device=device)
        if not verdict.ok:
            where = f"B{shape.batch} H{shape.heads}/{shape.kv_heads} {shape.seq_q}x{shape.seq_k}"
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason} at {where}")
        if verdict.max_err >= worst.max_err:
            worst = verdict
    return worst


def check_backward_workload(fn: BackwardFn, workload: Workload, *, scale: float | None = None,
                            device: str = "cuda") -> Verdict:
    """The backward criterion on every shape of ``plan(workload)``, each on fresh inputs: the
    first failure, or a pass carrying the gradient nearest its tolerance."""

    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    worst = Verdict(True, 0.0, math.inf)
    for shape in plan(workload):
        verdict = check_backward(fn, batch=shape.batch, heads=shape.heads,
                                 kv_heads=shape.kv_heads, seq_q=shape.seq_q, seq_k=shape.seq_k,
                                 head_dim=workload.head_dim, causal=workload.causal,
                                 dtype=dtype, scale=scale, layout=shape.layout, device=device)
        if not verdict.ok:
            where = f"B{shape.batch} H{shape.heads}/{shape.kv_heads} {shape.seq_q}x{shape.seq_k}"
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason} at {where}")
        if verdict.max_err / verdict.tolerance >= worst.max_err / worst.tolerance:
            worst = verdict
    return worst


# ---- ragged batches (varlen) ----------------------------------------------------------------

# Sequences every varlen kernel is checked on besides the workload's own lengths: empty
# queries, empty keys (rows output 0), one row, tails that are no multiple of any tile, more
# queries than keys and fewer (bottom-right causal cuts), and a whole number of tiles.
VARLEN_EDGE_LENGTHS = ((0, 0), (1, 1), (TAIL_LENGTH, TAIL_LENGTH), (0, 37), (37, 0), (130, 77),
                       (77, 300), (64, 64), (200, 333), (0, 0), (257, 255))

VarlenFn = Callable[..., "torch.Tensor"]


def _varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's float64 reference and log-sum-exp and SDPA's output in the dtype, as
    [1, H, Lq, D] (from [L, H, D] slices); an empty-key sequence is zeros, -inf."""
    import torch

    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if kb.shape[2] == 0:
        zeros = torch.zeros(qb.shape, dtype=torch.float64, device=q.device)
        lse = torch.full(qb.shape[:3], float("-inf"), dtype=torch.float64, device=q.device)
        return zeros, lse, zeros.to(q.dtype)
    ref, ref_lse = reference(qb, kb, vb, causal=causal, scale=scale)
    return ref, ref_lse, sdpa(qb, kb, vb, causal=causal, scale=scale)


def check_varlen(fn: VarlenFn, *, seqlens: tuple[tuple[int, int], ...], heads: int,
                 kv_heads: int, head_dim: int, causal: bool, dtype: torch.dtype,
                 scale: float | None = None, with_lse: bool = True, strided: bool = True,
                 seed: int | None = None, device: str = "cuda") -> Verdict:
    """Run ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=, out=,
    lse=)`` once on fresh packed inputs and judge every sequence on its own.

    ``strided`` takes q, k, v as head slices of one packed [total, H + 2 KV, D] qkv tensor (the
    layout of a fused projection), so their row stride is not their own width. The output
    ([total_q, H, D]) and log-sum-exp ([H, total_q]) are poisoned with NaN. Sequence b passes
    as ``judge`` says against its own float64 reference, its tolerance 2x SDPA's error on that
    sequence in the dtype + the floor; its rows that see no key must be exactly zero.
    """
    import torch

    gen, seed = seeded_generator(device, seed)
    cq, ck = cumulative(seqlens)

    def make(rows: int, width: int) -> torch.Tensor:
        return torch.randn((rows, width, head_dim), generator=gen, device=device,
                           dtype=torch.float32).to(dtype)

    if strided:  # queries and keys share one row count here: pad the shorter side
        rows = max(cq[-1], ck[-1])
        qkv = make(rows, heads + 2 * kv_heads)
        q = qkv[:cq[-1], :heads]
        k = qkv[:ck[-1], heads:heads + kv_heads]
        v = qkv[:ck[-1], heads + kv_heads:]
    else:
        q, k, v = make(cq[-1], heads), make(ck[-1], kv_heads), make(ck[-1], kv_heads)
    cu_q = torch.tensor(cq, dtype=torch.int32, device=device)
    cu_k = torch.tensor(ck, dtype=torch.int32, device=device)
    out = torch.full((cq[-1], heads, head_dim), float("nan"), device=device, dtype=dtype)
    lse = None
    if with_lse:
        lse = torch.full((heads, cq[-1]), float("nan"), device=device, dtype=torch.float32)
    max_q = max(lq for lq, _ in seqlens)
    max_k = max(lk for _, lk in seqlens)
    fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, out=out, lse=lse)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    worst = Verdict(True, 0.0, 0.0)
    for b, (lq, lk) in enumerate(seqlens):
        if lq == 0:
            continue
        rows_q, rows_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref, ref_lse, base = _varlen_reference(q[rows_q], k[rows_k], v[rows_k], causal=causal,
                                               scale=scale)
        got = out[rows_q].transpose(0, 1).unsqueeze(0)
        got_lse = None if lse is None else lse[:, rows_q].unsqueeze(0)
        verdict = judge(got, ref, base, got_lse, ref_lse)
        if not verdict.ok:
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason} in sequence {b} ({lq}x{lk}) (seed {seed})")
        if verdict.max_err / verdict.tolerance >= (worst.max_err / worst.tolerance
                                                   if worst.tolerance else 0.0):
            worst = verdict
    return worst


def varlen_plan(workload: Any) -> list[tuple[tuple[tuple[int, int], ...], int, int, bool]]:
    """(seqlens, heads, kv_heads, strided) per check of a varlen workload (a
    ``problems.varlen.VarlenWorkload``: typed loosely, since that module's problem imports
    this one):

    1. ``VARLEN_EDGE_LENGTHS`` (empty, one-row, tail and uneven sequences) with two key/value
       heads and the workload's query-head group, as strided slices of one qkv tensor;
    2. the workload's own lengths, packed contiguously, with key/value heads cut (then the
       group) until the reference of its longest sequence (they are computed one at a time)
       holds at most ``MAX_REFERENCE_SCORES`` scores.
    """
    group = workload.heads // workload.kv_heads  # type: ignore[operator]
    plans = [(VARLEN_EDGE_LENGTHS, 2 * group, 2, True)]
    kv = workload.kv_heads
    scores = max(lq * lk for lq, lk in workload.seqlens)
    while kv * group * scores > MAX_REFERENCE_SCORES and kv > 1:  # type: ignore[operator]
        kv = (kv + 1) // 2  # type: ignore[operator]
    if kv * group * scores > MAX_REFERENCE_SCORES:  # type: ignore[operator]
        group = 1
    plans.append((workload.seqlens, kv * group, kv, False))  # type: ignore[operator]
    return plans


def check_varlen_workload(fn: VarlenFn, workload: Any, *,
                          scale: float | None = None, device: str = "cuda") -> Verdict:
    """``check_varlen`` on every check of ``varlen_plan(workload)``, each on fresh inputs: the
    first failure, or a pass carrying the sequence nearest its tolerance."""
    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    worst = Verdict(True, 0.0, 0.0)
    for seqlens, heads, kv_heads, strided in varlen_plan(workload):
        verdict = check_varlen(fn, seqlens=seqlens, heads=heads, kv_heads=kv_heads,
                               head_dim=workload.head_dim, causal=workload.causal, dtype=dtype,
                               scale=scale, strided=strided, device=device)
        if not verdict.ok:
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason}, {len(seqlens)} sequences H{heads}/{kv_heads}")
        if verdict.max_err >= worst.max_err:
            worst = verdict
    return worst


def check_varlen_backward(fn: BackwardFn, *, seqlens: tuple[tuple[int, int], ...], heads: int,
                          kv_heads: int, head_dim: int, causal: bool, dtype: torch.dtype,
                          scale: float | None = None, strided: bool = True,
                          seed: int | None = None, device: str = "cuda") -> Verdict:
    """Run ``fn(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, causal=, scale=, dq=, dk=, dv=)`` once on fresh packed inputs and judge
    every sequence's gradients on their own, as ``check_backward`` judges a batch.

    ``out`` and ``lse`` (float32 [H, total_q]) are each sequence's float64 reference forward,
    rounded; dQ, dK, dV are poisoned with NaN. ``strided`` takes q, k, v as head slices of
    one packed qkv tensor and dq, dk, dv as slices of one dqkv tensor. A sequence without
    keys must get dQ exactly zero, one without queries dK and dV exactly zero.
    """
    import torch

    gen, seed = seeded_generator(device, seed)
    cq, ck = cumulative(seqlens)

    def packed(fill: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q-, k- and v-shaped packed tensors: random (``fill`` None) or filled."""
        def make(rows: int, width: int) -> torch.Tensor:
            if fill is None:
                return torch.randn((rows, width, head_dim), generator=gen,
                                   device=device).to(dtype)
            return torch.full((rows, width, head_dim), fill, device=device, dtype=dtype)

        if strided:  # one [rows, H + 2 KV, D] tensor; its row count the longer side's
            whole = make(max(cq[-1], ck[-1]), heads + 2 * kv_heads)
            return (whole[:cq[-1], :heads], whole[:ck[-1], heads:heads + kv_heads],
                    whole[:ck[-1], heads + kv_heads:])
        return make(cq[-1], heads), make(ck[-1], kv_heads), make(ck[-1], kv_heads)

    q, k, v = packed(None)
    dout = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    out = torch.zeros(q.shape, device=device, dtype=dtype)
    lse = torch.full((heads, cq[-1]), float("-inf"), device=device, dtype=torch.float32)
    spans = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(seqlens))]

    def seq(x: torch.Tensor, rows: slice) -> torch.Tensor:
        return x[rows].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]

    for (rows_q, rows_k), (lq, lk) in zip(spans, seqlens, strict=True):
        if lq and lk:
            ref, ref_lse = reference(seq(q, rows_q), seq(k, rows_k), seq(v, rows_k),
                                     causal=causal, scale=scale)
            out[rows_q] = ref[0].transpose(0, 1).to(dtype)
            lse[:, rows_q] = ref_lse[0].float()
    dq, dk, dv = packed(float("nan"))
    fn(q, k, v, out, lse, dout, torch.tensor(cq, dtype=torch.int32, device=device),
       torch.tensor(ck, dtype=torch.int32, device=device), max(lq for lq, _ in seqlens),
       max(lk for _, lk in seqlens), causal=causal, scale=scale, dq=dq, dk=dk, dv=dv)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    worst = Verdict(True, 0.0, math.inf)
    for b, ((rows_q, rows_k), (lq, lk)) in enumerate(zip(spans, seqlens, strict=True)):
        where = f"in sequence {b} ({lq}x{lk}) (seed {seed})"
        if not (lq and lk):  # no (query, key) pair: the gradients it has are exactly 0
            for name, g in (("dq", dq[rows_q]), ("dk", dk[rows_k]), ("dv", dv[rows_k])):
                if bool((g != 0).any()):  # NaN too
                    return Verdict(False, math.inf, 0.0,
                                   f"{name} of a sequence without {'keys' if lq else 'queries'}"
                                   f" is not exactly zero {where}")
            continue
        inputs = (seq(q, rows_q), seq(k, rows_k), seq(v, rows_k), seq(dout, rows_q))
        refs = reference_grads(*inputs, causal=causal, scale=scale)
        baselines = sdpa_grads(*inputs, causal=causal, scale=scale)
        no_key = torch.isneginf(lse[0, rows_q]) if causal else None
        verdict = judge_grads((seq(dq, rows_q), seq(dk, rows_k), seq(dv, rows_k)), refs,
                              baselines, no_key_rows=no_key)
        if not verdict.ok:
            return Verdict(False, verdict.max_err, verdict.tolerance, f"{verdict.reason} {where}")
        if verdict.max_err / verdict.tolerance >= worst.max_err / worst.tolerance:
            worst = verdict
    return worst


def check_varlen_backward_workload(fn: BackwardFn, workload: Any, *,
                                   scale: float | None = None,
                                   device: str = "cuda") -> Verdict:
    """``check_varlen_backward`` on every check of ``varlen_plan(workload)``, each on fresh
    inputs: the first failure, or a pass carrying the gradient nearest its tolerance."""
    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    worst = Verdict(True, 0.0, math.inf)
    for seqlens, heads, kv_heads, strided in varlen_plan(workload):
        verdict = check_varlen_backward(fn, seqlens=seqlens, heads=heads, kv_heads=kv_heads,
                                        head_dim=workload.head_dim, causal=workload.causal,
                                        dtype=dtype, scale=scale, strided=strided,
                                        device=device)
        if not verdict.ok:
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason}, {len(seqlens)} sequences H{heads}/{kv_heads}")
        if verdict.max_err / verdict.tolerance >= worst.max_err / worst.tolerance:
            worst = verdict
    return worst


# ---- decode over a KV cache -----------------------------------------------------------------

DecodeFn = Callable[..., "torch.Tensor"]
DECODE_RAGGED_LENGTH = 1531  # prime: the ragged shape's longest cache, no multiple of a tile


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, *,
                     causal: bool = True,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention and its log-sum-exp in float64, one sequence at a time, query heads
    grouped by key/value head (no repeated K/V): out [B, q_len, H, D], lse [B, q_len, H]
    (-inf and a zero output where a query sees no key). Causal bottom-right: query i sees
    the first ``cache_len - q_len + i + 1`` keys."""
    import torch

    from evoengine.launch.decode import gather_cache

    b_, q_len, heads, d = q.shape
    kv = k_cache.shape[2]
    group = heads // kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros((b_, q_len, heads, d), dtype=torch.float64, device=q.device)
    lse = torch.full((b_, q_len, heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        if length <= 0:
            continue
        k = gather_cache(k_cache, block_table, b, length).double().permute(1, 2, 0)  # [KV, D, L]
        v = gather_cache(v_cache, block_table, b, length).double().transpose(0, 1)  # [KV, L, D]
        rows = q[b].double().reshape(q_len, kv, group, d).permute(1, 0, 2, 3)
        s = torch.matmul(rows.reshape(kv, q_len * group, d), k) * scale
        if causal:
            token = torch.arange(q_len, device=q.device).repeat_interleave(group)
            seen_keys = torch.arange(length, device=q.device)[None, :]
            s.masked_fill_(seen_keys >= (length - q_len + token + 1)[:, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        seen = torch.isfinite(m)
        p = torch.exp(s - torch.where(seen, m, torch.zeros_like(m)))
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.where(seen, torch.matmul(p, v) / torch.where(seen, denom, 1.0), 0.0)
        row_lse = torch.where(seen, m + torch.log(denom), float("-inf")).squeeze(-1)
        out[b] = o.reshape(kv, q_len, group, d).permute(1, 0, 2, 3).reshape(q_len, heads, d)
        lse[b] = row_lse.reshape(kv, q_len, group).permute(1, 0, 2).reshape(q_len, heads)
    return out, lse


def decode_cache(batch: int, lengths: list[int], capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, *, paged: bool, page_size: int,
                 gen: torch.Generator | None = None, device: str = "cuda",
                 poison: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k_cache, v_cache, cache_seqlens, block_table) of random keys and values.

    Contiguous: [batch, capacity, kv_heads, D]. Paged: [num_pages, page_size, kv_heads, D]
    with ``capacity / page_size`` pages per sequence plus a few spare ones, dealt to the
    sequences in a random order (``block_table``). ``poison``: every position past a
    sequence's length (and every page it does not reach) is NaN, and the block-table
    entries past its length are -1, so a kernel that reads past ``cache_seqlens`` fails."""
    import torch

    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if not paged:
        k = torch.randn((batch, capacity, kv_heads, head_dim), generator=gen, device=device,
                        dtype=torch.float32).to(dtype)
        v = torch.randn(k.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        if poison:
            for b, length in enumerate(lengths):
                k[b, length:] = float("nan")
                v[b, length:] = float("nan")
        return k, v, lens, None
    if capacity % page_size:
        raise ValueError(f"capacity {capacity} must be a multiple of page_size {page_size}")
    per_seq = capacity // page_size
    num_pages = batch * per_seq + 3
    order = torch.randperm(num_pages, generator=gen, device=device)
    table = order[: batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    k = torch.randn((num_pages, page_size, kv_heads, head_dim), generator=gen, device=device,
                    dtype=torch.float32).to(dtype)
    v = torch.randn(k.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    if poison:
        keep = torch.zeros((num_pages, page_size), dtype=torch.bool, device=device)
        for b, length in enumerate(lengths):
            used = -(-length // page_size)
            flat = keep[table[b, :used].long()].reshape(-1)
            flat[:length] = True
            keep[table[b, :used].long()] = flat.reshape(used, page_size)
            table[b, used:] = -1
        k[~keep] = float("nan")
        v[~keep] = float("nan")
    return k, v, lens, table


def check_decode(fn: DecodeFn, *, lengths: list[int], capacity: int, q_len: int, heads: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, paged: bool,
                 page_size: int, causal: bool = True, scale: float | None = None,
                 seed: int | None = None, device: str = "cuda") -> Verdict:
    """Run ``fn(q, k_cache, v_cache, cache_seqlens, block_table, causal=, scale=, out=,
    lse=)`` once on fresh random inputs (``decode_cache``: pages shuffled, everything past a
    sequence's length NaN; out and lse poisoned with NaN) and judge it as ``judge`` does
    against ``decode_reference``, the baseline being SDPA per sequence in the same dtype
    (``sdpa_decode``); lse is [B, H, q_len], natural log."""
    import torch

    from evoengine.launch.decode import sdpa_decode

    gen, seed = seeded_generator(device, seed)
    batch = len(lengths)
    q = torch.randn((batch, q_len, heads, head_dim), generator=gen, device=device,
                    dtype=torch.float32).to(dtype)
    k, v, lens, table = decode_cache(batch, lengths, capacity, kv_heads, head_dim, dtype,
                                     paged=paged, page_size=page_size, gen=gen, device=device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, q_len), float("nan"), device=device, dtype=torch.float32)
    fn(q, k, v, lens, table, causal=causal, scale=scale, out=out, lse=lse)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    ref, ref_lse = decode_reference(q, k, v, lens, table, causal=causal, scale=scale)
    baseline = sdpa_decode(q, k, v, lens, table, causal=causal, scale=scale)
    verdict = judge(out, ref, baseline, lse.transpose(1, 2), ref_lse)
    if not verdict.ok:
        return Verdict(False, verdict.max_err, verdict.tolerance, f"{verdict.reason} (seed {seed})")
    return verdict


@dataclass(frozen=True)
class DecodeCase:
    """One shape the decode criterion is applied on."""

    lengths: tuple[int, ...]
    capacity: int
    heads: int
    kv_heads: int


def decode_plan(workload: Any) -> list[DecodeCase]:
    """The shapes a decode candidate must pass for ``workload`` (a
    ``problems.decode.DecodeWorkload``: that module imports this one) before it is timed.

    1. Ragged: four sequences of lengths 0, fewer than q_len (queries that see no key), an
       odd middle length and the longest, at most ``DECODE_RAGGED_LENGTH`` (prime: no
       multiple of a tile or a page), two key/value heads with the workload's group.
    2. The workload's own cache length, full and less a prime, with batch and then kv heads
       cut until the float64 scores fit ``MAX_REFERENCE_SCORES``.
    """
    w = workload
    group = w.q_heads // w.kv_heads
    longest = min(w.cache_len, DECODE_RAGGED_LENGTH)
    few = max(1, w.q_len - 1) if w.q_len > 1 else 1
    lengths = (0, min(few, longest), max(1, longest // 2) | 1, longest)
    cases = [DecodeCase(lengths, _capacity(longest, w), 2 * group, 2)]
    batch, kv = w.batch, w.kv_heads
    while batch * kv * group * w.q_len * w.cache_len > MAX_REFERENCE_SCORES and batch > 1:
        batch = (batch + 1) // 2
    while batch * kv * group * w.q_len * w.cache_len > MAX_REFERENCE_SCORES and kv > 1:
        kv = (kv + 1) // 2
    own = tuple(w.cache_len if i % 2 == 0 else max(1, w.cache_len - 37) for i in range(batch))
    if own != lengths:
        cases.append(DecodeCase(own, _capacity(w.cache_len, w), kv * group, kv))
    return cases


def _capacity(length: int, workload: Any) -> int:
    """Capacity for sequences up to ``length`` keys: whole pages when paged."""
    if workload.layout != "paged":
        return length
    return -(-length // workload.page_size) * workload.page_size


def check_decode_workload(fn: DecodeFn, workload: Any, *,
                          scale: float | None = None, device: str = "cuda") -> Verdict:
    """The decode criterion on every case of ``decode_plan(workload)``, each on fresh inputs:
    the first failure, or a pass carrying the largest error seen."""
    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    worst = Verdict(True, 0.0, 0.0)
    for case in decode_plan(workload):
        verdict = check_decode(fn, lengths=list(case.lengths), capacity=case.capacity,
                               q_len=workload.q_len, heads=case.heads, kv_heads=case.kv_heads,
                               head_dim=workload.head_dim, dtype=dtype,
                               paged=workload.layout == "paged",
                               page_size=workload.page_size, scale=scale, device=device)
        if not verdict.ok:
            where = (f"lengths {list(case.lengths)[:4]}{'...' if len(case.lengths) > 4 else ''}"
                     f" H{case.heads}/{case.kv_heads} q_len {workload.q_len}")
            return Verdict(False, verdict.max_err, verdict.tolerance,
                           f"{verdict.reason} at {where}")
        if verdict.max_err >= worst.max_err:
            worst = verdict
    return worst
