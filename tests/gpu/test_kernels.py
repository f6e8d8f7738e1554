"""Every family against the float64 reference over the whole coverage, on a real GPU.

Fresh random inputs per check, NaN-poisoned outputs, lengths that are no multiple of any
tile, Sq != Sk both ways (causal aligned bottom-right), GQA and MQA, strided views, the
softmax scale and the log-sum-exp output.
"""

from __future__ import annotations

import random

import pytest
import torch

from evoengine import paths, validate
from evoengine.arch import get_arch
from evoengine.compile import compile_many
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import Kernel, gpu_arch
from evoengine.space import SearchSpace


def wgmma_point(**override: object) -> dict[str, object]:
    """A wgmma point: 128 x 128, 2 stages, 128-byte swizzle, P from registers, overlap on, no
    ping-pong, one block per tile, per-head order, static schedule; with ``override``."""
    return {**dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs",
                   INTRA_WG_OVERLAP=True, PINGPONG=False, PERSISTENT=False, TILE_ORDER="head",
                   SCHEDULER="static", PACK_GQA=False, P_BARRIER="warpgroup",
                   O_STAGE="own_or_q", O_STORE="threads"), **override}


# Hand-picked points spanning each family's parameters (stages, swizzle, Q placement,
# one or two m16 tiles per warp, lazy rescale, a register cap, both K/V pipelines).
CONFIGS = {
    "mma": [
        dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
             LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="joint"),
        dict(BLOCK_M=128, BLOCK_N=32, NUM_WARPS=4, STAGES=3, SWIZZLE="pad", Q_IN_REGS=False,
             LAZY_RESCALE=True, MIN_BLOCKS=1, PIPELINE="split"),
        dict(BLOCK_M=128, BLOCK_N=64, NUM_WARPS=8, STAGES=1, SWIZZLE="none", Q_IN_REGS=False,
             LAZY_RESCALE=True, MIN_BLOCKS=1, PIPELINE="split"),
        dict(BLOCK_M=64, BLOCK_N=32, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=False,
             LAZY_RESCALE=False, MIN_BLOCKS=3, PIPELINE="split"),
    ],
    "wmma": [
        dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="pad", Q_IN_REGS=False),
        dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=3, SWIZZLE="none", Q_IN_REGS=True),
    ],
    # sm_90a only: 1, 2 and 3 consumer warpgroups, each swizzle width, P from registers and
    # shared memory, with and without intra-warpgroup overlap, ping-pong, a persistent grid,
    # and the tile of the d128 winners (3 consumers, P through shared memory).
    "wgmma": [
        wgmma_point(),
        wgmma_point(BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem", INTRA_WG_OVERLAP=False,
                    PINGPONG=True, PERSISTENT=True),
        wgmma_point(BLOCK_M=192, BLOCK_N=64, STAGES=4, SWIZZLE=32, PINGPONG=True,
                    PERSISTENT=True),
        wgmma_point(BLOCK_M=64, BLOCK_N=176),
        wgmma_point(BLOCK_N=96, SWIZZLE=32, P_FROM="smem", PINGPONG=True),
        wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True),
    ],
}

# (batch, heads, kv_heads, seq_q, seq_k, layout)
SHAPES = [
    (2, 4, 4, 257, 257, "bhsd"),   # tails in every tile size
    (1, 3, 3, 7, 7, "bhsd"),       # shorter than one tile
    (2, 8, 2, 200, 333, "bshd"),   # GQA, Sq < Sk, strided views of [B, S, H, D]
    (1, 6, 1, 300, 129, "bhsd"),   # MQA, Sq > Sk: causal rows with no key
    (1, 2, 2, 1, 515, "bhsd"),     # one query (decode-like)
    (1, 2, 1, 1500, 1499, "bhsd"), # many key blocks: the K/V ring wraps
]
PROBLEMS = [
    dict(HEAD_DIM=d, DTYPE=t, CAUSAL=c) for d in (64, 128) for t in ("fp16", "bf16")
    for c in (False, True)
]
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

_kernels: dict[str, Kernel] = {}


