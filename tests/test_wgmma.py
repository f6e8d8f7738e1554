"""Offline checks of the wgmma family: its search space, its rendered source, its compiled code
(HGMMA and TMA in the SASS, no local memory) and the launcher's tensor-map geometry and grid.

No GPU is needed; the SASS checks run where ``cuobjdump`` is found and skip elsewhere.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from evoengine import paths
from evoengine.arch import Arch, get_arch
from evoengine.compile import (
    CompileResult,
    compile_candidate,
    compile_many,
    compile_source,
    cuobjdump_path,
)
from evoengine.launch import (
    CudaKernel,
    NoKernelError,
    TmaParams,
    kernel_from_spec,
    sha256,
    tma_geometry,
    tma_grid,
    tma_params,
)
from evoengine.launch import forward as launch_forward
from evoengine.launch import tma as launch_tma
from evoengine.render import Candidate, make_candidate, render
from evoengine.space import SearchSpace, default_spaces, spread

SM90 = get_arch("sm_90a")
BASE = dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs",
            INTRA_WG_OVERLAP=True, PINGPONG=False, PERSISTENT=False, TILE_ORDER="head",
            SCHEDULER="static", PACK_GQA=False, P_BARRIER="warpgroup", O_STAGE="own_or_q",
            O_STORE="threads")
HD64 = {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}
HD128 = {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}
SPREAD = 16  # compiled points: two per default problem


def space() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "wgmma.toml")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("EVOENGINE_CACHE", str(root))
    return root


# ---- the SASS ---------------------------------------------------------------------------------


CUOBJDUMP = cuobjdump_path()
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def sass_opcodes(cubin: bytes) -> list[str]:
    """Each instruction's base opcode (HGMMA, UTMALDG, LDL, ...), in program order."""
    assert CUOBJDUMP is not None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True,
                              check=True)
    return _OPCODE.findall(done.stdout)


def check_compiled(c: Candidate, r: CompileResult) -> None:
    """Compiled, no spill or stack, no serialised wgmma; and from the SASS where readable:
    HGMMA issued (at least every k-step of both GEMMs once), TMA loads, mbarrier waits,
    register reallocation, and no local-memory traffic."""
    assert r.ok, f"{c.identity}: {r.error}\n{r.log}"
    assert r.spill_bytes == 0 and r.stack_bytes == 0, (c.identity, r.report())
    assert r.serialized is None, r.log  # ptxas waited after every wgmma (C75xx)
    if CUOBJDUMP is None:
        return
    ops = sass_opcodes(r.cubin or b"")
    head_dim, block_n = int(c.problem["HEAD_DIM"]), int(c.params["BLOCK_N"])  # type: ignore[call-overload]
    assert ops.count("HGMMA") >= head_dim // 16 + block_n // 16, c.identity
    assert "UTMALDG" in ops and "SYNCS" in ops and "USETMAXREG" in ops, c.identity
    assert "LDL" not in ops and "STL" not in ops, c.identity
    assert "HMMA" not in ops, c.identity  # the slower mma.sync path is not used


# ---- the space ------------------------------------------------------------------------------


def test_space_targets_sm90a_only() -> None:
    sp = space()
    assert sp.archs == ("sm_90a",)
    assert list(sp.parameters) == ["BLOCK_M", "BLOCK_N", "STAGES", "SWIZZLE", "P_FROM",
                                   "INTRA_WG_OVERLAP", "PINGPONG", "PERSISTENT", "TILE_ORDER",
                                   "SCHEDULER", "PACK_GQA", "P_BARRIER", "O_STAGE", "O_STORE"]
    for arch in ("sm_80", "sm_86", "sm_89"):
        target = get_arch(arch)
        assert sp.violations(BASE, HD64, target) == [f"family wgmma does not target {arch}"]
        assert all(s.family != "wgmma" for s, _, _ in spread(default_spaces(), target, 40))
        with pytest.raises(ValueError, match="does not target"):
            make_candidate(sp, BASE, HD64, target)


def test_base_point_is_admitted_for_every_problem() -> None:
    sp = space()
    for problem in sp.problems():
        assert sp.violations(BASE, problem, SM90) == []


def test_every_parameter_value_is_reachable() -> None:
    sp = space()
    admitted = [p for problem in sp.problems() for p in sp.admitted(problem, SM90)]
    for name, domain in sp.parameters.items():
        assert {p[name] for p in admitted} == set(domain), name


