"""The backward families (mma_bwd, and wgmma_bwd on Hopper) against the float64 reference
gradients, on a real GPU.

Fresh random inputs per check, NaN-poisoned dQ/dK/dV, lengths that are no multiple of any
tile (and 1), Sq != Sk both ways (causal aligned bottom-right), GQA and MQA, strided views of
[B, S, H, D] storage, the softmax scale, both ways of accumulating dQ, and bit-identical
results run to run where the launch is deterministic.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from evoengine import paths, validate
from evoengine.backward import BackwardKernel
from evoengine.compile import compile_many
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import Kernel, gpu_arch
from evoengine.space import SearchSpace

# Hand-picked points per family.
POINTS = {
    # mma_bwd: one or two m16 tiles of dQ rows per warp, 2 to 8 warps, every ring depth and
    # swizzle, K/V fragments in registers or shared memory, both dQ accumulations.
    "mma_bwd": [
        dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
             KV_IN_REGS=False),
        dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=1, SWIZZLE="pad", DQ_ACCUM="separate",
             KV_IN_REGS=True),
        dict(BLOCK_M=32, BLOCK_N=128, NUM_WARPS=8, STAGES=3, SWIZZLE="none", DQ_ACCUM="atomic",
             KV_IN_REGS=False),
        dict(BLOCK_M=32, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="separate",
             KV_IN_REGS=False),
        dict(BLOCK_M=64, BLOCK_N=128, NUM_WARPS=8, STAGES=2, SWIZZLE="pad", DQ_ACCUM="atomic",
             KV_IN_REGS=True),
        # GROUP_SPLIT: a group's query heads dealt to 2, 4 or 8 blocks, their fp32
        # shares of dK and dV added by attn_bwd_kv_post (on the shapes' groups of 1, 3, 4 and
        # 6: splits with one head, several, and none); p6 with the deterministic parts.
        dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
             KV_IN_REGS=False, GROUP_SPLIT=2),
        dict(BLOCK_M=32, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="separate",
             KV_IN_REGS=False, GROUP_SPLIT=4),
        dict(BLOCK_M=32, BLOCK_N=128, NUM_WARPS=8, STAGES=3, SWIZZLE="none", DQ_ACCUM="atomic",
             KV_IN_REGS=False, GROUP_SPLIT=8),
    ],
    # wgmma_bwd: one and two consumer warpgroups; dQ split by head dim (p0), by query rows
    # (p2) and whole (p1, p3, two m64 tiles); every swizzle and ring depth, both dQ paths.
    # p0-p3 omit DQ_REDUCE and REFILL (their legacy values); p4-p8 meet the bulk dQ reduction
    # and the refill after the dQ GEMM with one and two warpgroups, each ring depth, dQ split by
    # head dim (p4) and by query rows (p8). p0-p8 omit LOADER (cp_async, its legacy value);
    # p9-p13 load the ring by a TMA producer: two consumer warpgroups at 240 registers (p9:
    # FlashAttention-3's d128 tile; p10: dQ split by query rows; p12: a one-stage ring, refilled
    # every step) and one at 255 (p11, p13), every swizzle, every dQ path. p14-p18 hand the
    # bulk dQ reduction to warp 1 of the producer (DQ_WRITER=warp) through mbarriers, with one
    # and two staging buffers: two consumer warpgroups (p14: FlashAttention-3's d128 tile, two
    # buffers; p15: dQ split by query rows, a one-stage ring; p17: the timed d128 S3 point) and
    # one (p16, p18). p19-p21 read lse_log2 before the S^T wait (ROWS_EARLY): the TMA ring at
    # 240 registers with a consumer (p19) and a warp (p20) writing dQ, the cp_async ring with one
    # warpgroup (p21). p22-p25 stage dQ in fragment order (DQ_LAYOUT), which the last kernel
    # un-permutes: the TMA ring with a consumer (p22, FlashAttention-3's d128 tile) and a warp
    # with two buffers (p23) adding it, one warpgroup on the cp_async ring at swizzle 32 (p24),
    # dQ split by query rows on the TMA ring (p25). p26-p32 compute dQ^T = K^T dS^T
    # (DQ_TRANSPOSED), so a step may hold 80 or 96 query rows: FlashAttention-3's d128 tile
    # without a mask (p26: 128 keys, 80 rows, staged in the transposed fragment order, added by a
    # consumer; p27: by the dQ warp, a one-stage ring), scalar atomics on the cp_async ring (p28),
    # the deterministic parts at d64 on 96 rows (p29), one warpgroup on the TMA ring at d64 (p30).
    # (Two 64-row points, p31 and p32, passed on the H100 at 75e5e01 and went with the constraint
    # that keeps dQ^T to 80 and 96 rows.)
    "wgmma_bwd": [
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic"),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=1, SWIZZLE=128, DQ_ACCUM="separate"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=3, SWIZZLE=128, DQ_ACCUM="separate"),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=2, SWIZZLE=32, DQ_ACCUM="atomic"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", REFILL="dq"),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=1, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", REFILL="top"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=32, DQ_ACCUM="separate",
             REFILL="dq"),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=1, SWIZZLE=64, DQ_ACCUM="atomic", REFILL="dq"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", REFILL="dq"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="red", LOADER="tma"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma"),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=3, SWIZZLE=64, DQ_ACCUM="separate", LOADER="tma"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=1, SWIZZLE=32, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma"),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic", LOADER="tma"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=1, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=1),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=1),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=2, SWIZZLE=32, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=1),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", ROWS_EARLY=True),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", ROWS_EARLY=True),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=2, SWIZZLE=32, DQ_ACCUM="separate", REFILL="dq",
             ROWS_EARLY=True),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2,
             DQ_LAYOUT="fragment"),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=1, SWIZZLE=32, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", REFILL="top", DQ_LAYOUT="fragment"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment"),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DQ_TRANSPOSED=True),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=1, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             DQ_TRANSPOSED=True),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic", REFILL="dq",
             DQ_TRANSPOSED=True),
        dict(BLOCK_N=64, BLOCK_M=96, STAGES=2, SWIZZLE=32, DQ_ACCUM="separate",
             DQ_TRANSPOSED=True),
        dict(BLOCK_N=64, BLOCK_M=80, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DQ_TRANSPOSED=True),
        # STEP_ORDER "dv_dq_dk" (FlashAttention-4's order): the d128 winners' 64-row step and
        # the 80-row transposed one at two stages (p31, p32), the dQ warp with two buffers and
        # lse read early (p33), one warpgroup with red.global dQ (p34), separate parts (p35).
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk"),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DQ_TRANSPOSED=True,
             STEP_ORDER="dv_dq_dk"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2, ROWS_EARLY=True,
             STEP_ORDER="dv_dq_dk"),
        dict(BLOCK_N=64, BLOCK_M=128, STAGES=2, SWIZZLE=32, DQ_ACCUM="atomic", DQ_REDUCE="red",
             LOADER="tma", STEP_ORDER="dv_dq_dk"),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=3, SWIZZLE=64, DQ_ACCUM="separate", LOADER="tma",
             STEP_ORDER="dv_dq_dk"),
        # GROUP_SPLIT: a group's query heads dealt to 2, 4 or 8 blocks, their fp32 shares of
        # dK and dV added by attn_bwd_kv_post (shapes with groups of 1, 2, 4 and 6: splits with
        # one head, several, and none): the d128 winner's tile with two splits (p36), the dQ
        # warp with four (p37), one warpgroup on the cp.async ring with eight and the
        # deterministic parts (p38), dQ^T with four (p39).
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk",
             GROUP_SPLIT=2),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=1, GROUP_SPLIT=4),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=2, SWIZZLE=64, DQ_ACCUM="separate", GROUP_SPLIT=8),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DQ_TRANSPOSED=True,
             GROUP_SPLIT=4),
        # DS_BUFFERS 2: dS double-buffered, no barrier atop a step: FA4's d64 tile
        # (128 x 128, two stages, the dQ warp, dv_dq_dk; p40), the d128 64-row step with two
        # dQ buffers (p41), deterministic parts on the TMA ring in the legacy order (p42), dQ^T
        # at 80 rows with a group split (p43).
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             STEP_ORDER="dv_dq_dk", DS_BUFFERS=2),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2,
             DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk", DS_BUFFERS=2),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=64, DQ_ACCUM="separate", LOADER="tma",
             DS_BUFFERS=2),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             DQ_TRANSPOSED=True, GROUP_SPLIT=4, DS_BUFFERS=2),
        # DS_STORE "first": dS stored before dV is issued: the d64 winner (p44),
        # FA4's d64 structure with two dS buffers (p45), the d128 GQA winner with a group split
        # (p46), dQ^T at 80 rows with the dQ warp (p47).
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DS_STORE="first"),
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             STEP_ORDER="dv_dq_dk", DS_BUFFERS=2, DS_STORE="first"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk",
             GROUP_SPLIT=2, DS_STORE="first"),
        dict(BLOCK_N=128, BLOCK_M=80, STAGES=1, SWIZZLE=64, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             DQ_TRANSPOSED=True, DS_STORE="first"),
        # MAIN_LAUNCH "programmatic": the main kernel a programmatic dependent of
        # the pre kernel, each thread waiting before it touches what that kernel writes: the
        # d64 winner (p48: the producer's ring, the consumers' bulk dQ), the d128 dQ-warp point
        # with a group split (p49: the dQ warp's reduction), the cp.async ring with red.global
        # dQ (p50: the consumers' own lse and delta loads, atomics into dQacc).
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", MAIN_LAUNCH="programmatic"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_BUFFERS=2,
             DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk", DS_BUFFERS=2, GROUP_SPLIT=2,
             MAIN_LAUNCH="programmatic"),
        dict(BLOCK_N=64, BLOCK_M=64, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic",
             MAIN_LAUNCH="programmatic"),
        # KV_LOAD "producer": K and V by the TMA producer on barriers of their own:
        # FA4's d64 structure (p51), the d128 GQA winner with a split (p52), one consumer
        # warpgroup with dQ^T at 80 rows and the programmatic launch (p53: K and V issued before
        # the producer waits for the pre kernel).
        dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_WRITER="warp", DQ_LAYOUT="fragment",
             STEP_ORDER="dv_dq_dk", DS_BUFFERS=2, DS_STORE="first", KV_LOAD="producer"),
        dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", STEP_ORDER="dv_dq_dk",
             GROUP_SPLIT=2, KV_LOAD="producer"),
        dict(BLOCK_N=64, BLOCK_M=80, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic",
             DQ_REDUCE="bulk", LOADER="tma", DQ_LAYOUT="fragment", DQ_TRANSPOSED=True,
             MAIN_LAUNCH="programmatic", KV_LOAD="producer"),
    ],
}
# The STEP_ORDER points above and a head dim each admits them at: each is run next to its twin
# in the legacy order.
STEP_ORDER_POINTS = ((31, 128), (32, 128), (33, 64), (34, 64), (35, 64), (35, 128))
FAMILIES = tuple(POINTS)
PROBLEMS = [dict(HEAD_DIM=d, DTYPE=t, CAUSAL=c) for d in (64, 128) for t in ("fp16", "bf16")
            for c in (False, True)]
# (batch, heads, kv_heads, seq_q, seq_k, layout)
SHAPES = [
    (1, 2, 2, 509, 509, "bhsd"),    # tails in every tile size
    (1, 3, 3, 7, 7, "bhsd"),        # shorter than one tile
    (2, 8, 2, 200, 333, "bshd"),    # GQA 8/2, Sq < Sk, strided views of [B, S, H, D]
    (1, 6, 1, 300, 129, "bhsd"),    # MQA, Sq > Sk: causal rows with no key
    (1, 2, 2, 1, 515, "bhsd"),      # one query
    (1, 2, 1, 77, 1, "bshd"),       # one key
    (1, 4, 2, 1000, 1100, "bhsd"),  # many query and key blocks: the ring wraps
]
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

def _problem(d: int, t: str, c: bool) -> dict:
    return dict(HEAD_DIM=d, DTYPE=t, CAUSAL=c)


# (family, point index, problem): every mma_bwd point on every problem; wgmma_bwd's first
# point on every problem and the others on a few each (the test's time), so that each head
# dim, dtype and mask meets one and two warpgroups and both dQ paths.
CASES = [("mma_bwd", i, pr) for i in range(len(POINTS["mma_bwd"])) for pr in PROBLEMS] + [
    *(("wgmma_bwd", 0, pr) for pr in PROBLEMS),
    ("wgmma_bwd", 1, _problem(128, "fp16", True)), ("wgmma_bwd", 1, _problem(128, "bf16", False)),
    ("wgmma_bwd", 1, _problem(64, "bf16", False)), ("wgmma_bwd", 1, _problem(64, "fp16", True)),
    ("wgmma_bwd", 2, _problem(64, "bf16", True)), ("wgmma_bwd", 2, _problem(64, "fp16", False)),
    ("wgmma_bwd", 3, _problem(64, "fp16", True)), ("wgmma_bwd", 3, _problem(64, "bf16", False)),
    *(("wgmma_bwd", 4, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 8, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    ("wgmma_bwd", 5, _problem(64, "fp16", True)), ("wgmma_bwd", 5, _problem(64, "bf16", False)),
    ("wgmma_bwd", 6, _problem(64, "bf16", True)), ("wgmma_bwd", 6, _problem(64, "fp16", False)),
    ("wgmma_bwd", 7, _problem(128, "fp16", True)), ("wgmma_bwd", 7, _problem(64, "bf16", False)),
    *(("wgmma_bwd", 9, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 10, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    ("wgmma_bwd", 11, _problem(128, "bf16", True)), ("wgmma_bwd", 11, _problem(64, "fp16", False)),
    ("wgmma_bwd", 12, _problem(128, "fp16", False)), ("wgmma_bwd", 12, _problem(64, "bf16", True)),
    ("wgmma_bwd", 13, _problem(64, "bf16", True)), ("wgmma_bwd", 13, _problem(64, "fp16", False)),
    *(("wgmma_bwd", 14, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 15, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    ("wgmma_bwd", 16, _problem(128, "bf16", True)), ("wgmma_bwd", 16, _problem(64, "fp16", False)),
    ("wgmma_bwd", 17, _problem(128, "fp16", True)), ("wgmma_bwd", 17, _problem(128, "bf16", False)),
    ("wgmma_bwd", 18, _problem(64, "bf16", True)), ("wgmma_bwd", 18, _problem(64, "fp16", False)),
    *(("wgmma_bwd", 19, pr) for pr in PROBLEMS),
    *(("wgmma_bwd", 20, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    ("wgmma_bwd", 21, _problem(128, "bf16", True)), ("wgmma_bwd", 21, _problem(64, "fp16", False)),
    *(("wgmma_bwd", 22, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 23, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 24, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 25, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 26, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    ("wgmma_bwd", 27, _problem(128, "bf16", False)), ("wgmma_bwd", 27, _problem(128, "fp16", True)),
    ("wgmma_bwd", 28, _problem(128, "fp16", False)), ("wgmma_bwd", 28, _problem(128, "bf16", True)),
    *(("wgmma_bwd", 29, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 30, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 31, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 32, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 33, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 34, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    ("wgmma_bwd", 35, _problem(64, "fp16", True)), ("wgmma_bwd", 35, _problem(128, "bf16", False)),
    *(("wgmma_bwd", 36, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 37, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 38, pr) for pr in PROBLEMS),
    ("wgmma_bwd", 39, _problem(128, "fp16", True)), ("wgmma_bwd", 39, _problem(128, "bf16", False)),
    *(("wgmma_bwd", 40, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 41, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 42, pr) for pr in PROBLEMS),
    ("wgmma_bwd", 43, _problem(128, "bf16", True)), ("wgmma_bwd", 43, _problem(128, "fp16", False)),
    *(("wgmma_bwd", 44, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 45, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 46, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    ("wgmma_bwd", 47, _problem(128, "bf16", True)), ("wgmma_bwd", 47, _problem(128, "fp16", False)),
    *(("wgmma_bwd", 48, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 49, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 50, pr) for pr in PROBLEMS),
    *(("wgmma_bwd", 51, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
    *(("wgmma_bwd", 52, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 128),
    *(("wgmma_bwd", 53, pr) for pr in PROBLEMS if pr["HEAD_DIM"] == 64),
]

_kernels: dict[str, BackwardKernel] = {}


@functools.cache
def space(family: str) -> SearchSpace:
    """The shipped space, with its [untested] values admitted: this file is what they must
    pass on a GPU before they move into [parameters]."""
    return SearchSpace.load(paths.SPACES / f"{family}.toml").with_untested()


def skip_unless_targeted(family: str) -> None:
    if not space(family).supports(gpu_arch()):
        pytest.skip(f"{family} does not target {gpu_arch().name}")


def admitted(family: str, point: dict, problem: dict) -> bool:
    """Whether the space admits the point on this GPU (every case on sm_90a; elsewhere the
    kernel's own shared memory decides, and wgmma_bwd targets only sm_90a)."""
    arch = gpu_arch()
    return space(family).supports(arch) and not space(family).violations(
        space(family).complete(point), problem, arch)


def build(cands: list[Candidate]) -> list[BackwardKernel]:
    """Compile what is missing in parallel, then load; cached across tests."""
    arch = gpu_arch()
    todo = [c for c in cands if c.identity not in _kernels]
    for c, result in zip(todo, compile_many(todo, arch), strict=True):
        assert result.ok, f"{c.identity}: {result.error}"
        assert not result.spill_bytes, f"{c.identity} spills {result.spill_bytes} bytes"
        kernel = BackwardKernel(c, result)
        kernel.load(torch.cuda.current_device())
        _kernels[c.identity] = kernel
    return [_kernels[c.identity] for c in cands]


def kernel_for(family: str, point: dict, problem: dict) -> BackwardKernel:
    (kernel,) = build([make_candidate(space(family), space(family).complete(point), problem,
                                      gpu_arch())])
    return kernel


@pytest.fixture(scope="module", autouse=True)
def prebuild() -> None:
    if not any(space(f).supports(gpu_arch()) for f in FAMILIES):
        pytest.skip(f"no backward family targets {gpu_arch().name}")
    build([make_candidate(space(f), space(f).complete(POINTS[f][i]), pr, gpu_arch())
           for f, i, pr in CASES
           if admitted(f, POINTS[f][i], pr)])


def run_check(kernel: BackwardKernel, shape: tuple, scale: float | None = None,
              **launch: object) -> validate.Verdict:
    b, h, hkv, sq, sk, layout = shape
    fn = functools.partial(kernel, **launch) if launch else kernel
    return validate.check_backward(
        fn, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=sk, head_dim=kernel.head_dim,
        causal=kernel.causal, dtype=TORCH_DTYPE[kernel.dtype], scale=scale, layout=layout)


def case_id(case: tuple[str, int, dict]) -> str:
    f, i, p = case
    return "{}-p{}-d{HEAD_DIM}-{DTYPE}-{CAUSAL}".format(f, i, **p)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case: tuple[str, int, dict], shape: tuple) -> None:
    family, i, problem = case
    skip_unless_targeted(family)
    if not admitted(family, POINTS[family][i], problem):
        pytest.skip("not admitted here (registers or shared memory)")
    kernel = kernel_for(family, POINTS[family][i], problem)
    verdict = run_check(kernel, shape)
    assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