def space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def targets_this_gpu(family: str) -> bool:
    return space(family).supports(gpu_arch())


def need_family(family: str) -> None:
    """Skip a test of a family that does not target this GPU (wgmma off Hopper)."""
    if not targets_this_gpu(family):
        pytest.skip(f"{family} does not target {gpu_arch().name}")


def build(cands: list[Candidate]) -> list[Kernel]:
    """Compile what is missing in parallel, then load; cached across tests."""
    arch = gpu_arch()
    todo = [c for c in cands if c.identity not in _kernels]
    for c, result in zip(todo, compile_many(todo, arch), strict=True):
        assert result.ok, f"{c.identity}: {result.error}"
        _kernels[c.identity] = Kernel(c, result)
    return [_kernels[c.identity] for c in cands]


@pytest.fixture(scope="module", autouse=True)
def prebuild() -> None:
    arch = gpu_arch()
    build([make_candidate(space(f), cfg, pr, arch) for f, cfgs in CONFIGS.items()
           if targets_this_gpu(f) for cfg in cfgs for pr in PROBLEMS])


def run_check(kernel: Kernel, shape: tuple, scale: float | None = None) -> validate.Verdict:
    b, h, hkv, sq, sk, layout = shape
    return validate.check(
        kernel, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=sk,
        head_dim=kernel.head_dim, causal=kernel.causal, dtype=TORCH_DTYPE[kernel.dtype],
        scale=scale, layout=layout,
    )


POINTS = [(f, i) for f, cfgs in CONFIGS.items() for i in range(len(cfgs))]


def problem_id(p: dict) -> str:
    return "d{HEAD_DIM}-{DTYPE}-{CAUSAL}".format(**p)


@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_id)
@pytest.mark.parametrize("family,idx", POINTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(family: str, idx: int, problem: dict, shape: tuple) -> None:
    need_family(family)
    (kernel,) = build([make_candidate(space(family), CONFIGS[family][idx], problem, gpu_arch())])
    verdict = run_check(kernel, shape)
    assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


@pytest.mark.parametrize("family", CONFIGS)
def test_softmax_scale(family: str) -> None:
    need_family(family)
    (kernel,) = build([make_candidate(space(family), CONFIGS[family][0], PROBLEMS[1], gpu_arch())])
    for scale in (0.02, 0.5, -0.1, 0.0):  # negative and zero take their own paths
        verdict = run_check(kernel, (1, 4, 2, 190, 250, "bhsd"), scale=scale)
        assert verdict.ok, f"scale {scale}: {verdict.reason}"


@pytest.mark.parametrize("causal", [False, True])
def test_row_max_growing_along_the_keys(causal: bool) -> None:
    """Scores that rise block after block make a lazy rescale actually rescale."""
    cfgs = [c for c in CONFIGS["mma"] if c.get("LAZY_RESCALE")]
    assert cfgs, "no lazy-rescale config in the GPU suite"
    problem = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=causal)
    (kernel,) = build([make_candidate(space("mma"), cfgs[0], problem, gpu_arch())])
    verdict = growing_scores_verdict(kernel, causal)
    assert verdict.ok, verdict.reason


