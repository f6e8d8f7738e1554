"""The backward of ragged batches on a real GPU: the mma_bwd kernels (and wgmma_bwd's on
Hopper: every point tests/gpu/test_backward.py runs) compiled with VARLEN against each
sequence's float64 reference gradients (``validate.check_varlen_backward``).

Fresh packed inputs per check, NaN-poisoned dQ, dK, dV, empty sequences (no query, no key),
tails that are no multiple of any tile, uneven query and key lengths (causal bottom-right per
sequence), GQA, strided slices of one qkv tensor, both dQ paths (atomics, and the
deterministic parts), a scale; then the launcher's input checks and a wrong kernel.
"""

from __future__ import annotations

import functools

import pytest
import torch

from evoengine import paths, validate
from evoengine.backward import VarlenBackwardKernel
from evoengine.compile import compile_many
from evoengine.problems.varlen_bwd import VarlenBackwardWorkload
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import gpu_arch
from evoengine.space import SearchSpace

# mma_bwd: block shapes of both head dims (each takes those its space admits: three or
# more), K and V in registers or not, each dQ path.
POINTS = [
    dict(BLOCK_M=64, BLOCK_N=128, NUM_WARPS=8, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
         KV_IN_REGS=False),
    dict(BLOCK_M=32, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
         KV_IN_REGS=False),
    dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=3, SWIZZLE="pad", DQ_ACCUM="separate",
         KV_IN_REGS=False),
    dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=1, SWIZZLE="none", DQ_ACCUM="atomic",
         KV_IN_REGS=True),
    dict(BLOCK_M=32, BLOCK_N=128, NUM_WARPS=8, STAGES=3, SWIZZLE="pad", DQ_ACCUM="separate",
         KV_IN_REGS=False),
    dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=1, SWIZZLE="none", DQ_ACCUM="atomic",
         KV_IN_REGS=False),
    # GROUP_SPLIT: shares of dK and dV by 2, 4 (deterministic parts) and 8 blocks.
    dict(BLOCK_M=32, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
         KV_IN_REGS=False, GROUP_SPLIT=2),
    dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=3, SWIZZLE="pad", DQ_ACCUM="separate",
         KV_IN_REGS=False, GROUP_SPLIT=4),
    dict(BLOCK_M=32, BLOCK_N=128, NUM_WARPS=8, STAGES=3, SWIZZLE="pad", DQ_ACCUM="atomic",
         KV_IN_REGS=False, GROUP_SPLIT=8),
]
RAGGED = ((300, 300), (0, 0), (1, 1), (129, 77), (0, 50), (40, 0), (77, 300), (509, 509),
          (64, 64), (1000, 999), (33, 31))

_built: dict[str, VarlenBackwardKernel] = {}


def candidates(causal: bool, dtype: str = "fp16", head_dim: int = 128,
               family: str = "mma_bwd") -> list[Candidate]:
    from tests.gpu.test_backward import POINTS as BWD_POINTS

    sp = SearchSpace.load(paths.SPACES / f"{family}.toml").with_untested()  # what must pass
    arch = gpu_arch()
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, CAUSAL=causal, VARLEN=True)
    points = [sp.complete(p) for p in (POINTS if family == "mma_bwd" else BWD_POINTS[family])]
    return [make_candidate(sp, p, problem, arch) for p in points
            if not sp.violations(p, problem, arch)]


def kernels(cands: list[Candidate]) -> list[VarlenBackwardKernel]:
    todo = [c for c in cands if c.identity not in _built]
    for cand, compiled in zip(todo, compile_many(todo, gpu_arch()), strict=True):
        assert compiled.ok, compiled.error
        _built[cand.identity] = VarlenBackwardKernel(cand, compiled)
    return [_built[c.identity] for c in cands]


def dtype_of(name: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", ["mma_bwd", "wgmma_bwd"])
def test_ragged_backward_passes_the_criterion(family: str, causal: bool, head_dim: int) -> None:
    if family == "wgmma_bwd" and gpu_arch().name != "sm_90a":
        pytest.skip("wgmma_bwd runs on sm_90a only")
    found = kernels(candidates(causal, head_dim=head_dim, family=family))
    assert len(found) >= 3
    for kernel in found:
        for heads, kv, strided in ((8, 2, True), (4, 4, False)):
            v = validate.check_varlen_backward(kernel, seqlens=RAGGED, heads=heads, kv_heads=kv,
                                               head_dim=head_dim, causal=causal,
                                               dtype=torch.float16, strided=strided)
            assert v.ok, f"{kernel.name} H{heads}/{kv}: {v.reason}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", ["mma_bwd", "wgmma_bwd"])
