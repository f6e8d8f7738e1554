"""Every kind on shapes no other test names: random admitted points of the spaces, each on
random calls, against the float64 reference. Each run draws afresh; the seed is in every
failure, and ``EVO_FUZZ_SEED`` replays it. Points are drawn uniformly from a space's parameters
until admitted, its ``[untested]`` values too.

Decode: for each head dim (64, 128), dtype and layout, points of the decode space (every merge,
combine, cluster size, row grouping and MMA the arch takes), each on calls of any batch (1 to
160), GQA group 1 to 8 over 1 to 8 KV heads, q_len 1 to 16, page size 16 to 256, causal or not,
a softmax scale or the default, and lengths drawn per sequence (empty, shorter than q_len, the
full capacity, anywhere); ``validate.check_decode`` gives each call fresh inputs, NaN past every
length and in the outputs.

Varlen: points of each forward family (wgmma on sm_90a) built with VARLEN, for each head dim,
dtype and mask, on random ragged batches (1 to 40 sequences; empty ones, queries without keys
and keys without queries, query and key lengths apart), GQA groups 1 to 8, q, k and v as slices
of one qkv tensor or not, a scale or the default (``validate.check_varlen``).

Forward and backward: points of each family the GPU takes, for each head dim, dtype and mask,
on random shapes (batch 1 to 5, GQA groups 1 to 6 over 1 to 8 KV heads, query and key lengths
1 to 2500 and apart, [B, H, S, D] or strided [B, S, H, D] views, a scale or the default;
``validate.check`` and ``validate.check_backward``).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from evoengine import paths, validate
from evoengine.backward import BackwardKernel
from evoengine.compile import CompileResult, compile_many
from evoengine.decode import DecodeKernel
from evoengine.launch import KERNEL_DTYPES
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import Kernel, VarlenKernel, gpu_arch
from evoengine.space import SearchSpace

SEED = int(os.environ.get("EVO_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
POINTS_EACH = 2  # points a (head dim, dtype, layout)
CALLS_EACH = 3   # calls a point
PAGE_SIZES = (16, 32, 64, 128, 256)


@functools.cache
def space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml").with_untested()


def drawn_kernels(rng: random.Random, family: str, problem: dict,
                  build: Callable[[Candidate, CompileResult], Any]) -> Iterator[Any]:
    """``POINTS_EACH`` admitted points of ``family`` for ``problem``, each parameter drawn
    uniformly from its domain, compiled together and built by ``build``; skips where the
    family does not target this GPU."""
    arch, sp, points = gpu_arch(), space(family), []
    if not sp.supports(arch):
        pytest.skip(f"{family} does not target {arch.name}")
    while len(points) < POINTS_EACH:
        p = {k: rng.choice(v) for k, v in sp.parameters.items()}
        if not sp.violations(p, problem, arch):
            points.append(p)
    cands = [make_candidate(sp, p, problem, arch) for p in points]
    for cand, result in zip(cands, compile_many(cands, arch), strict=True):
        assert result.ok, f"{cand.identity} (EVO_FUZZ_SEED={SEED}): {result.error}"
        yield build(cand, result)


def draw_lengths(rng: random.Random, batch: int, capacity: int, q_len: int) -> list[int]:
    def one() -> int:
        kind = rng.random()
        if kind < 0.1:
            return 0
        if kind < 0.2:
            return rng.randint(1, min(q_len, capacity))  # queries that see few keys or none
        if kind < 0.3:
            return capacity
        return rng.randint(1, capacity)
    return [one() for _ in range(batch)]


def draw_call(rng: random.Random, paged: bool) -> dict:
    kv_heads = rng.choice((1, 2, 4, 8))
    group = rng.randint(1, 8)
    q_len = rng.choice((1, 1, 2, 3, 4, 4, 5, 7, 8, 11, 16))
    batch = rng.choice((1, 2, 3, 5, 8, 13, 32, 64, 160))
    capacity = rng.choice((1, 17, 100, 700, 2048, 5000, 9000)) if batch <= 8 else \
        rng.choice((1, 33, 300, 1000, 2100))
    page_size = rng.choice(PAGE_SIZES) if paged else 0
    if paged:
        capacity = -(-capacity // page_size) * page_size
    return dict(lengths=draw_lengths(rng, batch, capacity, q_len), capacity=capacity,
                q_len=q_len, heads=kv_heads * group, kv_heads=kv_heads, page_size=page_size,
                causal=rng.random() < 0.8,
                scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.3))


def describe(call: dict) -> str:
    lengths = call["lengths"]
    shown = f"{lengths[:6]}{'...' if len(lengths) > 6 else ''} ({len(lengths)})"
    return (f"lengths {shown} capacity {call['capacity']} q_len {call['q_len']} "
            f"{call['heads']}/{call['kv_heads']} page {call['page_size']} causal "
            f"{call['causal']} scale {call['scale']}")


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_random_points_on_random_calls(head_dim: int, dtype: str, paged: bool) -> None:
    rng = random.Random(f"{SEED}-{head_dim}-{dtype}-{paged}")
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, PAGED=paged)
    for kernel in drawn_kernels(rng, "decode", problem, DecodeKernel):
        for _ in range(CALLS_EACH):
            call = draw_call(rng, paged)
            verdict = validate.check_decode(
                kernel, lengths=call["lengths"], capacity=call["capacity"],
                q_len=call["q_len"], heads=call["heads"], kv_heads=call["kv_heads"],
                head_dim=head_dim, dtype=KERNEL_DTYPES[dtype], paged=paged,
                page_size=call["page_size"], causal=call["causal"], scale=call["scale"],
                seed=rng.randrange(2**62))
            assert verdict.ok, (f"{kernel.name} on {describe(call)} "
                                f"(EVO_FUZZ_SEED={SEED}): {verdict.reason}")


def draw_seqlens(rng: random.Random) -> tuple[tuple[int, int], ...]:
    def length() -> int:
        kind = rng.random()
        return 0 if kind < 0.12 else rng.randint(1, 16) if kind < 0.3 else rng.randint(1, 2500)

    def pair() -> tuple[int, int]:
        lq = length()
        return (lq, lq) if rng.random() < 0.6 else (lq, length())
    return tuple(pair() for _ in range(rng.choice((1, 2, 3, 7, 16, 40))))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", ["mma", "wgmma"])
def test_random_varlen_points_on_random_batches(family: str, head_dim: int, dtype: str,
                                                causal: bool) -> None:
    rng = random.Random(f"{SEED}-{family}-{head_dim}-{dtype}-{causal}")
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, CAUSAL=causal, VARLEN=True)
    for kernel in drawn_kernels(rng, family, problem, VarlenKernel):
        for _ in range(CALLS_EACH):
            seqlens = draw_seqlens(rng)
            kv_heads, group = rng.choice((1, 2, 4, 8)), rng.randint(1, 8)
            strided = rng.random() < 0.5
            scale = None if rng.random() < 0.7 else rng.uniform(0.02, 0.3)
            verdict = validate.check_varlen(
                kernel, seqlens=seqlens, heads=kv_heads * group, kv_heads=kv_heads,
                head_dim=head_dim, causal=causal, dtype=KERNEL_DTYPES[dtype], scale=scale,
                strided=strided, seed=rng.randrange(2**62))
            shown = f"{list(seqlens[:5])}{'...' if len(seqlens) > 5 else ''} ({len(seqlens)})"
            assert verdict.ok, (f"{kernel.name} on {shown} {kv_heads * group}/{kv_heads} "
                                f"strided {strided} scale {scale} (EVO_FUZZ_SEED={SEED}): "
                                f"{verdict.reason}")


def draw_length(rng: random.Random) -> int:
    kind = rng.random()
    return rng.randint(1, 16) if kind < 0.25 else rng.randint(1, 2500)


def draw_dense_shape(rng: random.Random) -> dict:
    """A shape whose float64 reference stays under 2^25 scores."""
    kv_heads, group = rng.choice((1, 2, 4, 8)), rng.randint(1, 6)
    seq_q = draw_length(rng)
    seq_k = seq_q if rng.random() < 0.5 else draw_length(rng)
    batch = rng.choice((1, 2, 3, 5))
    while batch > 1 and batch * kv_heads * group * seq_q * seq_k > 1 << 25:
        batch -= 1
    while kv_heads > 1 and batch * kv_heads * group * seq_q * seq_k > 1 << 25:
        kv_heads //= 2
    return dict(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, seq_q=seq_q,
                seq_k=seq_k, layout=rng.choice(("bhsd", "bshd")),
                scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.3))


def check_dense(family: str, head_dim: int, dtype: str, causal: bool, backward: bool) -> None:
    rng = random.Random(f"{SEED}-{family}-{head_dim}-{dtype}-{causal}")
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, CAUSAL=causal)
    check = validate.check_backward if backward else validate.check
    for kernel in drawn_kernels(rng, family, problem, BackwardKernel if backward else Kernel):
        for _ in range(CALLS_EACH):
            shape = draw_dense_shape(rng)
            verdict = check(kernel, head_dim=head_dim, causal=causal, dtype=KERNEL_DTYPES[dtype],
                            seed=rng.randrange(2**62), **shape)
            assert verdict.ok, (f"{kernel.name} on {shape} (EVO_FUZZ_SEED={SEED}): "
                                f"{verdict.reason}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", ["mma", "wmma", "wgmma"])
def test_random_forward_points_on_random_shapes(family: str, head_dim: int, dtype: str,
                                                causal: bool) -> None:
    check_dense(family, head_dim, dtype, causal, backward=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", ["mma_bwd", "wgmma_bwd"])
def test_random_backward_points_on_random_shapes(family: str, head_dim: int, dtype: str,
                                                 causal: bool) -> None:
    check_dense(family, head_dim, dtype, causal, backward=True)