@pytest.mark.parametrize("head_dim", [32, 80, 96])
@pytest.mark.parametrize("family", FAMILIES)
def test_other_head_dims(family: str, head_dim: int) -> None:
    """Head dims other than 64 and 128: admitted points that compile without spills (mma_bwd's
    register model is drawn at 64 and 128: some of its d96 points spill), of each loader
    (wgmma_bwd at 80 and 96 copies K, V, Q and dO by chunk index, 10 and 12 chunks a row),
    causal or not, on tails and GQA with strided views."""
    skip_unless_targeted(family)
    for causal in (False, True):
        problem = _problem(head_dim, "bf16", causal)
        points = space(family).admitted(problem, gpu_arch())
        assert points, problem
        random.Random(head_dim).shuffle(points)
        cands = [make_candidate(space(family), p, problem, gpu_arch()) for p in points[:12]]
        clean = [c.params for c, r in zip(cands, compile_many(cands, gpu_arch()), strict=True)
                 if r.ok and not r.spill_bytes]
        picked = ([next(p for p in clean if p["LOADER"] == loader)
                   for loader in ("tma", "cp_async")
                   if any(p["LOADER"] == loader for p in clean)]
                  if family == "wgmma_bwd" else clean[:2])
        assert picked, problem
        for point in picked:
            kernel = kernel_for(family, point, problem)
            for shape in ((1, 2, 2, 509, 509, "bhsd"), (2, 8, 2, 200, 333, "bshd")):
                verdict = run_check(kernel, shape)
                assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_scale(family: str, causal: bool) -> None:
    skip_unless_targeted(family)
    kernel = kernel_for(family, POINTS[family][0], _problem(64, "fp16", causal))
    for scale in (0.02, 0.5, -0.1, 0.0):
        verdict = run_check(kernel, (1, 4, 2, 130, 97, "bshd"), scale=scale)
        assert verdict.ok, f"scale {scale}: {verdict.reason}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_launch_of_an_atomic_kernel_passes(family: str, dtype: str) -> None:
    skip_unless_targeted(family)
    problem = _problem(128, dtype, True)
    points = [p for p in POINTS[family] if p["DQ_ACCUM"] == "atomic"
              and admitted(family, p, problem)]
    for point in points:  # each way an atomic kernel reduces dQ, where it has several
        kernel = kernel_for(family, point, problem)
        for shape in ((2, 8, 2, 200, 333, "bshd"), (1, 6, 1, 300, 129, "bhsd")):
            verdict = run_check(kernel, shape, deterministic=True)
            assert verdict.ok, f"{kernel.candidate.identity} {shape}: {verdict.reason}"


