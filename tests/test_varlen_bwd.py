"""The backward of ragged batches without a GPU: workloads and keys, the spaces that serve
them, the rendered and offline-compiled VARLEN backward kernels, the per-row buffers' layout,
the criterion (``validate.check_varlen_backward``) on correct and wrong Python "kernels", and
the autograd function that gives a varlen forward a backward kernel's gradients."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from evoengine import cli, problems, validate
from evoengine.arch import get_arch
from evoengine.compile import compile_many
from evoengine.launch.varlen_backward import padded_rows, with_kernel_gradients
from evoengine.problems.varlen import VarlenWorkload, parse_seqlens
from evoengine.problems.varlen_bwd import VarlenBackwardWorkload
from evoengine.render import make_candidate, render
from evoengine.space import SearchSpace, default_spaces
from tests.test_validate import no_cuda, python_backward

ISSUE = "random:16:128:4096:0"
POINTS = {64: dict(BLOCK_M=64, BLOCK_N=128, NUM_WARPS=8, STAGES=2, SWIZZLE="xor",
                   DQ_ACCUM="atomic", KV_IN_REGS=False, GROUP_SPLIT=1),
          128: dict(BLOCK_M=32, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor",
                    DQ_ACCUM="separate", KV_IN_REGS=False, GROUP_SPLIT=1)}


def issue_workload(**kw: object) -> VarlenBackwardWorkload:
    lengths, source = parse_seqlens(ISSUE)
    return VarlenBackwardWorkload(lengths, **{"heads": 32, "kv_heads": 8,  # type: ignore[arg-type]
                                              "head_dim": 128, "causal": True, "source": source,
                                              **kw})


def space() -> SearchSpace:
    return next(s for s in default_spaces("varlen_bwd") if s.family == "mma_bwd")


# ---- workloads ------------------------------------------------------------------------------


def test_keys_name_the_kind_and_round_trip() -> None:
    w = issue_workload()
    assert w.key() == "varlen_bwd-r16x128x4096s0-h32-kv8-d128-causal-fp16"
    assert problems.workload_from_key(w.key()) == w
    assert problems.workload_from_dict(w.to_dict()) == w
    assert w.to_dict()["kind"] == "varlen_bwd"
    forward = VarlenWorkload.of(w)
    assert forward.key() == "varlen-r16x128x4096s0-h32-kv8-d128-causal-fp16"
    assert w.flops() == pytest.approx(2.5 * forward.flops())
    assert w.problem() == forward.problem() and w.problem()["VARLEN"] is True
    with pytest.raises(ValueError, match="not a varlen_bwd workload key"):
        problems.problem("varlen_bwd").workload_from_key(forward.key())


def test_the_cli_names_a_varlen_backward_workload() -> None:
    args = cli.build_parser().parse_args(
        ["search", "--kind", "varlen_bwd", "--seqlens", ISSUE, "--heads", "32", "--kv-heads",
         "8", "--head-dim", "128", "--causal"])
    assert problems.problem("varlen_bwd").workload_from_arguments(args) == issue_workload()


# ---- spaces and kernels ---------------------------------------------------------------------


def test_the_mma_backward_space_serves_ragged_batches_and_keeps_its_identities() -> None:
    assert [s.family for s in default_spaces("varlen_bwd")] == ["mma_bwd", "wgmma_bwd"]
    sp, arch = space(), get_arch("sm_89")
    assert sp.kind == "bwd" and sp.serves("varlen_bwd") and not sp.serves("varlen")
    assert all(p["VARLEN"] is True for p in sp.problems("varlen_bwd"))
    problem = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True)
    dense = make_candidate(sp, POINTS[64], problem, arch)
    ragged = make_candidate(sp, POINTS[64], {**problem, "VARLEN": True}, arch)
    assert "varlen" not in dense.identity
    assert ragged.identity == dense.identity.replace("causal1-", "causal1-varlen1-")
    assert "constexpr bool VARLEN = false;" in render(dense) and "int total_q" not in render(dense)
    source = render(ragged)
    # pre, main, post and kv_post take the ragged arguments
    assert "constexpr bool VARLEN = true;" in source and source.count("int total_q") == 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_varlen_backward_kernels_compile_offline_without_spills(arch: str) -> None:
    sp, target = space(), get_arch(arch)
    cands = [make_candidate(sp, POINTS[p["HEAD_DIM"]], p, target)  # type: ignore[index]
             for p in sp.problems("varlen_bwd")]
    assert len(cands) == 8
    for cand, result in zip(cands, compile_many(cands, target), strict=True):
        assert result.ok, (cand.identity, result.error)
        assert result.spill_bytes == 0, (cand.identity, result.spill_bytes)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_mma_group_split_points_compile_offline_without_spills(arch: str) -> None:
    """mma_bwd's GROUP_SPLIT points of the GPU tests (dense and ragged), at each head dim the
    space admits them, compile with no spill."""
    from tests.gpu.test_backward import POINTS as BWD_POINTS
    from tests.gpu.test_varlen_bwd import POINTS as RAGGED_POINTS

    sp, target = space().with_untested(), get_arch(arch)
    cands = []
    for points, varlen in ((BWD_POINTS["mma_bwd"], False), (RAGGED_POINTS, True)):
        for point in (sp.complete(p) for p in points):
            for head_dim in (64, 128):
                problem = dict(HEAD_DIM=head_dim, DTYPE="fp16", CAUSAL=varlen,
                               **({"VARLEN": True} if varlen else {}))
                if point["GROUP_SPLIT"] > 1 and not sp.violations(point, problem, target):
                    cands.append(make_candidate(sp, point, problem, target))
    assert len(cands) >= 4
    for cand, result in zip(cands, compile_many(cands, target), strict=True):
        assert result.ok, (cand.identity, result.error)
        assert "constexpr int GROUP_SPLIT = 1;" not in render(cand)
        assert result.spill_bytes == 0, (cand.identity, result.spill_bytes)


# wgmma_bwd's GPU-tested points (tests/gpu/test_backward.py) that meet each loader, dQ path,
# dQ writer and layout, the transposed dQ and the step order, each at a head dim it admits.
WGMMA_POINTS = ((0, 64), (4, 128), (9, 128), (11, 64), (14, 128), (22, 128), (26, 128),
                (28, 128), (29, 64), (31, 128), (33, 64), (35, 128), (36, 128), (37, 128),
                (38, 64), (39, 128), (40, 64), (41, 128), (42, 64), (43, 128),
                (44, 64), (45, 64), (46, 128), (47, 128), (48, 64), (49, 128), (50, 64),
                (51, 64), (52, 128), (53, 64))


def test_wgmma_varlen_backward_kernels_compile_offline() -> None:
    from tests.gpu.test_backward import POINTS as BWD_POINTS

    sp = next(s for s in default_spaces("varlen_bwd") if s.family == "wgmma_bwd")
    sp, target = sp.with_untested(), get_arch("sm_90a")  # GROUP_SPLIT's points too
    cands = []
    for index, head_dim in WGMMA_POINTS:
        problem = dict(HEAD_DIM=head_dim, DTYPE="bf16", CAUSAL=bool(index % 2), VARLEN=True)
        point = sp.complete(BWD_POINTS["wgmma_bwd"][index])
        assert not sp.violations(point, problem, target), index
        cands.append(make_candidate(sp, point, problem, target))
    for cand, result in zip(cands, compile_many(cands, target), strict=True):
        assert result.ok, (cand.identity, result.error)
        assert "int total_q" in render(cand)
        # the dQ warp's points included: its branch reads nothing held across the producer's
        # loop (before, 15 of 80 sampled dQ-warp points spilled 8-24 bytes there)
        assert result.spill_bytes == 0, (cand.identity, result.spill_bytes)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_each_sequences_padded_rows_are_aligned_and_apart(block_m: int) -> None:
    """The template's Seq::pad0 for random ragged batches: each sequence's rows padded to
    whole query blocks start on a multiple of 4 (16-byte copies), end before the next
    sequence's start, and fit the stride the launcher allocates (``padded_rows``)."""
    rng = random.Random(block_m)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 3, block_m, block_m + 1, rng.randint(0, 700)])
                   for _ in range(rng.randint(1, 12))]
        starts = [0, *itertools.accumulate(lengths)]
        stride = padded_rows(starts[-1], len(lengths), block_m)
        assert stride % 4 == 0
        end = 0
        for b, (q0, n) in enumerate(zip(starts, lengths, strict=False)):
            pad0 = (q0 & ~3) + b * (block_m + 4)
            assert pad0 % 4 == 0 and pad0 >= end
            end = pad0 + -(-n // block_m) * block_m
        assert end <= stride


# ---- the criterion --------------------------------------------------------------------------

SEQLENS = ((5, 5), (0, 4), (3, 0), (7, 3), (2, 9), (0, 0), (11, 11))
CHECK = dict(seqlens=SEQLENS, heads=4, kv_heads=2, head_dim=16, causal=True,
             dtype=torch.float32, seed=5, device="cpu")


def python_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                           cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                           causal: bool, scale: float | None, dq: torch.Tensor,
                           dk: torch.Tensor, dv: torch.Tensor) -> tuple:
    """A correct ragged backward "kernel": the dense Python one per sequence, zeros where a
    sequence has no query or no key."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])

        def seq(x: torch.Tensor, rows: slice) -> torch.Tensor:
            return x[rows].transpose(0, 1).unsqueeze(0)
        if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
            dq[rq], dk[rk], dv[rk] = 0, 0, 0
            continue
        grads = [torch.empty_like(seq(x, r)) for x, r in ((q, rq), (k, rk), (v, rk))]
        python_backward(seq(q, rq), seq(k, rk), seq(v, rk), seq(out, rq),
                        lse[:, rq].unsqueeze(0).contiguous(), seq(dout, rq), causal=causal,
                        scale=scale, dq=grads[0], dk=grads[1], dv=grads[2])
        for dst, g, r in zip((dq, dk, dv), grads, (rq, rk, rk), strict=True):
            dst[r] = g[0].transpose(0, 1)
    return dq, dk, dv


@pytest.mark.parametrize("strided", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_check_varlen_backward_passes_a_correct_kernel(monkeypatch: pytest.MonkeyPatch,
                                                       strided: bool, causal: bool) -> None:
    no_cuda(monkeypatch)
    seen = {}

    def spy(*args: torch.Tensor, **kw: torch.Tensor) -> tuple:
        seen.update(q=args[0], lse=args[4], dq=kw["dq"])
        assert all(bool(torch.isnan(kw[n]).all()) for n in ("dq", "dk", "dv"))  # poisoned
        return python_varlen_backward(*args, **kw)  # type: ignore[arg-type]

    verdict = validate.check_varlen_backward(spy, **{**CHECK, "causal": causal,
                                                     "strided": strided})
    assert verdict.ok, verdict.reason
    assert verdict.max_err <= verdict.tolerance
    assert seen["q"].is_contiguous() != strided and seen["dq"].is_contiguous() != strided
    assert seen["lse"].shape == (4, 28) and bool(torch.isneginf(seen["lse"][:, 5:8]).all())


def test_check_varlen_backward_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)
    for dtype in (torch.float16, torch.bfloat16):
        verdict = validate.check_varlen_backward(python_varlen_backward,
                                                 **{**CHECK, "dtype": dtype})
        assert verdict.ok, verdict.reason


def wrong(change: str):  # type: ignore[no-untyped-def]
    """python_varlen_backward with one mistake."""
    def fn(*args: torch.Tensor, **kw: torch.Tensor) -> None:
        python_varlen_backward(*args, **kw)  # type: ignore[arg-type]
        dq, dk, dv = kw["dq"], kw["dk"], kw["dv"]
        if change == "dk of a sequence without queries unwritten":
            dk[5:9] = float("nan")  # sequence 1: (0, 4)
        elif change == "dq of a sequence without keys nonzero":
            dq[5:8] += 1e-7  # sequence 2: (3, 0)
        elif change == "the last sequence's dv unwritten":
            dv[-11:] = float("nan")
        elif change == "dq off by 1% in one sequence":
            dq[8:15] *= 1.01  # sequence 3: (7, 3)
        elif change == "dv of two sequences swapped":
            first, second = dv[0:5].clone(), dv[-5:].clone()
            dv[0:5], dv[-5:] = second, first
    return fn


@pytest.mark.parametrize(("change", "reason"), [
    ("dk of a sequence without queries unwritten",
     "dk of a sequence without queries is not exactly zero in sequence 1 (0x4)"),
    ("dq of a sequence without keys nonzero",
     "dq of a sequence without keys is not exactly zero in sequence 2 (3x0)"),
    ("the last sequence's dv unwritten", "dv: 352 non-finite values"),
    ("dq off by 1% in one sequence", "dq wrong"),
    ("dv of two sequences swapped", "dv wrong"),
])
def test_check_varlen_backward_fails_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch,
                                                    change: str, reason: str) -> None:
    no_cuda(monkeypatch)
    verdict = validate.check_varlen_backward(wrong(change), **CHECK)
    assert not verdict.ok
    assert verdict.reason.startswith(reason) and verdict.reason.endswith("(seed 5)")


# ---- autograd -------------------------------------------------------------------------------


class PythonVarlenBackward:
    """Stands for a CudaVarlenBackward: ``launch`` with its arguments, in Python."""

    def __init__(self) -> None:
        self.calls = 0

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, dout: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
               *, scale: float, deterministic: bool) -> None:
        self.calls += 1
        python_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k,
                               causal=True, scale=scale, dq=dq, dk=dk, dv=dv)


def test_a_varlen_forward_gets_the_backward_kernels_gradients() -> None:
    """``with_kernel_gradients``: the forward writes the log-sum-exp the backward reads; the
    gradients are the backward's, equal to autograd through SDPA per sequence."""
    from evoengine.launch.varlen import varlen_sdpa

    torch.manual_seed(0)
    cu_q = torch.tensor([0, *itertools.accumulate(lq for lq, _ in SEQLENS)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk for _, lk in SEQLENS)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), 2, 16, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(q.shape, dtype=torch.float64)

    def run(lse: torch.Tensor) -> torch.Tensor:
        assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
        with torch.no_grad():
            out = varlen_sdpa(q, k, v, cu_q, cu_k, causal=True, scale=0.3)
            cq, ck = cu_q.tolist(), cu_k.tolist()
            lse.fill_(-math.inf)  # rows that see no key, as the kernels write them
            for b in range(len(cq) - 1):
                rows_q = slice(cq[b], cq[b + 1])
                if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
                    _, ref_lse = validate.reference(
                        q[rows_q].transpose(0, 1)[None], k[ck[b]:ck[b + 1]].transpose(0, 1)[None],
                        v[ck[b]:ck[b + 1]].transpose(0, 1)[None], causal=True, scale=0.3)
                    lse[:, rows_q] = ref_lse[0].float()
        return out

    backward = PythonVarlenBackward()
    out = with_kernel_gradients(run, backward, q, k, v, cu_q, cu_k, 11, 11, causal=True,
                                scale=0.3)
    assert out.grad_fn is not None and backward.calls == 0
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert backward.calls == 1
    expect = torch.autograd.grad(varlen_sdpa(q, k, v, cu_q, cu_k, causal=True, scale=0.3),
                                 (q, k, v), dout)
    for got, want in zip(grads, expect, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the lse is float32