def test_derived_values_match_hand_computation() -> None:
    env = space().env(BASE, HD128, SM90)
    assert env["CONSUMER_WG"] == 2 and env["THREADS"] == 384 and env["PANEL"] == 64
    # Q 128 x 128, 2 stages of K and V 128 x 128, 10 mbarriers, 1024 bytes of alignment slack.
    assert env["SMEM_BYTES"] == 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 8 * 10 + 1024
    # O and S accumulators plus the previous block's P (held across the overlapped GEMMs).
    assert env["LIVE_REGS"] == 64 + 64 + 32 and env["REG_MARGIN"] == 32
    assert env["CONSUMER_REGS"] == 232
    no_overlap = space().env({**BASE, "INTRA_WG_OVERLAP": False}, HD128, SM90)
    assert no_overlap["LIVE_REGS"] == 64 + 64 and no_overlap["REG_MARGIN"] == 40


def test_persistent_blocks_stage_o_apart_where_it_fits() -> None:
    """A persistent block gets a buffer for O of its own (so Q is handed back early) when the
    shared memory allows; the kernel static_asserts the same size (compiled below)."""
    base = space().env(BASE, HD128, SM90)["SMEM_BYTES"]
    persistent = space().env({**BASE, "PERSISTENT": True}, HD128, SM90)
    assert persistent["O_BYTES"] == 128 * 128 * 2
    assert persistent["SMEM_BYTES"] == base + 128 * 128 * 2
    # 3 stages of 128 x 128 K and V leave no room: O goes where Q was, as without persistence.
    full = space().env({**BASE, "PERSISTENT": True, "STAGES": 3}, HD128, SM90)
    assert full["O_BYTES"] == 0 and full["SMEM_BYTES"] <= SM90.smem_per_block
    for override in (dict(PERSISTENT=True, PINGPONG=True), dict(PERSISTENT=True, STAGES=3)):
        c = make_candidate(space(), {**BASE, **override}, HD128, SM90)
        check_compiled(c, compile_source(render(c), SM90, c.defines(SM90), identity=c.identity,
                                         smem_bytes=c.smem_bytes))


@pytest.mark.parametrize(("problem", "extra"), [
    (HD64, {"STAGES": 3}), (HD64, {"P_FROM": "smem"}),
    ({**HD128, "CAUSAL": False}, {"P_FROM": "smem"})])
def test_dynamic_scheduler_serves_full_tiles(problem: dict, extra: dict) -> None:
    """SCHEDULER "dynamic" without the mask (persistent only): admitted and built at the d64
    and d128 winners' 192-row tiles, no spill, rendered dynamic."""
    sp = space()
    point = {**BASE, "BLOCK_M": 192, "PINGPONG": True, "PERSISTENT": True,
             "SCHEDULER": "dynamic", **extra}
    assert not sp.violations(point, problem, SM90)
    assert any("PERSISTENT" in v for v in sp.violations({**point, "PERSISTENT": False},
                                                        problem, SM90))
    c = make_candidate(sp, point, problem, SM90)
    assert "constexpr bool DYNAMIC = true;" in render(c)
    r = compile_source(render(c), SM90, c.defines(SM90), identity=c.identity,
                       smem_bytes=c.smem_bytes)
    check_compiled(c, r)


@pytest.mark.parametrize("causal", [False, True])
def test_p_barrier_and_o_stage_build_at_the_d128_winners_tile(causal: bool) -> None:
    """P_BARRIER "turn" and O_STAGE "p" at the 192 x 128 tile with P through shared memory
    (the d128 winners', persistent for O_STAGE): no spill, and the turn drops the warpgroup's
    barrier after each write of P (one BAR.SYNC fewer in the SASS per write)."""
    sp = space().with_untested()
    problem = {**HD128, "CAUSAL": causal}
    point = {**BASE, "BLOCK_M": 192, "P_FROM": "smem", "PINGPONG": True, "PERSISTENT": True}
    built = {}
    for name, extra in (("legacy", {}), ("turn", {"P_BARRIER": "turn"}),
                        ("p", {"O_STAGE": "p"}), ("both", {"P_BARRIER": "turn", "O_STAGE": "p"})):
        c = make_candidate(sp, {**point, **extra}, problem, SM90)
        r = compile_source(render(c), SM90, c.defines(SM90), identity=c.identity,
                           smem_bytes=c.smem_bytes)
        check_compiled(c, r)
        built[name] = r
    assert space().env({**point}, problem, SM90)["O_BYTES"] == 0  # no room of its own for O
    if CUOBJDUMP is not None:
        bars = {k: sass_opcodes(r.cubin or b"").count("BAR") for k, r in built.items()}
        assert bars["turn"] < bars["legacy"] and bars["both"] < bars["p"], bars