def inputs(shape: tuple, dtype: torch.dtype, causal: bool, seed: int = 0,
           head_dim: int = 64) -> tuple:
    b, h, hkv, sq, sk, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads: int, seq: int) -> torch.Tensor:
        return torch.randn((b, heads, seq, head_dim), generator=gen, device="cuda").to(dtype)

    q, k, v, dout = make(h, sq), make(hkv, sk), make(hkv, sk), make(h, sq)
    out, lse = validate.reference(q, k, v, causal=causal)
    return q, k, v, out.to(dtype), lse.float().contiguous(), dout


@pytest.mark.parametrize(("family", "point", "deterministic"), [
    ("mma_bwd", 0, True), ("mma_bwd", 2, True), ("mma_bwd", 3, False),
    ("wgmma_bwd", 0, True), ("wgmma_bwd", 2, False), ("wgmma_bwd", 5, True),
    ("wgmma_bwd", 6, False), ("wgmma_bwd", 10, True), ("wgmma_bwd", 11, False),
    ("wgmma_bwd", 12, True), ("wgmma_bwd", 15, True), ("wgmma_bwd", 16, True),
    ("wgmma_bwd", 21, False), ("wgmma_bwd", 25, True), ("wgmma_bwd", 24, True),
    ("wgmma_bwd", 29, False), ("wgmma_bwd", 30, True), ("wgmma_bwd", 38, False),
    ("wgmma_bwd", 38, True)])