@pytest.mark.parametrize("idx", [0, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_row_max_growing_along_the_keys(causal: bool, idx: int) -> None:
    """The online rescale of O (overlapped with P.V, and not) when every block raises the max."""
    need_family("wgmma")
    problem = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=causal)
    (kernel,) = build([make_candidate(space("wgmma"), CONFIGS["wgmma"][idx], problem,
                                      gpu_arch())])
    verdict = growing_scores_verdict(kernel, causal)
    assert verdict.ok, verdict.reason


def growing_scores_verdict(kernel: Kernel, causal: bool) -> validate.Verdict:
    gen = torch.Generator(device="cuda").manual_seed(7)
    sq, sk = 150, 700
    q = torch.randn(1, 2, sq, 64, generator=gen, device="cuda").abs().half()
    ramp = torch.linspace(0, 3, sk, device="cuda")[None, None, :, None]
    k = (torch.rand(1, 2, sk, 64, generator=gen, device="cuda") * ramp).half()
    v = torch.randn(1, 2, sk, 64, generator=gen, device="cuda").half()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, sq), float("nan"), device="cuda")
    kernel(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = validate.reference(q, k, v, causal=causal)
    return validate.judge(out, ref, validate.sdpa(q, k, v, causal=causal), lse, ref_lse)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("idx", [0, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_one_key_dominates_a_later_block(causal: bool, idx: int, dtype: str) -> None:
    """A key that outweighs every other comes after the block that set the row max, 1.8 (log2)
    above it: O shrinks by 2^-1.8 when that block lands, and the rows' sums and P must agree
    on the dominant term (a lazy rescale, which keeps a max that moved less than 2^2, would
    round a P of ~3.7 for P.V and sum it unrounded: docs/NOTES.md). Attention sinks and
    retrieval heads make such rows common; the criterion must still hold."""
    need_family("wgmma")
    problem = dict(HEAD_DIM=64, DTYPE=dtype, CAUSAL=causal)
    (kernel,) = build([make_candidate(space("wgmma"), CONFIGS["wgmma"][idx], problem,
                                      gpu_arch())])
    gen = torch.Generator(device="cuda").manual_seed(11)
    sq, sk, d = 100, 600, 64
    torch_dtype = TORCH_DTYPE[dtype]
    q = 0.05 * torch.randn(1, 2, sq, d, generator=gen, device="cuda")
    q[..., 0] += 4.0
    k = 0.3 * torch.randn(1, 2, sk, d, generator=gen, device="cuda")
    k[:, :, 70, 0] = 16.0   # score ~8 in block 0: sets the max
    k[:, :, 300, 0] = 18.5  # score ~9.25, 1.25 nats (1.8 in log2) above it: dominates
    v = torch.randn(1, 2, sk, d, generator=gen, device="cuda")
    q, k, v = (t.to(torch_dtype) for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, sq), float("nan"), device="cuda")
    kernel(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = validate.reference(q, k, v, causal=causal)
    verdict = validate.judge(out, ref, validate.sdpa(q, k, v, causal=causal), lse, ref_lse)
    assert verdict.ok, f"{kernel.candidate.identity}: {verdict.reason}"


# PACK_GQA: P query heads of a KV head per token in a tile's
# rows, P the lowest set bit of the group (at most 64): one, two and three consumers, P
# through shared memory, the dynamic scheduler.
PACKED = [
    wgmma_point(PACK_GQA=True),
    wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PACK_GQA=True),
    wgmma_point(BLOCK_M=64, BLOCK_N=176, PACK_GQA=True),
    wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic", PACK_GQA=True),
]
# (batch, heads, kv_heads, seq_q, seq_k, layout): groups of 4, 32 (MQA-like), 3 (odd: P = 1),
# 12 (P = 4 of 12), 128 (P capped at 64) and 1, lengths no tile's multiple, rows with no key
PACKED_SHAPES = [
    (2, 8, 2, 257, 257, "bhsd"),
    (1, 32, 1, 300, 333, "bshd"),
    (2, 6, 2, 129, 129, "bhsd"),
    (1, 12, 1, 200, 150, "bhsd"),
    (1, 128, 1, 70, 90, "bshd"),
    (1, 4, 4, 100, 100, "bhsd"),
]


@pytest.mark.parametrize("idx", range(len(PACKED)))
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_id)
def test_wgmma_packed_gqa(problem: dict, idx: int) -> None:
    need_family("wgmma")
    sp = space("wgmma").with_untested()
    if sp.violations(PACKED[idx], problem, gpu_arch()):
        pytest.skip("not admitted for this problem")
    (kernel,) = build([make_candidate(sp, PACKED[idx], problem, gpu_arch())])
    for shape in PACKED_SHAPES:
        verdict = run_check(kernel, shape)
        assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


# Values added to wgmma's space, each with the twin that differs only there (the legacy value):
# the same arithmetic, so the same bits (a new value waits under [untested] until this passes).
# P_BARRIER "turn": P in shared memory ordered before its P.V by the ping-pong turn barrier
# alone; two and three consumers, with and without overlap, swizzles of 32 to 128 bytes,
# persistent with the dynamic scheduler. O_STAGE "p": a persistent block stages O in each
# consumer's P tile and hands Q back after the last S GEMM; with and without ping-pong, with the
# turn barrier, the dynamic scheduler, packed GQA heads. O_STORE "tma": O out by TMA stores of
# each warp's 16 rows, staged in a buffer of its own, in the P tile or in Q's; one to three
# consumers, swizzles of 32 to 128 bytes, persistent static and dynamic.
VALUE_TWINS = [
    (wgmma_point(BLOCK_M=192, PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic",
                 O_STORE="tma"), {"O_STORE": "threads"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic",
                 P_BARRIER="turn", O_STAGE="p", O_STORE="tma"), {"O_STORE": "threads"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, P_BARRIER="turn", O_STORE="tma"),
     {"O_STORE": "threads"}),
    (wgmma_point(O_STORE="tma"), {"O_STORE": "threads"}),
    (wgmma_point(PERSISTENT=True, SWIZZLE=64, O_STORE="tma"), {"O_STORE": "threads"}),
    (wgmma_point(BLOCK_N=96, SWIZZLE=32, P_FROM="smem", O_STORE="tma"), {"O_STORE": "threads"}),
    (wgmma_point(BLOCK_M=64, STAGES=3, PERSISTENT=True, SCHEDULER="dynamic", O_STORE="tma"),
     {"O_STORE": "threads"}),
    (wgmma_point(BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem", INTRA_WG_OVERLAP=False,
                 PINGPONG=True, PERSISTENT=True, P_BARRIER="turn"), {"P_BARRIER": "warpgroup"}),
    (wgmma_point(BLOCK_N=96, SWIZZLE=32, P_FROM="smem", PINGPONG=True, P_BARRIER="turn"),
     {"P_BARRIER": "warpgroup"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, P_BARRIER="turn"),
     {"P_BARRIER": "warpgroup"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True,
                 SCHEDULER="dynamic", P_BARRIER="turn"), {"P_BARRIER": "warpgroup"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True, O_STAGE="p"),
     {"O_STAGE": "own_or_q"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PERSISTENT=True, O_STAGE="p"),
     {"O_STAGE": "own_or_q"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True, P_BARRIER="turn",
                 O_STAGE="p"), {"O_STAGE": "own_or_q", "P_BARRIER": "warpgroup"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True,
                 SCHEDULER="dynamic", O_STAGE="p"), {"O_STAGE": "own_or_q"}),
    (wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True, PACK_GQA=True,
                 O_STAGE="p"), {"O_STAGE": "own_or_q"}),
]
# Many more tiles than SMs: a persistent block runs tile after tile (its Q, P and O reused).
MANY_TILES = (4, 64, 8, 700, 700, "bhsd")


