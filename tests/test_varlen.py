"""Ragged batches without a GPU: workloads, keys, flags, FLOPs, the spaces that serve them,
the rendered and offline-compiled VARLEN kernels, the launcher's input checks, the plan."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from evoengine import cli, paths, problems, validate
from evoengine.arch import get_arch
from evoengine.compile import compile_many
from evoengine.launch.varlen import check_cu_values, check_varlen_inputs
from evoengine.problems.varlen import (
    VarlenWorkload,
    causal_pairs,
    padded_without_mask,
    parse_seqlens,
)
from evoengine.render import make_candidate, render
from evoengine.search.domain import Domain
from evoengine.space import SearchSpace, default_spaces

ISSUE = "random:16:128:4096:0"
MMA_POINT = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                 LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split")
WGMMA_POINT = dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs",
                   INTRA_WG_OVERLAP=True, PINGPONG=True, PERSISTENT=True, TILE_ORDER="head",
                   SCHEDULER="dynamic", PACK_GQA=False, P_BARRIER="warpgroup",
                   O_STAGE="own_or_q", O_STORE="threads")


def issue_workload(**kw: object) -> VarlenWorkload:
    lengths, source = parse_seqlens(ISSUE)
    return VarlenWorkload(lengths, **{"heads": 32, "kv_heads": 8, "head_dim": 128,  # type: ignore[arg-type]
                                      "causal": True, "source": source, **kw})


# ---- lengths, keys, FLOPs ---------------------------------------------------------------


def test_seqlens_flags_parse_lists_pairs_and_a_seeded_generator() -> None:
    assert parse_seqlens("128,4096,7") == (((128, 128), (4096, 4096), (7, 7)), "")
    assert parse_seqlens("5:9,0:3,0") == (((5, 9), (0, 3), (0, 0)), "")
    rng = random.Random(0)
    expected = tuple((x, x) for x in (rng.randint(128, 4096) for _ in range(16)))
    assert parse_seqlens(ISSUE) == (expected, ISSUE)
    for bad in ("", "1,,2", "a", "random:0:1:2:0", "random:2:9:3:0", "1:2:3"):
        with pytest.raises(ValueError, match="--seqlens"):
            parse_seqlens(bad)


def test_keys_are_short_stable_and_name_what_they_can() -> None:
    w = issue_workload()
    assert w.key() == "varlen-r16x128x4096s0-h32-kv8-d128-causal-fp16"
    assert problems.workload_from_key(w.key()) == w
    assert problems.workload_from_dict(w.to_dict()) == w
    listed = VarlenWorkload(((5, 7), (0, 3), (300, 200)), heads=4, head_dim=64)
    assert listed.key() == "varlen-n3-t305-11b0bf0ecd-h4-kv4-d64-full-fp16"
    assert problems.workload_from_dict(listed.to_dict()) == listed
    with pytest.raises(ValueError, match="by hash"):
        problems.workload_from_key(listed.key())
    with pytest.raises(ValueError, match="not a varlen workload key"):
        problems.problem("varlen").workload_from_key("b1-h8-kv8-sq512-sk512-d64-full-fp16")


def test_workloads_refuse_what_no_kernel_takes() -> None:
    for kw, match in ((dict(seqlens=()), "1 to 65535"), (dict(seqlens=((0, 4),)), "query rows"),
                      (dict(seqlens=((4, -1),)), ">= 0"), (dict(heads=6, kv_heads=4), "multiple"),
                      (dict(dtype="fp32"), "dtype"), (dict(source="random:2:1:9:0"), "source")):
        args = {"seqlens": ((4, 4),), "heads": 4, "head_dim": 64, **kw}
        with pytest.raises(ValueError, match=match):
            VarlenWorkload(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("lq", range(0, 12))
def test_causal_pairs_count_exactly_the_unmasked_ones(lq: int) -> None:
    for lk in range(0, 12):
        brute = sum(1 for i in range(lq) for j in range(lk) if j <= i + lk - lq)
        assert causal_pairs(lq, lk) == brute, (lq, lk)


def test_flops_are_the_useful_ones_summed_over_sequences() -> None:
    w = VarlenWorkload(((3, 5), (0, 4), (6, 2)), heads=2, kv_heads=1, head_dim=16)
    assert w.flops() == 4.0 * 2 * 16 * (15 + 0 + 12)
    causal = VarlenWorkload(w.seqlens, heads=2, kv_heads=1, head_dim=16, causal=True)
    assert causal.flops() == 4.0 * 2 * 16 * (causal_pairs(3, 5) + causal_pairs(6, 2))
    issue = issue_workload()
    assert issue.flops() == 4.0 * 32 * 128 * sum(x * (x + 1) // 2 for x, _ in issue.seqlens)
    assert (issue.batch, issue.total_q, issue.max_seqlen_q) == (16, 42052, 4092)


def test_the_cli_names_a_varlen_workload() -> None:
    args = cli.build_parser().parse_args(
        ["search", "--kind", "varlen", "--seqlens", ISSUE, "--heads", "32", "--kv-heads", "8",
         "--head-dim", "128", "--causal"])
    assert problems.problem("varlen").workload_from_arguments(args) == issue_workload()
    args = cli.build_parser().parse_args(["search", "--kind", "varlen", "--shape", "1,4,1,64",
                                          "--seqlens", "3:5,7", "--dtype", "bf16"])
    w = problems.problem("varlen").workload_from_arguments(args)
    assert (w.seqlens, w.heads, w.head_dim, w.dtype) == (((3, 5), (7, 7)), 4, 64, "bf16")
    args = cli.build_parser().parse_args(["search", "--kind", "varlen", "--heads", "4"])
    with pytest.raises(ValueError, match="--seqlens"):
        problems.problem("varlen").workload_from_arguments(args)


# ---- spaces, rendering, offline compilation ------------------------------------------------


def space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def test_the_forward_spaces_serve_varlen_and_keep_forward_identities() -> None:
    assert [s.family for s in default_spaces("varlen")] == ["mma", "wgmma"]
    sp = space("wgmma")
    assert sp.kind == "fwd" and sp.serves("varlen") and not sp.serves("bwd")
    assert all(p["VARLEN"] is True for p in sp.problems("varlen"))
    assert all("VARLEN" not in p for p in sp.problems())
    forward = make_candidate(sp, WGMMA_POINT, dict(HEAD_DIM=128, DTYPE="fp16", CAUSAL=True),
                             get_arch("sm_90a"))
    ragged = make_candidate(sp, WGMMA_POINT, issue_workload().problem(), get_arch("sm_90a"))
    assert "varlen" not in forward.identity
    assert ragged.identity == forward.identity.replace("causal1-", "causal1-varlen1-")
    assert "constexpr bool VARLEN = false;" in render(forward)
    assert "cu_seqlens_q" not in render(forward).split("attn_fwd(")[-1]
    source = render(ragged)
    assert "constexpr bool VARLEN = true;" in source and "int total_q" in source


def test_a_varlen_workload_searches_only_the_families_that_serve_it() -> None:
    domain = Domain(default_spaces("varlen"), issue_workload(), get_arch("sm_90a"))
    assert domain.families == ["mma", "wgmma"]
    assert all("varlen1" in identity for identity, _ in domain.items()[:50])
    assert Domain(default_spaces("varlen"), issue_workload(), get_arch("sm_80")).families == \
        ["mma"]
    with pytest.raises(ValueError, match="no search space"):  # wmma serves the forward only
        Domain([space("wmma")], issue_workload(), get_arch("sm_80"))


@pytest.mark.parametrize("arch,family,point", [
    ("sm_80", "mma", MMA_POINT), ("sm_89", "mma", MMA_POINT),
    ("sm_90a", "mma", MMA_POINT), ("sm_90a", "wgmma", WGMMA_POINT),
    ("sm_90a", "wgmma", {**WGMMA_POINT, "BLOCK_M": 192, "BLOCK_N": 112 + 16, "STAGES": 3,
                         "PERSISTENT": False, "SCHEDULER": "static", "SWIZZLE": 64}),
])
def test_varlen_kernels_compile_offline_without_spills(arch: str, family: str,
                                                       point: dict[str, object]) -> None:
    sp, target = space(family), get_arch(arch)
    cands = [make_candidate(sp, point, p, target) for p in sp.problems("varlen")
             if not sp.violations(point, p, target)]
    assert cands
    for cand, result in zip(cands, compile_many(cands, target), strict=True):
        assert result.ok, (cand.identity, result.error)
        assert result.spill_bytes == 0, (cand.identity, result.spill_bytes)


# ---- the launcher's checks, the plan, the anchors --------------------------------------


def test_cu_seqlens_values_are_checked_with_one_line_errors() -> None:
    check_cu_values("cu_seqlens_q", [0, 3, 3, 10], 10, 7)
    for cu, total, most, match in (([1, 3, 10], 10, 9, "start at 0"),
                                   ([0, 5, 3, 10], 10, 9, "never decrease"),
                                   ([0, 3, 9], 10, 9, "end at the packed length 10, got 9"),
                                   ([0, 3, 10], 10, 6, r"max_seqlen_q \(6\) is smaller than a "
                                                       "sequence of length 7")):
        with pytest.raises(ValueError, match=match) as info:
            check_cu_values("cu_seqlens_q", cu, total, most)
        assert "\n" not in str(info.value)


def test_inputs_off_the_gpu_are_refused_before_any_launch() -> None:
    q = torch.zeros(10, 4, 64, dtype=torch.float16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        check_varlen_inputs(q, q, q, cu, cu, 10, 10)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        check_varlen_inputs([1], q, q, cu, cu, 10, 10)  # type: ignore[arg-type]


def test_the_plan_checks_edge_sequences_then_the_workloads_own() -> None:
    w = issue_workload()
    (edge, h, kv, strided), (own, h2, kv2, strided2) = validate.varlen_plan(w)
    assert strided and (h, kv) == (8, 2) and (0, 0) in edge and (37, 0) in edge
    assert any(lq % 64 and lq % 96 for lq, _ in edge)  # tails of no tile size
    assert own == w.seqlens and not strided2 and h2 == 4 * kv2
    assert kv2 * 4 * max(a * b for a, b in own) <= validate.MAX_REFERENCE_SCORES


def test_padded_sdpa_needs_a_mask_only_where_is_causal_is_not_exact() -> None:
    assert padded_without_mask(issue_workload())
    assert not padded_without_mask(VarlenWorkload(((3, 5), (4, 4)), heads=1, head_dim=16,
                                                  causal=True))
    assert not padded_without_mask(VarlenWorkload(((3, 3), (4, 4)), heads=1, head_dim=16))
    assert padded_without_mask(VarlenWorkload(((3, 4), (2, 4)), heads=1, head_dim=16))


@pytest.mark.parametrize("causal", [False, True])
def test_a_varlen_forward_gets_sdpas_gradients(causal: bool) -> None:
    """``with_sdpa_gradients``: the forward is ``run()``'s, the gradients those of SDPA per
    sequence (empty sequences, queries without keys, GQA, lengths apart), zeros where an
    input reaches no output, and none for an input that wants none."""
    from evoengine.launch.varlen import varlen_sdpa, with_sdpa_gradients

    torch.manual_seed(0)
    lengths = [(5, 5), (0, 4), (3, 0), (7, 3), (2, 9), (0, 0)]
    cu_q = torch.tensor([0, *itertools.accumulate(lq for lq, _ in lengths)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk for _, lk in lengths)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), 2, 16, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(q.shape, dtype=torch.float64)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return varlen_sdpa(q, k, v, cu_q, cu_k, causal=causal, scale=0.3)

    out = with_sdpa_gradients(run, q, k, v, cu_q, cu_k, causal=causal, scale=0.3)
    assert out.grad_fn is not None
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expect = torch.autograd.grad(varlen_sdpa(q, k, v, cu_q, cu_k, causal=causal, scale=0.3),
                                 (q, k, v), dout)
    for got, want in zip(grads, expect, strict=True):
        torch.testing.assert_close(got, want)
    assert torch.equal(grads[0][5:8], torch.zeros_like(grads[0][5:8]))  # (3, 0): no key

    # No query anywhere: k and v reach no output, their gradients are zeros.
    k2 = torch.randn(5, 2, 16, dtype=torch.float64, requires_grad=True)
    none = torch.tensor([0, 0, 0], dtype=torch.int32)
    out = with_sdpa_gradients(lambda: torch.zeros(0, 4, 16, dtype=torch.float64), q[:0], k2,
                              k2, none, torch.tensor([0, 3, 5], dtype=torch.int32),
                              causal=causal, scale=None)
    (g,) = torch.autograd.grad(out.sum(), (k2,))
    assert torch.equal(g, torch.zeros_like(k2))
    # Only q wants a gradient.
    q2, kv = q.detach().requires_grad_(), k.detach()
    with_sdpa_gradients(run, q2, kv, kv, cu_q, cu_k, causal=causal, scale=0.3).backward(dout)
    assert q2.grad is not None and kv.grad is None
