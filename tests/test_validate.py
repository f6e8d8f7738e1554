"""Tests of evoengine.validate on CPU tensors: the reference, torch SDPA and the criterion."""

from __future__ import annotations

import math

import pytest
import torch

from evoengine import validate
from evoengine.validate import Verdict, causal_mask, judge, reference, sdpa
from evoengine.workload import Workload

NEG_INF = float("-inf")


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention one query row at a time in Python floats, bottom-right causal, GQA by h // g."""
    batch, heads, seq_q, dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.zeros(batch, heads, seq_q, dim, dtype=torch.float64)
    lse = torch.full((batch, heads, seq_q), NEG_INF, dtype=torch.float64)
    qs, ks, vs = q.double().tolist(), k.double().tolist(), v.double().tolist()
    for b in range(batch):
        for h in range(heads):
            kh = h // group
            for i in range(seq_q):
                keys = [j for j in range(seq_k) if not causal or j <= i + seq_k - seq_q]
                if not keys:
                    continue  # no key: output 0, log-sum-exp -inf
                s = [scale * math.fsum(a * c for a, c in zip(qs[b][h][i], ks[b][kh][j],
                                                              strict=True)) for j in keys]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                z = math.fsum(w)
                for d in range(dim):
                    out[b, h, i, d] = math.fsum(wj * vs[b][kh][j][d]
                                                for wj, j in zip(w, keys, strict=True)) / z
                lse[b, h, i] = m + math.log(z)
    return out, lse


def qkv(batch: int, heads: int, kv_heads: int, seq_q: int, seq_k: int, dim: int,
        dtype: torch.dtype = torch.float64, seed: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def make(h: int, s: int) -> torch.Tensor:
        return torch.randn(batch, h, s, dim, generator=gen, dtype=torch.float64).to(dtype)

    return make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)


# (batch, heads, kv_heads, seq_q, seq_k, dim, causal)
SHAPES = [
    (2, 2, 2, 6, 6, 8, False),
    (2, 2, 2, 6, 6, 8, True),
    (1, 2, 2, 7, 4, 8, True),   # seq_q > seq_k: the first 3 rows see no key
    (1, 2, 2, 3, 8, 8, True),   # seq_q < seq_k: every row sees at least 6 keys
    (1, 3, 3, 5, 9, 4, False),
    (2, 4, 2, 5, 5, 8, True),   # GQA
    (1, 4, 2, 6, 3, 8, True),   # GQA with rows that see no key
    (1, 4, 1, 4, 7, 8, False),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[:6]}-{'causal' if s[6] else 'full'}"
                                               for s in SHAPES])