def checked_with_twin(problem: dict, point: dict, twin_point: dict,
                      seed: int) -> tuple[Kernel, Kernel, tuple[torch.Tensor, ...]]:
    """wgmma's ``point`` through the criterion on every shape and on many tiles per block, its
    twin built beside it, and fresh inputs of MANY_TILES' shape to run both on."""
    need_family("wgmma")
    sp, arch = space("wgmma").with_untested(), gpu_arch()
    if sp.violations(point, problem, arch):
        pytest.skip("not admitted for this problem")
    kernel, twin = build([make_candidate(sp, point, problem, arch),
                          make_candidate(sp, twin_point, problem, arch)])
    for shape in (*SHAPES, MANY_TILES):
        verdict = run_check(kernel, shape)
        assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, h, hkv, sq, sk, _ = MANY_TILES
    dtype, d = TORCH_DTYPE[problem["DTYPE"]], problem["HEAD_DIM"]
    q = torch.randn(b, h, sq, d, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(b, hkv, sk, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    return kernel, twin, (q, k, v)


@pytest.mark.parametrize("idx", range(len(VALUE_TWINS)))
@pytest.mark.parametrize("problem", PROBLEMS, ids=problem_id)
def test_wgmma_value_is_its_twin(problem: dict, idx: int) -> None:
    """The criterion on every shape and on many tiles per block, then the same bits as the
    twin over five calls (a race on P, Q or O would differ somewhere)."""
    point, legacy = VALUE_TWINS[idx]
    kernel, twin, qkv = checked_with_twin(problem, point, {**point, **legacy}, idx)
    want = twin(*qkv)
    for _ in range(5):
        assert torch.equal(kernel(*qkv), want), kernel.candidate.identity


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_other_head_dims(family: str, head_dim: int) -> None:
    need_family(family)
    arch = gpu_arch()
    sp = space(family)
    for causal in (False, True):
        problem = dict(HEAD_DIM=head_dim, DTYPE="bf16", CAUSAL=causal)
        admitted = sp.admitted(problem, arch)
        assert admitted, f"no {family} config admitted for head_dim {head_dim}"
        cfg = random.Random(head_dim).choice(admitted)
        (kernel,) = build([make_candidate(sp, cfg, problem, arch)])
        verdict = run_check(kernel, (2, 4, 2, 131, 77, "bhsd"))
        assert verdict.ok, f"{kernel.candidate.identity}: {verdict.reason}"


@pytest.mark.parametrize("family", CONFIGS)
def test_random_admitted_points(family: str) -> None:
    """A spread of the whole space: any admitted point must be correct, not just ours."""
    need_family(family)
    arch = gpu_arch()
    sp = space(family)
    rng = random.Random(2026)
    cands = []
    for problem in PROBLEMS:
        cands += [make_candidate(sp, cfg, problem, arch)
                  for cfg in rng.sample(sp.admitted(problem, arch), 3)]
    failures = []
    for kernel in build(cands):
        for shape in ((1, 2, 1, 333, 333, "bhsd"), (2, 2, 2, 97, 160, "bshd")):
            verdict = run_check(kernel, shape)
            if not verdict.ok:
                failures.append(f"{kernel.candidate.identity} {shape}: {verdict.reason}")
    assert not failures, "\n".join(failures)


def test_poisoned_output_catches_unwritten_rows() -> None:
    """The criterion itself: a kernel that skips the last row must fail."""
    (kernel,) = build([make_candidate(space("mma"), CONFIGS["mma"][0], PROBLEMS[0], gpu_arch())])

    def lazy(q, k, v, *, scale=None, out=None, lse=None):
        full = kernel(q, k, v, scale=scale, lse=lse)
        out[:, :, :-1].copy_(full[:, :, :-1])
        return out

    verdict = validate.check(lazy, batch=1, heads=2, kv_heads=2, seq_q=100, seq_k=100,
                             head_dim=64, causal=False, dtype=torch.float16)
    assert not verdict.ok and "non-finite" in verdict.reason


def test_arch_is_hopper_or_ampere() -> None:
    assert gpu_arch() in (get_arch("sm_80"), get_arch("sm_86"), get_arch("sm_89"),
                          get_arch("sm_90a"))


@pytest.mark.parametrize("idx", range(len(CONFIGS["wgmma"])))
def test_wgmma_more_tiles_than_sms(idx: int) -> None:
    """Persistent blocks loop over several tiles (Q reloaded, the rings carried across)."""
    need_family("wgmma")
    for problem in (PROBLEMS[0], PROBLEMS[7]):
        (kernel,) = build([make_candidate(space("wgmma"), CONFIGS["wgmma"][idx], problem,
                                          gpu_arch())])
        for shape in ((3, 16, 4, 1111, 1000, "bshd"), (2, 32, 8, 1000, 1111, "bhsd")):
            verdict = run_check(kernel, shape)
            assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


# Causal tile orders (causal only): the L2 sections on both grids, and the per-head order with
# the persistent grid's alternating rounds, with warpgroups that skip the blocks past their
# rows (BLOCK_N 64 with 2 and 3 consumers), ping-pong turns kept in step while one skips; the
# dynamic scheduler (tiles named through shared memory, the end by a Q phase with no bytes)
# with 2 consumers and O staged apart, and with 3 and ping-pong over the L2 order.
CAUSAL_ORDER_CONFIGS = [
    wgmma_point(TILE_ORDER="l2"),
    wgmma_point(BLOCK_N=64, PINGPONG=True, PERSISTENT=True, TILE_ORDER="l2"),
    wgmma_point(BLOCK_M=192, BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem",
                INTRA_WG_OVERLAP=False, PINGPONG=True, PERSISTENT=True),
    wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
    wgmma_point(BLOCK_M=192, BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem",
                INTRA_WG_OVERLAP=False, PINGPONG=True, PERSISTENT=True, TILE_ORDER="l2",
                SCHEDULER="dynamic"),
]


@pytest.mark.parametrize("idx", range(len(CAUSAL_ORDER_CONFIGS)))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_causal_tile_orders(idx: int, head_dim: int) -> None:
    need_family("wgmma")
    problem = dict(HEAD_DIM=head_dim, DTYPE="bf16", CAUSAL=True)
    (kernel,) = build([make_candidate(space("wgmma"), CAUSAL_ORDER_CONFIGS[idx], problem,
                                      gpu_arch())])
    for shape in (*SHAPES, (3, 16, 4, 1111, 1000, "bshd"), (2, 32, 8, 1000, 1111, "bhsd"),
                  (1, 40, 40, 640, 640, "bhsd")):
        verdict = run_check(kernel, shape)
        assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


DYNAMIC_CONFIGS = [cfg for cfg in CAUSAL_ORDER_CONFIGS if cfg["SCHEDULER"] == "dynamic"]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("idx", range(len(DYNAMIC_CONFIGS)))
def test_wgmma_dynamic_counter_is_fresh_per_launch(idx: int, causal: bool) -> None:
    """The tile counter is the launcher's, zeroed per launch on the launch's stream: launches
    back to back, on two streams at once and replayed from a CUDA graph all cover every tile.
    About 15 tiles per SM, so blocks loop long and the counter runs far past the grid. The
    kernel is deterministic (a tile's arithmetic does not depend on its block), so every run
    matches the first bit for bit, and the first passes the criterion."""
    need_family("wgmma")
    problem = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=causal)
    if space("wgmma").violations(DYNAMIC_CONFIGS[idx], problem, gpu_arch()):
        pytest.skip("not admitted for this problem")
    (kernel,) = build([make_candidate(space("wgmma"), DYNAMIC_CONFIGS[idx], problem,
                                      gpu_arch())])
    shape = (4, 32, 8, 2048, 2048, "bhsd")
    verdict = run_check(kernel, shape)
    assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, h, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (32, 8, 8))
    first = kernel(q, k, v)
    for _ in range(3):
        assert torch.equal(kernel(q, k, v), first)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [torch.full_like(first, float("nan")) for _ in streams]
    torch.cuda.synchronize()
    for stream, out in zip(streams, outs, strict=True):
        with torch.cuda.stream(stream):
            kernel(q, k, v, out=out)
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    graph_out = torch.full_like(first, float("nan"))
    kernel(q, k, v, out=graph_out)  # loaded and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(q, k, v, out=graph_out)
    for _ in range(2):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, first)


# The dynamic scheduler on full tiles (no mask): the d64 and d128 winners' tiles (192 rows, P in
# registers and in shared memory) and a 2-consumer one. A tile's arithmetic does not depend on
# the block that runs it, so the output is the static twin's, bit for bit; MANY_TILES' 700 rows
# leave a short last m-block.
FULL_DYNAMIC = [
    wgmma_point(BLOCK_M=192, STAGES=3, PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
    wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
    wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
]


@pytest.mark.parametrize("idx", range(len(FULL_DYNAMIC)))
@pytest.mark.parametrize("problem", [p for p in PROBLEMS if not p["CAUSAL"]], ids=problem_id)
def test_wgmma_dynamic_full_tiles_are_their_static_twin(problem: dict, idx: int) -> None:
    point = FULL_DYNAMIC[idx]
    kernel, twin, qkv = checked_with_twin(problem, point, {**point, "SCHEDULER": "static"}, idx)
    want = twin(*qkv)
    for _ in range(3):
        assert torch.equal(kernel(*qkv), want), kernel.candidate.identity