def test_deterministic_results_are_bit_identical(family: str, point: int,
                                                 deterministic: bool) -> None:
    skip_unless_targeted(family)
    kernel = kernel_for(family, POINTS[family][point], _problem(64, "bf16", True))
    args = inputs((2, 8, 2, 1000, 1100, "bhsd"), torch.bfloat16, causal=True)
    first = kernel(*args, causal=True, deterministic=deterministic)
    first = tuple(g.clone() for g in first)
    for _ in range(3):
        again = kernel(*args, causal=True, deterministic=deterministic)
        for name, a, b in zip(validate.GRAD_NAMES, first, again, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("point", "head_dim"), STEP_ORDER_POINTS)
def test_step_order_is_its_twin(point: int, head_dim: int, causal: bool) -> None:
    """STEP_ORDER "dv_dq_dk" runs each GEMM's arithmetic as the legacy order does: a
    deterministic launch (dQ by parts, summed in key order) gives the twin's bits in all three
    gradients, and an atomic one its bits in dK and dV, over calls back to back (a stage
    handed back too early, or dS rewritten under a dQ GEMM, would differ somewhere)."""
    skip_unless_targeted("wgmma_bwd")
    problem = _problem(head_dim, "bf16", causal)
    params = POINTS["wgmma_bwd"][point]
    if not admitted("wgmma_bwd", params, problem):
        pytest.skip("not admitted here")
    kernel = kernel_for("wgmma_bwd", params, problem)
    twin = kernel_for("wgmma_bwd", {**params, "STEP_ORDER": "dv_dk_dq"}, problem)
    args = inputs((2, 8, 2, 1000, 1100, "bhsd"), torch.bfloat16, causal=causal, seed=point,
                  head_dim=head_dim)
    for deterministic in (True, False):
        want = tuple(g.clone() for g in twin(*args, causal=causal, deterministic=deterministic))
        for _ in range(3):
            got = kernel(*args, causal=causal, deterministic=deterministic)
            for name, a, b in zip(validate.GRAD_NAMES, got, want, strict=True):
                if deterministic or name != "dq":
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_of_the_forward_kernels_own_output(family: str) -> None:
    """The backward takes the forward mma kernel's out and log-sum-exp as they are written
    (natural log, -inf on rows that see no key), and its gradients pass the criterion."""
    skip_unless_targeted(family)
    fwd_space = SearchSpace.load(paths.SPACES / "mma.toml")
    problem = _problem(64, "fp16", True)
    fwd = Kernel.build(make_candidate(fwd_space, dict(
        BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
        LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="joint"), problem, gpu_arch()), gpu_arch())
    bwd = kernel_for(family, POINTS[family][0], problem)
    q, k, v, _, _, dout = inputs((1, 6, 2, 300, 129, "bhsd"), torch.float16, causal=True)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    out = fwd(q, k, v, lse=lse)
    assert bool(torch.isneginf(lse[0, 0, :171]).all())  # rows that see no key
    grads = bwd(q, k, v, out, lse, dout, causal=True)
    torch.cuda.synchronize()
    refs = validate.reference_grads(q, k, v, dout, causal=True)
    baselines = validate.sdpa_grads(q, k, v, dout, causal=True)
    verdict = validate.judge_grads(grads, refs, baselines,
                                   no_key_rows=torch.isneginf(lse[0, 0].double()))
    assert verdict.ok, verdict.reason