@pytest.mark.parametrize("tile", ["d64", "d128-p", "d128-q"])
def test_o_store_tma_builds_at_the_winners_tiles(tile: str) -> None:
    """O_STORE "tma" at the 11-27 winners' tiles: d64 (P in registers, O in a buffer of its
    own), d128 with O in the P tile, and d128 not persistent (O in Q's tile): no spill, and the
    SASS stores O by TMA (one UTMASTG per swizzle panel); a ragged build of the same point keeps
    the lanes' stores (no UTMASTG, no tm_o argument)."""
    sp = space()
    point = {**BASE, "BLOCK_M": 192, "PINGPONG": True, "PERSISTENT": True,
             "SCHEDULER": "dynamic", "O_STORE": "tma"}
    problem = {**HD64, "DTYPE": "bf16"}
    if tile != "d64":
        problem = {**HD128, "CAUSAL": False}
        point.update(P_FROM="smem", P_BARRIER="turn", O_STAGE="p")
    if tile == "d128-q":
        point.update(PERSISTENT=False, SCHEDULER="static", O_STAGE="own_or_q")
    for extra in ({}, {"VARLEN": True}):
        c = make_candidate(sp, point, {**problem, **extra}, SM90)
        source = render(c)
        assert ("TmaMap tm_o" in source) == (not extra), c.identity
        r = compile_source(source, SM90, c.defines(SM90), identity=c.identity,
                           smem_bytes=c.smem_bytes)
        check_compiled(c, r)
        if CUOBJDUMP is not None:
            ops = sass_opcodes(r.cubin or b"")
            panels = int(problem["HEAD_DIM"]) * 2 // 128
            assert ops.count("UTMASTG") == (0 if extra else panels), c.identity


def test_dynamic_scheduler_adds_its_tile_slot() -> None:
    """The slot naming each tile to the consumers: 16 bytes next to the mbarriers, only when
    dynamic; the kernel static_asserts the same size (compiled below)."""
    static = space().env({**BASE, "PERSISTENT": True}, HD128, SM90)
    dynamic = space().env({**BASE, "PERSISTENT": True, "SCHEDULER": "dynamic"}, HD128, SM90)
    assert static["TILE_SLOT_BYTES"] == 0 and dynamic["TILE_SLOT_BYTES"] == 16
    assert dynamic["SMEM_BYTES"] == static["SMEM_BYTES"] + 16


# (rule text, parameter override, problem, target, extra domain values)
_FEW_THREADS = dataclasses.replace(SM90, max_threads=256)
CONSTRAINT_CASES = [
    ("HEAD_DIM % 16 == 0 and 16 <= HEAD_DIM <= 256", dict(SWIZZLE=32, BLOCK_N=64),
     {**HD64, "HEAD_DIM": 272}, SM90, {}),
    ("HEAD_DIM % PANEL == 0", {}, {**HD64, "HEAD_DIM": 96}, SM90, {}),
    ("BLOCK_N % 16 == 0", {"BLOCK_N": 72}, HD64, SM90, {"BLOCK_N": 72}),
    ("P_FROM == 'regs' or BLOCK_N % PANEL == 0", dict(BLOCK_N=96, P_FROM="smem"), HD64, SM90,
     {}),
    ("not PINGPONG or CONSUMER_WG >= 2", dict(PINGPONG=True, BLOCK_M=64), HD64, SM90, {}),
    ("THREADS <= MAX_THREADS", {}, HD64, _FEW_THREADS, {}),
    ("SMEM_BYTES <= SMEM_LIMIT", dict(BLOCK_N=192, STAGES=4, P_FROM="smem"), HD128, SM90, {}),
    ("LIVE_REGS + REG_MARGIN <= CONSUMER_REGS", {"BLOCK_M": 192}, HD128, SM90, {}),
    ("BLOCK_N * HEAD_DIM * 2 % 1024 == 0", dict(BLOCK_N=176, SWIZZLE=32),
     {**HD64, "HEAD_DIM": 48}, SM90, {}),
    ("CAUSAL or TILE_ORDER == 'head'", {"TILE_ORDER": "l2"}, HD64, SM90, {}),
    ("SCHEDULER == 'static' or PERSISTENT", {"SCHEDULER": "dynamic"}, HD128, SM90, {}),
    ("P_BARRIER == 'warpgroup' or (P_FROM == 'smem' and PINGPONG)", {"P_BARRIER": "turn"}, HD64,
     SM90, {"P_BARRIER": "turn"}),
    ("O_STAGE == 'own_or_q' or (PERSISTENT and P_FROM == 'smem' and BLOCK_N >= HEAD_DIM and "
     "O_BYTES == 0)", {"O_STAGE": "p"}, HD64, SM90, {"O_STAGE": "p"}),
    ("O_STORE == 'threads' or not PACK_GQA", {"O_STORE": "tma", "PACK_GQA": True}, HD64, SM90,
     {"O_STORE": "tma"}),
]


@pytest.mark.parametrize(("rule", "override", "problem", "arch", "extra"), CONSTRAINT_CASES,
                         ids=[c[0] for c in CONSTRAINT_CASES])