def test_reference_matches_a_naive_loop(shape: tuple, dtype: torch.dtype) -> None:
    *dims, causal = shape
    q, k, v = qkv(*dims, dtype=dtype)
    out, lse = reference(q, k, v, causal=causal)
    want_out, want_lse = naive(q, k, v, causal=causal)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_reference_with_an_explicit_scale() -> None:
    q, k, v = qkv(1, 2, 1, 5, 6, 8)
    out, lse = reference(q, k, v, causal=True, scale=0.3)
    want_out, want_lse = naive(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    default_out, _ = reference(q, k, v, causal=True)
    assert not torch.allclose(out, default_out)


def test_rows_without_keys_are_zero_with_lse_minus_inf() -> None:
    q, k, v = qkv(1, 2, 2, 7, 4, 8)
    out, lse = reference(q, k, v, causal=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert bool(torch.isneginf(lse[:, :, :3]).all())
    assert bool(torch.isfinite(lse[:, :, 3:]).all())
    assert bool((out[:, :, 3:].abs().sum(-1) > 0).all())
    # Row 3 sees exactly key 0: its output is v's row 0 and its lse the single score.
    torch.testing.assert_close(out[0, 0, 3], v[0, 0, 0], rtol=0, atol=1e-12)
    score = (q[0, 0, 3] @ k[0, 0, 0]).item() / math.sqrt(8)
    assert lse[0, 0, 3].item() == pytest.approx(score, abs=1e-12)


def test_bottom_right_alignment_with_fewer_queries() -> None:
    q, k, v = qkv(1, 1, 1, 2, 5, 4)
    out, _ = reference(q, k, v, causal=True)
    full, _ = reference(q, k, v, causal=False)
    # The last query sees every key, as in decoding; the one before sees all but the last.
    torch.testing.assert_close(out[0, 0, 1], full[0, 0, 1], rtol=0, atol=1e-12)
    part, _ = reference(q[:, :, :1], k[:, :, :4], v[:, :, :4], causal=False)
    torch.testing.assert_close(out[0, 0, 0], part[0, 0, 0], rtol=0, atol=1e-12)


def test_gqa_head_h_reads_kv_head_h_over_group() -> None:
    q, k, v = qkv(1, 4, 2, 5, 5, 8)
    out, _ = reference(q, k, v, causal=False)
    for h in range(4):
        alone, _ = reference(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1],
                             causal=False)
        torch.testing.assert_close(out[:, h:h + 1], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("seq_q", "seq_k", "expected"),
    [
        (2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),
        (3, 2, [[0, 0], [1, 0], [1, 1]]),
        (3, 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    ],
)
def test_causal_mask_is_bottom_right(seq_q: int, seq_k: int, expected: list) -> None:
    assert torch.equal(causal_mask(seq_q, seq_k, "cpu"), torch.tensor(expected, dtype=torch.bool))


# ---- torch SDPA ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq_q", "seq_k", "causal"),
    [(2, 2, 9, 9, True), (2, 2, 9, 5, True), (2, 2, 4, 9, True), (2, 2, 6, 8, False),
     (4, 2, 7, 7, True), (4, 1, 8, 5, True)],
)
def test_sdpa_matches_reference_on_cpu(heads: int, kv_heads: int, seq_q: int, seq_k: int,
                                       causal: bool) -> None:
    q, k, v = qkv(2, heads, kv_heads, seq_q, seq_k, 16, dtype=torch.float32, seed=1)
    out = sdpa(q, k, v, causal=causal)
    ref, ref_lse = reference(q, k, v, causal=causal)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    no_key = torch.isneginf(ref_lse)
    assert bool((out[no_key] == 0).all())
    assert int(no_key.sum()) == (2 * heads * max(0, seq_q - seq_k) if causal else 0)


def test_sdpa_passes_the_scale() -> None:
    q, k, v = qkv(1, 2, 2, 6, 6, 8, dtype=torch.float32)
    out = sdpa(q, k, v, causal=False, scale=0.7)
    ref, _ = reference(q, k, v, causal=False, scale=0.7)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


# ---- the criterion ------------------------------------------------------------------------


def test_the_criterion_constants() -> None:
    assert validate.ERR_FACTOR == 2.0
    assert validate.ERR_FLOOR == 1e-5


def test_tolerance_is_twice_the_baseline_error_plus_floor() -> None:
    q, k, v = qkv(1, 2, 2, 6, 6, 8, dtype=torch.float32)
    ref, _ = reference(q, k, v, causal=True)
    baseline = ref.to(torch.float16)
    baseline_err = (baseline.double() - ref).abs().max().item()
    assert baseline_err > 0
    verdict = judge(ref.clone(), ref, baseline)
    assert verdict.ok
    assert verdict.tolerance == 2 * baseline_err + 1e-5
    assert verdict.max_err == 0.0


def test_tolerance_boundary_is_inclusive() -> None:
    ref = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    baseline = torch.zeros(1, 1, 2, 4, dtype=torch.float32)
    baseline[0, 0, 1, 2] = -0.25
    tol = 2 * 0.25 + 1e-5
    at = torch.full_like(ref, tol)
    verdict = judge(at, ref, baseline)
    assert verdict.ok and verdict.tolerance == tol and verdict.max_err == tol
    beyond = at.clone()
    beyond[0, 0, 0, 0] = math.nextafter(tol, math.inf)
    verdict = judge(beyond, ref, baseline)
    assert not verdict.ok
    assert verdict.reason.startswith("wrong answer")


def test_perturbed_output_within_tolerance_passes_and_beyond_fails() -> None:
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64)
    noise = torch.rand(ref.shape, generator=gen, dtype=torch.float64) * 2 - 1
    baseline = ref + 1e-3 * noise
    base_err = (baseline.double() - ref).abs().max().item()
    tol = 2 * base_err + 1e-5

    inside = ref + 0.99 * tol * noise.sign()
    verdict = judge(inside, ref, baseline)
    assert verdict.ok and bool(verdict)
    assert verdict.max_err == pytest.approx(0.99 * tol)

    outside = ref.clone()
    outside[1, 0, 3, 2] += 1.01 * tol
    verdict = judge(outside, ref, baseline)
    assert not verdict.ok and not bool(verdict)
    assert verdict.max_err == pytest.approx(1.01 * tol)
    assert "wrong answer" in verdict.reason


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_output_fails(bad: float) -> None:
    ref = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    out = torch.zeros(1, 2, 3, 4, dtype=torch.float16)
    out[0, 1, 2, 3] = bad
    # Even with a huge tolerance (a terrible baseline), a non-finite element fails.
    verdict = judge(out, ref, torch.full_like(ref, 1e30))
    assert not verdict.ok
    assert "non-finite" in verdict.reason
    assert verdict.reason.startswith("1 non-finite")
    assert verdict.max_err == math.inf