@pytest.mark.parametrize("point", [9, 11, 12, 14])
def test_tma_loader_reads_an_expanded_output_gradient(point: int) -> None:
    """Autograd's gradient of a sum is expanded (stride 0), which no tensor map describes: the
    TMA launch maps a contiguous copy of it (the cp.async kernels read it as it is)."""
    skip_unless_targeted("wgmma_bwd")
    d = 128 if point in (9, 14) else 64
    kernel = kernel_for("wgmma_bwd", POINTS["wgmma_bwd"][point], _problem(d, "bf16", True))
    gen = torch.Generator(device="cuda").manual_seed(point)
    q, k, v = (torch.randn((2, 4 if i == 0 else 2, 300 if i == 0 else 333, d), generator=gen,
                           device="cuda").to(torch.bfloat16) for i in range(3))
    out, lse = validate.reference(q, k, v, causal=True)
    out, lse = out.to(torch.bfloat16), lse.float().contiguous()
    dout = torch.randn((d,), generator=gen, device="cuda").to(torch.bfloat16).expand_as(q)
    assert dout.stride()[:3] == (0, 0, 0)
    grads = kernel(q, k, v, out, lse, dout, causal=True)
    torch.cuda.synchronize()
    verdict = validate.judge_grads(grads, validate.reference_grads(q, k, v, dout, causal=True),
                                   validate.sdpa_grads(q, k, v, dout, causal=True))
    assert verdict.ok, verdict.reason


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("family", "point"), [("mma_bwd", 0), ("wgmma_bwd", 0),
                                               ("wgmma_bwd", 5), ("wgmma_bwd", 12),
                                               ("wgmma_bwd", 15), ("wgmma_bwd", 30)])
def test_a_zero_output_gradient_gives_exactly_zero(family: str, point: int,
                                                  deterministic: bool) -> None:
    """Nothing but the products of the inputs reaches the outputs: no workspace left
    unzeroed, no part of dQ summed that no key block stored (wgmma_bwd's p5: the bulk
    reduction of staged dQ; p15: by the dQ warp)."""
    skip_unless_targeted(family)
    kernel = kernel_for(family, POINTS[family][point], _problem(64, "fp16", True))
    q, k, v, out, lse, dout = inputs((1, 2, 2, 333, 300, "bhsd"), torch.float16, causal=True)
    grads = kernel(q, k, v, out, lse, torch.zeros_like(dout), causal=True,
                   deterministic=deterministic)
    for name, g in zip(validate.GRAD_NAMES, grads, strict=True):
        assert bool((g == 0).all()), name