def test_the_deterministic_path_is_right_and_bit_identical(family: str, causal: bool) -> None:
    if family == "wgmma_bwd" and gpu_arch().name != "sm_90a":
        pytest.skip("wgmma_bwd runs on sm_90a only")
    kernel = next(k for k in kernels(candidates(causal, head_dim=64, family=family))
                  if k.dq_accum == "atomic")
    assert kernel.dq_accum == "atomic"
    fn = functools.partial(kernel, deterministic=True)
    v = validate.check_varlen_backward(fn, seqlens=RAGGED, heads=8, kv_heads=2, head_dim=64,
                                       causal=causal, dtype=torch.float16)
    assert v.ok, v.reason
    seen = []

    def keep(*args: torch.Tensor, **kw: torch.Tensor) -> tuple:
        seen.append([t.clone() for t in fn(*args, **kw)])
        return seen[-1]
    for _ in range(2):
        validate.check_varlen_backward(keep, seqlens=RAGGED, heads=8, kv_heads=2, head_dim=64,
                                       causal=causal, dtype=torch.float16, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gqa_mqa_bf16_and_a_scale(dtype: str) -> None:
    (kernel, *_) = kernels(candidates(True, dtype, 128))
    for heads, kv in ((16, 2), (6, 1)):
        v = validate.check_varlen_backward(kernel, seqlens=RAGGED, heads=heads, kv_heads=kv,
                                           head_dim=128, causal=True, dtype=dtype_of(dtype),
                                           scale=0.05)
        assert v.ok, f"H{heads}/{kv}: {v.reason}"


def test_the_workload_criterion_and_a_wrong_kernel() -> None:
    w = VarlenBackwardWorkload(((700, 700), (0, 5), (129, 200), (3, 0), (1500, 1500)),
                               heads=8, kv_heads=2, head_dim=64, causal=True)
    (kernel, *_) = kernels(candidates(True, head_dim=64))
    v = validate.check_varlen_backward_workload(kernel, w)
    assert v.ok, v.reason

    def wrong_scale(*args: torch.Tensor, scale: float | None, **kw: torch.Tensor) -> tuple:
        return kernel(*args, scale=0.2, **kw)
    v = validate.check_varlen_backward_workload(wrong_scale, w)
    assert not v.ok and "wrong" in v.reason


def test_input_checks_raise_before_any_launch() -> None:
    (kernel, *_) = kernels(candidates(True, head_dim=64))
    q = torch.randn(30, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(40, 2, 64, device="cuda", dtype=torch.float16)
    lse = torch.zeros(4, 30, device="cuda")
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 15, 40], dtype=torch.int32, device="cuda")
    call = functools.partial(kernel, q, k, k, q, lse, q)
    for args, kw, match in (
            ((cu_q, cu_k, 20, 25), {}, None),
            ((cu_k, cu_k, 20, 25), {}, "cu_seqlens_q must end at the packed length 30"),
            ((cu_q.flip(0), cu_k, 20, 25), {}, "must start at 0"),
            ((cu_q, cu_k, 19, 25), {}, r"max_seqlen_q \(19\) is smaller"),
            ((cu_q.long(), cu_k, 20, 25), {}, "cu_seqlens_q must be int32"),
            ((cu_q, cu_k, 20, 25), {"causal": False}, "compiled for causal=True"),
    ):
        kw = {"causal": True, **kw}
        if match is None:
            call(*args, **kw)
            continue
        with pytest.raises(ValueError, match=match) as info:
            call(*args, **kw)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"lse must be a contiguous float32 \[4, 30\]"):
        kernel(q, k, k, q, lse.t(), q, cu_q, cu_k, 20, 25, causal=True)
    with pytest.raises(ValueError, match="dout must match q"):
        kernel(q, k, k, q, lse, k, cu_q, cu_k, 20, 25, causal=True)