def test_wrong_shape_fails() -> None:
    ref = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    verdict = judge(torch.zeros(1, 2, 4, 3), ref, ref)
    assert not verdict.ok
    assert verdict.reason == "shape (1, 2, 4, 3) != (1, 2, 3, 4)"
    assert verdict.max_err == math.inf


# ---- the log-sum-exp ------------------------------------------------------------------------


def lse_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out/ref of shape [1, 1, 3, 4]; ref lse with a no-key first row."""
    ref = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    ref_lse = torch.tensor([[[NEG_INF, 1.5, -2.0]]], dtype=torch.float64)
    return ref, ref.clone(), ref_lse


def test_lse_matching_including_minus_inf_passes() -> None:
    ref, out, ref_lse = lse_case()
    lse = ref_lse.float()
    assert judge(out, ref, ref, lse, ref_lse).ok


def test_lse_within_its_tolerance_passes_and_beyond_fails() -> None:
    ref, out, ref_lse = lse_case()
    lse_tol = validate.LSE_ATOL + validate.LSE_RTOL * 1.5
    near = ref_lse.clone()
    near[0, 0, 1] += 0.9 * lse_tol
    assert judge(out, ref, ref, near, ref_lse).ok
    far = ref_lse.clone()
    far[0, 0, 1] += 1.1 * lse_tol
    verdict = judge(out, ref, ref, far, ref_lse)
    assert not verdict.ok
    assert "log-sum-exp off by" in verdict.reason


def test_lse_nan_fails() -> None:
    ref, out, ref_lse = lse_case()
    lse = ref_lse.clone()
    lse[0, 0, 2] = float("nan")
    verdict = judge(out, ref, ref, lse, ref_lse)
    assert not verdict.ok
    assert "NaN" in verdict.reason


@pytest.mark.parametrize("bad", [float("inf"), NEG_INF])
def test_lse_infinite_where_reference_is_finite_fails(bad: float) -> None:
    ref, out, ref_lse = lse_case()
    lse = ref_lse.clone()
    lse[0, 0, 1] = bad
    assert not judge(out, ref, ref, lse, ref_lse).ok


# Regression: the tolerance LSE_RTOL * |ref_lse| used to be inf on such rows, passing any lse.
@pytest.mark.parametrize("bad", [0.0, 5.0, float("inf")])
def test_lse_finite_where_reference_is_minus_inf_fails(bad: float) -> None:
    ref, out, ref_lse = lse_case()
    lse = ref_lse.clone()
    lse[0, 0, 0] = bad
    assert not judge(out, ref, ref, lse, ref_lse).ok


@pytest.mark.parametrize("with_lse", [True, False])
def test_rows_without_keys_must_be_exactly_zero(with_lse: bool) -> None:
    ref, out, ref_lse = lse_case()
    baseline = ref.clone()
    baseline[0, 0, 2, 0] = 1e-3  # a tolerance of 2e-3 + 1e-5
    lse = ref_lse.float() if with_lse else None
    assert judge(out, ref, baseline, lse, ref_lse).ok
    out[0, 0, 0, 0] = 1e-6  # row 0 sees no key (ref_lse -inf): within tol, but not zero
    verdict = judge(out, ref, baseline, lse, ref_lse)
    assert not verdict.ok
    assert "no key" in verdict.reason
    out[0, 0, 0, 0] = 0.0
    out[0, 0, 1, 0] = 1e-6  # the same error on a row that sees keys is fine
    assert judge(out, ref, baseline, lse, ref_lse).ok


def test_lse_is_ignored_when_not_asked() -> None:
    ref, out, ref_lse = lse_case()
    nan_lse = torch.full((1, 1, 3), float("nan"))
    assert judge(out, ref, ref, nan_lse, None).ok
    assert judge(out, ref, ref, None, ref_lse).ok


def test_verdict_truthiness() -> None:
    assert bool(Verdict(True, 0.0, 1.0)) is True
    assert bool(Verdict(False, 0.0, 1.0, "x")) is False


# ---- check ------------------------------------------------------------------------------------


def reference_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                     out: torch.Tensor, lse: torch.Tensor | None, causal: bool = True) -> None:
    o, l_ = reference(q, k, v, causal=causal, scale=scale)
    out.copy_(o)
    if lse is not None:
        lse.copy_(l_)


def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("device='cpu' must not touch CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


CHECK = dict(batch=1, heads=2, kv_heads=1, seq_q=5, seq_k=3, head_dim=8, causal=True,
             dtype=torch.float32, seed=1, device="cpu")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_check_runs_on_cpu(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    no_cuda(monkeypatch)
    verdict = validate.check(reference_kernel, layout=layout, **CHECK)  # type: ignore[arg-type]
    assert verdict.ok, verdict.reason


def test_check_fails_a_wrong_kernel_and_names_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)

    def off_by_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> None:
        reference_kernel(q, k, v, **kw)  # type: ignore[arg-type]
        kw["out"].add_(1.0)  # type: ignore[attr-defined]

    def unwritten_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                      out: torch.Tensor, lse: torch.Tensor | None) -> None:
        reference_kernel(q, k, v, scale=scale, out=out, lse=None)

    verdict = validate.check(off_by_one, **CHECK)  # type: ignore[arg-type]
    assert not verdict.ok
    assert "wrong answer" in verdict.reason and verdict.reason.endswith("(seed 1)")
    verdict = validate.check(unwritten_lse, **CHECK)  # type: ignore[arg-type]
    assert not verdict.ok and "NaN" in verdict.reason
    assert validate.check(unwritten_lse, with_lse=False, **CHECK).ok  # type: ignore[arg-type]


# ---- the validation plan ------------------------------------------------------------------

PLAN_WORKLOADS = [
    Workload(16, 16, 2048, 64), Workload(8, 16, 4096, 128, causal=True),
    Workload(1, 8, 512, 64), Workload(2, 32, 8192, 128),
    Workload(1, 32, 1, 128, kv_heads=8, seq_k=4096), Workload(4, 8, 4096, 64, seq_k=100),
    Workload(1, 1, 7, 64), Workload(3, 6, 1000, 64, kv_heads=2, seq_k=3000),
]


@pytest.mark.parametrize("w", PLAN_WORKLOADS, ids=lambda w: w.key())
def test_plan_has_a_tail_check_and_fits_the_reference(w: Workload) -> None:
    shapes = validate.plan(w)
    tail = shapes[0]
    # No multiple of any tile (>= 2) unless the workload's own length is 1.
    for n, own in ((tail.seq_q, w.seq_q), (tail.seq_k, w.seq_k)):
        assert n % 2 == 1 or own == 1 == n
    assert (tail.seq_q < tail.seq_k) == (w.seq_q < w.seq_k)
    assert (tail.seq_q == tail.seq_k) == (w.seq_q == w.seq_k)
    assert tail.layout == "bshd"
    for s in shapes:
        assert s.heads % s.kv_heads == 0
        assert s.batch * s.heads * s.seq_q * s.seq_k <= validate.MAX_REFERENCE_SCORES
    if (w.seq_q, w.seq_k) != (tail.seq_q, tail.seq_k):
        assert len(shapes) == 2 and shapes[1].seq_q * shapes[1].seq_k > 0
        assert shapes[1].heads // shapes[1].kv_heads in (1, w.heads // w.kv_heads)


# ---- the backward criterion -------------------------------------------------------------------


def naive_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                causal: bool, scale: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas one (batch, head) at a time in float64, without autograd: P from
    the naive loop's log-sum-exp, dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = scale dS K,
    dK = scale dS^T Q, dK and dV summed over each key/value head's query heads."""
    out, lse = naive(q, k, v, causal=causal, scale=scale)
    q, k, v, dout = q.double(), k.double(), v.double(), dout.double()
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kh = h // group
            s = q[b, h] @ k[b, kh].T * scale
            if causal:
                s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], "cpu"), NEG_INF)
            seen = torch.isfinite(lse[b, h])[:, None]
            p = torch.where(seen, torch.exp(s - torch.where(seen, lse[b, h][:, None], 0.0)), 0.0)
            dv[b, kh] += p.T @ dout[b, h]
            ds = p * (dout[b, h] @ v[b, kh].T - (dout[b, h] * out[b, h]).sum(-1, keepdim=True))
            dq[b, h] = ds @ k[b, kh] * scale
            dk[b, kh] += ds.T @ q[b, h] * scale
    return dq, dk, dv


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[:6]}-{'causal' if s[6] else 'full'}"
                                               for s in SHAPES])