def test_each_constraint_fires_alone(rule: str, override: dict, problem: dict, arch: Arch,
                                     extra: dict) -> None:
    sp = space()
    if extra:
        params = {k: (*v, *([extra[k]] if k in extra else [])) for k, v in sp.parameters.items()}
        sp = dataclasses.replace(sp, parameters=params)
    (c,) = [c for c in sp.constraints if c.rule.text == rule]
    assert sp.violations({**BASE, **override}, problem, arch) == [f"{c.why} ({rule})"]


def test_constraint_cases_cover_every_constraint() -> None:
    assert {c[0] for c in CONSTRAINT_CASES} == {c.rule.text for c in space().constraints}


# ---- the rendered source ----------------------------------------------------------------------


def test_rendered_source_declares_the_point() -> None:
    c = make_candidate(space(), BASE, HD64, SM90)
    src = render(c)
    for line in (
        f"// evoengine candidate {c.identity}",
        "constexpr int HEAD_DIM = 64;",
        "constexpr bool IS_BF16 = false;",
        "constexpr int BLOCK_M = 128;",
        "constexpr int BLOCK_N = 128;",
        "constexpr int STAGES = 2;",
        "constexpr int SWIZZLE = 128;",
        "constexpr bool P_IN_SMEM = false;",
        "constexpr bool INTRA_WG_OVERLAP = true;",
        "constexpr bool PINGPONG = false;",
        "constexpr bool PERSISTENT = false;",
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {",  # S: N = BLOCK_N
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {",  # O: N = HEAD_DIM
        '"%0, %1, %2, %3, ',  # every accumulator register named
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "setmaxnreg.inc.sync.aligned.u32",
        "const __grid_constant__ TmaMap tm_q",
    ):
        assert line in src, line
    for marker in ("{{", "}}", "/*%", "%*/", "/*#"):
        assert marker not in src, marker


def test_one_wrapper_when_block_n_equals_head_dim() -> None:
    src = render(make_candidate(space(), {**BASE, "BLOCK_N": 64}, {**HD64, "DTYPE": "bf16"},
                                SM90))
    assert src.count("struct mma_async<64> {") == 1
    # k16.f32.f16.f16: an fp16 wgmma (common/primitives.cuh's mma.sync is k16.row.col...).
    assert "m64n64k16.f32.bf16.bf16" in src and "k16.f32.f16.f16" not in src


# ---- compiled code ----------------------------------------------------------------------------


def test_spread_compiles_with_hgmma_and_no_local_memory() -> None:
    points = spread([space()], SM90, SPREAD, seed=0)
    assert len({tuple(problem.values()) for _, problem, _ in points}) == 8  # every problem
    cands = [make_candidate(sp, params, problem, SM90) for sp, problem, params in points]
    for c, r in zip(cands, compile_many(cands, SM90, workers=2), strict=True):
        check_compiled(c, r)


@pytest.mark.parametrize("override", [
    {},  # FlashAttention-3's d128 shape: 2 consumers, 128 x 128, P in registers, overlap
    dict(BLOCK_M=192, BLOCK_N=64, SWIZZLE=32, P_FROM="smem", PERSISTENT=True),
    dict(BLOCK_M=64, BLOCK_N=176, INTRA_WG_OVERLAP=False),
    dict(SWIZZLE=64, PINGPONG=True, P_FROM="smem", BLOCK_N=64),
])
def test_feature_points_compile_clean(override: dict) -> None:
    for problem in (HD64, HD128):
        c = make_candidate(space(), {**BASE, **override}, problem, SM90)
        check_compiled(c, compile_source(render(c), SM90, c.defines(SM90), identity=c.identity,
                                         smem_bytes=c.smem_bytes))


@pytest.mark.parametrize("override", [
    dict(TILE_ORDER="l2", SCHEDULER="static"),  # L2 sections, non-persistent
    dict(TILE_ORDER="l2", PERSISTENT=True, PINGPONG=True, BLOCK_N=64),
    dict(PERSISTENT=True, BLOCK_M=192, BLOCK_N=64, INTRA_WG_OVERLAP=False, PINGPONG=True),
])
def test_causal_orders_and_skips_compile_clean(override: dict) -> None:
    """Causal-only paths: the tile orders, warpgroups that skip blocks with turns kept."""
    for problem in ({**HD64, "CAUSAL": True}, HD128):
        c = make_candidate(space(), {**BASE, **override}, problem, SM90)
        check_compiled(c, compile_source(render(c), SM90, c.defines(SM90), identity=c.identity,
                                         smem_bytes=c.smem_bytes))


DYNAMIC_POINTS = [  # (override of BASE, problem): causal and persistent, as the space demands
    ({}, HD128),
    (dict(BLOCK_M=192, BLOCK_N=64, SWIZZLE=32, TILE_ORDER="l2", PINGPONG=True,
          INTRA_WG_OVERLAP=False), {**HD64, "CAUSAL": True}),
    (dict(BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem", PINGPONG=True), HD128),
    (dict(BLOCK_M=192, BLOCK_N=128, STAGES=4, P_FROM="smem", TILE_ORDER="l2"),
     {**HD64, "DTYPE": "bf16", "CAUSAL": True}),
]


def test_dynamic_scheduler_compiles_clean_with_one_atomic_per_tile() -> None:
    """Dynamic points compile without spill or local memory (the producer runs on 32-56
    registers and now holds the claimed tile); the tile counter's atomic is in the SASS of a
    dynamic kernel and of no static one."""
    cands = []
    for override, problem in DYNAMIC_POINTS:
        for scheduler in ("dynamic", "static"):
            params = {**BASE, "PERSISTENT": True, **override, "SCHEDULER": scheduler}
            cands.append(make_candidate(space(), params, problem, SM90))
    for c, r in zip(cands, compile_many(cands, SM90, workers=2), strict=True):
        check_compiled(c, r)
        if CUOBJDUMP is not None:
            atomics = [op for op in sass_opcodes(r.cubin or b"") if op.startswith(("ATOM", "RED"))]
            assert len(atomics) == (c.params["SCHEDULER"] == "dynamic"), (c.identity, atomics)


def test_dynamic_source_takes_the_counter_last() -> None:
    params = {**BASE, "PERSISTENT": True, "SCHEDULER": "dynamic"}
    src = render(make_candidate(space(), params, HD128, SM90))
    assert "constexpr bool DYNAMIC = true;" in src
    assert "float scale_log2, int* __restrict__ tile_counter) {" in src
    static = render(make_candidate(space(), {**params, "SCHEDULER": "static"}, HD128, SM90))
    assert "constexpr bool DYNAMIC = false;" in static
    assert "float scale_log2, int* __restrict__ tile_counter) {" in static  # one ABI for both


def key_loops(c: Candidate) -> list[dict[str, object]]:
    """The loops of ``c``'s SASS that issue HGMMA, innermost first, with their opcode counts
    (benchmarks/sass_report.py); skips where cuobjdump is missing."""
    if CUOBJDUMP is None:
        pytest.skip("no cuobjdump")
    r = compile_candidate(c, SM90)
    check_compiled(c, r)
    sys.path.insert(0, str(paths.ROOT / "benchmarks"))
    from sass_report import disassemble, tensor_loops

    return [lp for lp in tensor_loops(disassemble(r.cubin or b"")) if lp.get("HGMMA")]


def test_masked_and_unmasked_loops_are_separate() -> None:
    """The key loop is split: the unmasked copy of the block body has no mask selects."""
    loops = key_loops(make_candidate(space(), BASE, HD128, SM90))
    fsel = sorted(int(lp.get("FSEL", 0)) for lp in loops[:2])  # type: ignore[call-overload]
    assert fsel[0] <= 4 and fsel[1] >= 64, loops[:2]


@pytest.mark.parametrize(("override", "problem"), [
    ({}, HD128),
    ({"BLOCK_M": 192, "P_FROM": "smem", "PINGPONG": True}, {**HD128, "CAUSAL": False}),
    ({"BLOCK_M": 192, "STAGES": 3, "PINGPONG": True, "PERSISTENT": True, "TILE_ORDER": "l2",
      "SCHEDULER": "dynamic"}, {**HD64, "CAUSAL": True}),
])
def test_key_loops_keep_wgmma_descriptors_in_uniform_registers(override: dict,
                                                               problem: dict) -> None:
    """Every address a descriptor is built from is warp-uniform to ptxas (the consumer index and
    the dynamic tile index are broadcast from lane 0), so the key loops build descriptors with
    uniform-datapath ops: no R2UR. With them in ordinary registers a d64 block paid 32 R2UR
    and as many 64-bit adds and moves."""
    c = make_candidate(space(), {**BASE, **override}, problem, SM90)
    loops = key_loops(c)
    assert len(loops) >= 2, loops
    for lp in loops[:2]:  # the unmasked and the masked key loop
        assert lp.get("R2UR", 0) == 0, (c.identity, lp)


def test_smem_static_assert_ties_space_to_kernel() -> None:
    c = make_candidate(space(), BASE, HD64, SM90)
    bad = compile_source(render(c), SM90, {**c.defines(SM90), "EVO_SMEM_BYTES": c.smem_bytes + 8})
    assert not bad.ok
    assert "the search space computes the same shared memory" in (bad.error or "")


# ---- host side: tensor maps and the grid ------------------------------------------------------


def test_map_geometry_of_a_contiguous_tensor() -> None:
    g = tma_geometry((2, 8, 100, 128), (8 * 100 * 128, 100 * 128, 128, 1), 2,
                     launch_tma.TMA_Q_ROWS, 128)
    assert g.dims == (128, 100, 8, 2)  # innermost first
    assert g.strides == (256, 100 * 256, 8 * 100 * 256)
    assert g.box == (64, 64, 1, 1) and g.swizzle == 128


def test_map_geometry_of_a_strided_view() -> None:
    # q.transpose(1, 2) of [B, S, H, D] storage: the seq stride spans all heads.
    b, s, h, d = 2, 77, 6, 64
    g = tma_geometry((b, h, s, d), (s * h * d, d, h * d, 1), 2, 96, 32)
    assert g.dims == (64, 77, 6, 2)
    assert g.strides == (h * d * 2, d * 2, s * h * d * 2)
    assert g.box == (16, 96, 1, 1)


def test_map_geometry_gives_size_one_dims_a_legal_stride() -> None:
    g = tma_geometry((1, 1, 5, 64), (0, 0, 64, 1), 2, 64, 128)
    assert g.strides[0] == 128 and all(x > 0 and x % 16 == 0 for x in g.strides)


@pytest.mark.parametrize(("shape", "strides", "swizzle", "message"), [
    ((1, 2, 5, 64), (640, 320, 64, 1), 16, "swizzle must be one of"),
    ((1, 2, 5, 96), (960, 480, 96, 1), 128, "whole number of 64-value panels"),
    ((1, 2, 5, 64), (640, 0, 64, 1), 128, "positive multiples of 16"),
    ((1, 2, 5, 64), (640, 320, 1, 64), 128, "contiguous"),
])
def test_map_geometry_refuses_what_tma_cannot_take(shape: tuple, strides: tuple, swizzle: int,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tma_geometry(shape, strides, 2, 64, swizzle)


def test_tma_grid() -> None:
    assert tma_grid(128, seq_q=1000, heads=16, batch=4, persistent=False, sms=132) == (512, 512)
    assert tma_grid(128, seq_q=1000, heads=16, batch=4, persistent=True, sms=132) == (132, 512)
    assert tma_grid(192, seq_q=100, heads=2, batch=1, persistent=True, sms=132) == (2, 2)
    # PACK_GQA, 4 heads per token: 1000 x 4 rows per block of 4 heads
    assert tma_grid(128, seq_q=1000, heads=16, batch=4, persistent=False, sms=132,
                    pack=4) == (32 * 4 * 4, 32 * 4 * 4)


def test_map_geometry_of_packed_heads() -> None:
    """PACK_GQA's Q: rank 5, (d, heads in a block, seq, head blocks, batch); a box is P heads
    of rows / P tokens, so the 64 rows land head fastest (row = token * P + head)."""
    b, h, s, d = 2, 8, 100, 128
    contiguous = (h * s * d, s * d, d, 1)
    g = tma_geometry((b, h, s, d), contiguous, 2, 64, 128, pack=4)
    assert g.dims == (128, 4, 100, 2, 2)
    assert g.strides == (s * d * 2, d * 2, 4 * s * d * 2, h * s * d * 2)
    assert g.box == (64, 4, 16, 1, 1)
    # a bshd view (heads d apart), and a varlen [1, H, total, D] view of [total, H, D]
    g = tma_geometry((b, h, s, d), (s * h * d, d, h * d, 1), 2, 64, 128, pack=8)
    assert g.dims == (128, 8, 100, 1, 2) and g.box == (64, 8, 8, 1, 1)
    assert g.strides[0] == d * 2 and g.strides[1] == h * d * 2
    with pytest.raises(ValueError, match="must divide"):
        tma_geometry((b, 6, s, d), (6 * s * d, s * d, d, 1), 2, 64, 128, pack=4)


@pytest.mark.parametrize(("group", "heads"), [(1, 1), (2, 2), (3, 1), (8, 8), (12, 4), (32, 32),
                                              (128, 64)])
def test_heads_packed_per_token(group: int, heads: int) -> None:
    """The lowest set bit of the group, at most 64 (a consumer's 64 rows hold whole tokens);
    the kernel's ``pack_log2`` computes the same on the device."""
    packed = TmaParams(128, 128, False, pack=True)
    assert packed.pack_heads(group) == heads
    assert TmaParams(128, 128, False).pack_heads(group) == 1


@pytest.mark.parametrize("problem", [{**HD64, "CAUSAL": True}, HD128,
                                     {**HD128, "VARLEN": True}])
def test_packed_points_spill_no_more_than_unpacked(problem: dict) -> None:
    """PACK_GQA builds, with no local memory, at the tiles of the d64 and
    d128 winners, ragged (VARLEN) too, and spills no more than the same point unpacked (some
    ragged 3-consumer points spill a few bytes in the producer either way)."""
    sp = space().with_untested()
    for override in ({"BLOCK_M": 192, "PINGPONG": True, "PERSISTENT": True},
                     {"BLOCK_M": 192, "P_FROM": "smem", "PINGPONG": True},
                     {"PINGPONG": True, "PERSISTENT": True, "SCHEDULER": "dynamic"}):
        point = {**BASE, **override}
        if sp.violations(point, problem, SM90):
            continue
        built = [compile_candidate(make_candidate(sp, {**point, "PACK_GQA": pk}, problem, SM90),
                                   SM90) for pk in (False, True)]
        assert all(r.ok for r in built), [r.error for r in built]
        unpacked, packed = (r.spill_bytes or 0 for r in built)
        assert packed <= unpacked, (override, problem, unpacked, packed)
        if packed == 0:
            c = make_candidate(sp, {**point, "PACK_GQA": True}, problem, SM90)
            check_compiled(c, built[1])


def test_tma_params_come_from_the_family() -> None:
    c = make_candidate(space(), {**BASE, "PERSISTENT": True, "SWIZZLE": 64, "BLOCK_N": 96},
                       HD64, SM90)
    assert tma_params(c.family, c.params) == TmaParams(swizzle=64, block_n=96, persistent=True,
                                                       dynamic=False)
    assert tma_params("mma", {"BLOCK_N": 64}) is None
    dynamic = make_candidate(space(), {**BASE, "PERSISTENT": True, "SCHEDULER": "dynamic"},
                             HD128, SM90)
    assert tma_params(dynamic.family, dynamic.params) == TmaParams(128, 128, True, True)
    # Specs exported before SCHEDULER existed: static kernels.
    older = {k: v for k, v in dynamic.params.items() if k != "SCHEDULER"}
    assert tma_params("wgmma", older) == TmaParams(128, 128, True, False)
    stores = make_candidate(space(), {**BASE, "O_STORE": "tma"}, HD128, SM90)
    assert tma_params(stores.family, stores.params) == TmaParams(128, 128, False, o_store=True)


@pytest.mark.parametrize("o_store", ["threads", "tma"])
def test_an_exported_wgmma_kernel_launches_through_tensor_maps(o_store: str) -> None:
    """A spec as export writes it gives a kernel with the TMA launch and its argument block
    (O_STORE "tma": O's map as a 16th argument)."""
    c = make_candidate(space(), {**BASE, "O_STORE": o_store}, HD64, SM90)
    cubin = b"\x7fELF not really a cubin"
    k = kernel_from_spec({"name": c.identity, "family": c.family, "params": c.params,
                          "problem": c.problem, "block_m": c.block_m, "threads": c.threads,
                          "smem_bytes": c.smem_bytes, "source": None, "cubin": cubin,
                          "cubin_sha256": sha256(cubin)}, "sm_90a")
    assert k.tma == TmaParams(swizzle=128, block_n=128, persistent=False, dynamic=False,
                              o_store=o_store == "tma")
    # 3 tensor maps, O, LSE, 5 int32, 3 strides, the scale, the counter (and O's map)
    assert len(k._argv) == (16 if o_store == "tma" else 15)


def test_tma_arguments_sit_at_their_natural_alignment() -> None:
    """The packed argument block matches the kernel's parameter space: each field at its own
    alignment (the tensor maps at 64), the counter pointer last at 8."""
    sizes = [128, 128, 128, 8, 8, 4, 4, 4, 4, 4, 8, 8, 8, 4, 8]
    offset, expected = 0, []
    for size in sizes:
        align = 64 if size == 128 else size
        offset = -(-offset // align) * align
        expected.append(offset)
        offset += size
    assert list(launch_tma.TMA_ARG_OFFSETS) == expected
    assert launch_tma.TMA_ARGS.size == offset
    # O_STORE "tma": O's tensor map after the counter, at 64.
    with_o = -(-offset // 64) * 64
    assert list(launch_tma.TMA_O_ARG_OFFSETS) == [*expected, with_o]
    assert launch_tma.TMA_O_ARGS.size == with_o + 128


def test_an_o_store_kernel_gets_the_output_map_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's side of O_STORE "tma", the driver faked: the argument block carries a map
    of the output in boxes of 16 rows after the counter; without it, no fifth field."""
    for o_store in ("threads", "tma"):
        c = make_candidate(space(), {**BASE, "O_STORE": o_store}, HD128, SM90)
        k = CudaKernel(c.identity, head_dim=128, dtype="bf16", causal=True, block_m=c.block_m,
                       threads=c.threads, smem_bytes=c.smem_bytes, arch="sm_90a", cubin=b"x",
                       tma=tma_params(c.family, c.params))
        monkeypatch.setattr(launch_forward, "launch_in_context", lambda loaded, args: None)
        monkeypatch.setattr(launch_forward, "sm_count", lambda index: 132)
        monkeypatch.setattr(launch_forward, "raw_stream", lambda index: 0)
        seen: list[tuple[int, int]] = []

        def fake_map(t: torch.Tensor, rows: int, pack: int = 0,
                     seen: list[tuple[int, int]] = seen) -> bytes:
            seen.append((t.data_ptr(), rows))
            return bytes([len(seen)]) * 128
        monkeypatch.setattr(k, "_tensor_map", fake_map)
        k._loaded[-1] = launch_forward.Loaded(0, 0, lambda *a: None, lambda: 0, lambda c: None,
                                              None)
        q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        k.launch(q, q, q, out, None, launch_forward.Problem(1, 2, 2, 300, 300, 128), 0.1)
        assert len(k._argv) == (16 if o_store == "tma" else 15)
        if o_store == "tma":
            assert seen[-1] == (out.data_ptr(), launch_tma.TMA_O_ROWS)
            at = launch_tma.TMA_O_ARG_OFFSETS[-1]
            assert k._args.raw[at:at + 128] == bytes([len(seen)]) * 128
        else:
            assert all(ptr != out.data_ptr() for ptr, _ in seen)


class _FakeLaunch:
    """Stands in for the driver: records the counter argument as the launch sees it, then
    counts on it as the kernel would."""

    def __init__(self, k: CudaKernel) -> None:
        self.kernel = k
        self.counters: list[tuple[int, int | None]] = []  # (address, value at launch)

    def __call__(self, loaded: object, args: tuple) -> None:
        (address,) = struct.unpack_from("=Q", self.kernel._args, launch_tma.TMA_ARG_OFFSETS[-1])
        value = None
        if address:
            counter = ctypes.c_int32.from_address(address)
            value, counter.value = counter.value, 1000
        self.counters.append((address, value))


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_launch_passes_a_fresh_zero_counter_only_when_dynamic(
        scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's side of the ABI, on CPU tensors with the driver faked: a dynamic kernel
    gets its stream's int32, zeroed right before each launch (whatever the last launch left
    in it), a static one null and no memset."""
    params = {**BASE, "PERSISTENT": True, "SCHEDULER": scheduler}
    c = make_candidate(space(), params, HD128, SM90)
    k = CudaKernel(c.identity, head_dim=128, dtype="bf16", causal=True, block_m=c.block_m,
                   threads=c.threads, smem_bytes=c.smem_bytes, arch="sm_90a", cubin=b"x",
                   tma=tma_params(c.family, c.params))
    fake = _FakeLaunch(k)
    monkeypatch.setattr(launch_forward, "launch_in_context", fake)
    zeroed: list[int] = []

    def zero(address: int, stream: int) -> None:  # cudaMemsetAsync, on the CPU
        ctypes.c_int32.from_address(address).value = 0
        zeroed.append(address)
    monkeypatch.setattr(launch_forward, "zero_int32", zero)
    monkeypatch.setattr(launch_forward, "in_context", lambda loaded, fn, *args: fn(*args))
    monkeypatch.setattr(launch_forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_forward, "raw_stream", lambda index: 0)
    monkeypatch.setattr(k, "_tensor_map", lambda t, rows, pack=0: bytes(128))
    # CPU tensors are device index -1; only the fields the launch reads are filled in.
    k._loaded[-1] = launch_forward.Loaded(0, 0, lambda *a: None, lambda: 0, lambda c: None, None)
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    p = launch_forward.Problem(1, 2, 2, 300, 300, 128)
    for _ in range(2):
        k.launch(q, q, q, torch.empty_like(q), None, p, 0.1)
    if scheduler == "static":
        assert fake.counters == [(0, None), (0, None)] and zeroed == []
    else:
        (address, _), _ = fake.counters
        assert address != 0 and fake.counters == [(address, 0), (address, 0)]
        assert zeroed == [address, address]


def test_a_wgmma_kernel_refuses_other_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Hopper an exported wgmma kernel is 'no kernel' (SDPA fallback), not a crash."""
    c = make_candidate(space(), BASE, HD64, SM90)
    k = CudaKernel(c.identity, head_dim=64, dtype="fp16", causal=False, block_m=c.block_m,
                   threads=c.threads, smem_bytes=c.smem_bytes, arch="sm_90a", cubin=b"x",
                   source="// source", tma=tma_params(c.family, c.params))
    monkeypatch.setattr(launch_forward, "device_arch", lambda index: "sm_89")
    with pytest.raises(NoKernelError, match="needs sm_90a"):
        k.load(0)