def test_reference_grads_match_the_formulas(shape: tuple) -> None:
    *dims, causal = shape
    q, k, v = qkv(*dims)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = validate.reference_grads(q, k, v, dout, causal=causal, scale=0.3)
    want = naive_grads(q, k, v, dout, causal=causal, scale=0.3)
    for g, w, t in zip(got, want, (q, k, v), strict=True):
        assert g.dtype == torch.float64 and g.shape == t.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_sdpa_grads_are_finite_and_zero_on_rows_without_keys() -> None:
    q, k, v = qkv(1, 4, 2, 7, 3, 8, dtype=torch.float32)  # GQA; rows 0..3 see no key
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    dq, dk, dv = validate.sdpa_grads(q, k, v, dout, causal=True)
    refs = validate.reference_grads(q, k, v, dout, causal=True)
    for g, r in zip((dq, dk, dv), refs, strict=True):
        assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
        torch.testing.assert_close(g.double(), r, rtol=0, atol=1e-5)
    assert bool((dq[:, :, :4] == 0).all())


def python_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, dout: torch.Tensor, *, causal: bool,
                    scale: float | None, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A correct backward "kernel" in float32 that, like the real one, recomputes P from the
    given log-sum-exp and takes delta from the given output."""
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf, kf, vf, of, gf = (t.float() for t in (q, k, v, out, dout))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    keep = torch.isfinite(lse)[..., None]
    if causal:
        keep = keep & causal_mask(q.shape[2], k.shape[2], q.device)
    p = torch.where(keep, torch.exp(s - torch.where(keep, lse[..., None], 0.0)), 0.0)
    ds = p * (gf @ vf.transpose(-1, -2) - (gf * of).sum(-1, keepdim=True))
    b, hkv, sk, d = k.shape
    dq.copy_(ds @ kf * scale)
    dk.copy_((ds.transpose(-1, -2) @ qf * scale).view(b, hkv, group, sk, d).sum(2))
    dv.copy_((p.transpose(-1, -2) @ gf).view(b, hkv, group, sk, d).sum(2))
    return dq, dk, dv


BWD = dict(batch=2, heads=4, kv_heads=2, seq_q=7, seq_k=5, head_dim=8, causal=True,
           dtype=torch.float32, seed=3, device="cpu")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("seq_q", "seq_k", "causal"), [(7, 5, True), (4, 9, True), (6, 6, False)])
def test_check_backward_passes_a_correct_kernel(monkeypatch: pytest.MonkeyPatch, layout: str,
                                                seq_q: int, seq_k: int, causal: bool) -> None:
    no_cuda(monkeypatch)
    seen = {}

    def spy(q: torch.Tensor, *args: torch.Tensor, **kw: object) -> tuple:
        seen.update(q=q, dq=kw["dq"], out=args[2], lse=args[3])
        assert all(bool(torch.isnan(kw[n]).all()) for n in ("dq", "dk", "dv"))  # poisoned
        return python_backward(q, *args, **kw)  # type: ignore[arg-type]

    verdict = validate.check_backward(spy, **{**BWD, "seq_q": seq_q, "seq_k": seq_k,
                                              "causal": causal, "layout": layout})
    assert verdict.ok, verdict.reason
    assert verdict.tolerance >= validate.GRAD_FLOOR and verdict.max_err <= verdict.tolerance
    assert seen["q"].is_contiguous() == (layout == "bhsd")
    assert seen["dq"].stride() == seen["q"].stride() and seen["out"].dtype == torch.float32
    assert seen["lse"].is_contiguous() and seen["lse"].shape == (2, 4, seq_q)


def test_check_backward_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)
    for dtype in (torch.float16, torch.bfloat16):
        verdict = validate.check_backward(python_backward, **{**BWD, "dtype": dtype})
        assert verdict.ok, verdict.reason


def test_check_backward_passes_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)

    def default_scale(*args: torch.Tensor, scale: float | None, **kw: object) -> tuple:
        return python_backward(*args, scale=None, **kw)  # type: ignore[arg-type]

    assert validate.check_backward(python_backward, scale=0.7, **BWD).ok
    verdict = validate.check_backward(default_scale, scale=0.7, **BWD)
    assert not verdict.ok and "wrong" in verdict.reason


def wrong(change: str):  # type: ignore[no-untyped-def]
    """python_backward with one mistake."""
    def fn(*args: torch.Tensor, **kw: torch.Tensor) -> None:
        python_backward(*args, **kw)  # type: ignore[arg-type]
        dq, dk, dv = kw["dq"], kw["dk"], kw["dv"]
        if change == "dv unwritten":
            dv.fill_(float("nan"))
        elif change == "one NaN in dq":
            dq[0, 0, -1, 0] = float("nan")
        elif change == "dk inf":
            dk[1, 1, 0, 3] = float("inf")
        elif change == "dk of one head of the group":
            q, k, v, out, lse, dout = args
            one = dict(dq=torch.empty_like(q[:, ::2]), dk=torch.empty_like(dk),
                       dv=torch.empty_like(dv))
            python_backward(q[:, ::2], k, v, out[:, ::2], lse[:, ::2].contiguous(),
                            dout[:, ::2], causal=kw["causal"], scale=kw["scale"], **one)
            dk.copy_(one["dk"])
        elif change == "dv off by 1%":
            dv.mul_(1.01)
        elif change == "dq nonzero where no key":
            dq[:, :, 0] += 1e-7
    return fn


@pytest.mark.parametrize(("change", "reason"), [
    ("dv unwritten", "dv: 160 non-finite values"),
    ("one NaN in dq", "dq: 1 non-finite values"),
    ("dk inf", "dk: 1 non-finite values"),
    ("dk of one head of the group", "dk wrong"),
    ("dv off by 1%", "dv wrong"),
    ("dq nonzero where no key", "dq of rows that see no key is not exactly zero"),
])
def test_check_backward_fails_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch, change: str,
                                             reason: str) -> None:
    no_cuda(monkeypatch)
    verdict = validate.check_backward(wrong(change), **BWD)
    assert not verdict.ok
    assert verdict.reason.startswith(reason) and verdict.reason.endswith("(seed 3)")


def test_judge_grads_never_passes_nan() -> None:
    ref = torch.zeros(1, 1, 2, 8, dtype=torch.float64)
    nan = torch.full((1, 1, 2, 8), float("nan"))
    good = (torch.zeros(1, 1, 2, 8),) * 3
    assert validate.judge_grads(good, (ref,) * 3, good).ok
    assert not validate.judge_grads((nan, *good[1:]), (ref,) * 3, good).ok
    # A NaN baseline makes the tolerance NaN: everything fails, nothing passes by accident.
    assert not validate.judge_grads(good, (ref,) * 3, (nan,) * 3).ok


def test_judge_grads_tolerance_is_per_gradient() -> None:
    ref = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    base = (torch.full((1, 1, 1, 4), 0.01), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    near = torch.full((1, 1, 1, 4), 0.02)  # 2 x dq's baseline error: inside dq's tolerance
    assert validate.judge_grads((near, ref.float(), ref.float()), (ref,) * 3, base).ok
    verdict = validate.judge_grads((ref.float(), near, ref.float()), (ref,) * 3, base)
    assert not verdict.ok and verdict.reason.startswith("dk wrong")
    assert verdict.tolerance == pytest.approx(validate.GRAD_FLOOR)
