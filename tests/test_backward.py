"""Tests of evoengine.backward that need no GPU: the mma_bwd family compiles for every target
and wgmma_bwd for sm_90a without spills (wgmma's HGMMA in its SASS, where cuobjdump is found),
the launcher's parameter buffers (``launch.CudaBackward``) match both families' kernel
signatures, and the input checks name what is wrong in one line.

As in tests/test_runtime.py, CPU tensors wrapped in a subclass that reports ``is_cuda`` reach
the checks after the device one.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from evoengine import backward, launch, paths
from evoengine.arch import get_arch
from evoengine.backward import BackwardKernel
from evoengine.compile import CompileResult, compile_many, cuobjdump_path
from evoengine.render import Candidate, make_candidate, render
from evoengine.space import SearchSpace, spread

F16 = torch.float16
POINT = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
             KV_IN_REGS=False, GROUP_SPLIT=1)
PROBLEM = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True)
WGMMA_POINT = dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic",
                   DQ_REDUCE="bulk", REFILL="dq", LOADER="cp_async", DQ_WRITER="consumer",
                   DQ_BUFFERS=1, ROWS_EARLY=False, DQ_LAYOUT="rows", DQ_TRANSPOSED=False,
                   STEP_ORDER="dv_dk_dq", GROUP_SPLIT=1, DS_BUFFERS=1,
                   DS_STORE="after_dv", MAIN_LAUNCH="stream", KV_LOAD="consumers")
# The ring loaded by a TMA producer warpgroup (FlashAttention-3's d128 tile).
TMA_POINT = {**WGMMA_POINT, "SWIZZLE": 128, "DQ_REDUCE": "red", "REFILL": "top",
             "LOADER": "tma"}
TMA_PROBLEM = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=True)
# The staged dQ added by warp 1 of the producer, two staging buffers.
WARP_POINT = {**TMA_POINT, "DQ_REDUCE": "bulk", "DQ_WRITER": "warp", "DQ_BUFFERS": 2}
# dQ^T = K^T dS^T on steps of 80 query rows (FlashAttention-3's d128 tile without a mask).
T_POINT = {**TMA_POINT, "BLOCK_M": 80, "STAGES": 2, "DQ_REDUCE": "bulk", "DQ_LAYOUT": "fragment",
           "DQ_TRANSPOSED": True}
T_PROBLEM = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=False)
POINTS = {"mma_bwd": (POINT, "sm_80"), "wgmma_bwd": (WGMMA_POINT, "sm_90a")}


def space(family: str = "mma_bwd") -> SearchSpace:
    """The shipped space, with its [untested] values admitted (the tests check them)."""
    return SearchSpace.load(paths.SPACES / f"{family}.toml").with_untested()


# ---- the family compiles ----------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_spread_points_compile_without_spills(arch: str, cache: Path) -> None:
    target = get_arch(arch)
    points = spread([space()], target, 7, seed=11)
    assert len(points) == 7
    cands = [make_candidate(sp, params, problem, target) for sp, problem, params in points]
    for c, r in zip(cands, compile_many(cands, target, workers=2), strict=True):
        assert r.ok, f"{c.identity}: {r.error}"
        assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{c.identity} spills: {r}"
        for entry in backward.BACKWARD_ENTRIES:
            assert f"Compiling entry function '{entry}'" in r.log


CUOBJDUMP = cuobjdump_path()
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def clean_build(point: dict, problem: dict) -> tuple[Candidate, CompileResult, str]:
    """A wgmma_bwd point compiled for sm_90a with no spill, stack or serialised wgmma, and the
    SASS text of its main kernel."""
    target = get_arch("sm_90a")
    cand = make_candidate(space("wgmma_bwd"), point, problem, target)
    (r,) = compile_many([cand], target, workers=1)
    assert r.ok, r.error
    assert r.spill_bytes == 0 and r.stack_bytes == 0 and "serialized" not in r.log, r.log
    return cand, r, sass_text(r.cubin or b"", "attn_bwd")


def sass_text(cubin: bytes, entry: str) -> str:
    """cuobjdump's SASS of one kernel of a cubin (the functions it calls included)."""
    assert CUOBJDUMP is not None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, "-sass", "-fun", entry, f.name], capture_output=True,
                              text=True, check=True).stdout


def sass_opcodes(cubin: bytes, entry: str) -> list[str]:
    """The base opcodes of one kernel of a cubin (HGMMA, LDL, ...), in program order."""
    return _OPCODE.findall(sass_text(cubin, entry))


def test_wgmma_bwd_spread_points_compile_to_hgmma_without_spills(cache: Path) -> None:
    """Every entry compiles with no spill, stack or serialised wgmma; where cuobjdump is found,
    the main kernel issues every k-step of its five GEMMs on HGMMA (none on mma.sync), stores
    dS with stmatrix and touches no local memory."""
    target = get_arch("sm_90a")
    points = spread([space("wgmma_bwd")], target, 6, seed=5)
    assert len(points) == 6
    cands = [make_candidate(sp, params, problem, target) for sp, problem, params in points]
    for c, r in zip(cands, compile_many(cands, target, workers=2), strict=True):
        assert r.ok, f"{c.identity}: {r.error}"
        assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{c.identity} spills: {r}"
        assert "serialized" not in r.log, r.log
        for entry in backward.BACKWARD_ENTRIES:
            assert f"Compiling entry function '{entry}'" in r.log
        if CUOBJDUMP is None:
            continue
        ops = sass_opcodes(r.cubin or b"", "attn_bwd")
        d, m, n = (int(c.problem["HEAD_DIM"]), int(c.params["BLOCK_M"]),  # type: ignore[call-overload]
                   int(c.params["BLOCK_N"]))  # type: ignore[call-overload]
        tiles = (int(c.derived["DQT_ROWS"]) // 64 if c.params["DQ_TRANSPOSED"]  # type: ignore[call-overload]
                 else int(c.derived["DQ_MT"]))  # type: ignore[call-overload]
        dq_steps = tiles * n // 16
        assert ops.count("HGMMA") >= 2 * d // 16 + 2 * m // 16 + dq_steps, c.identity
        assert "STSM" in ops and "HMMA" not in ops, c.identity
        assert "LDL" not in ops and "STL" not in ops, c.identity


def test_wgmma_bwd_64_key_tma_points_compile_without_spills(cache: Path) -> None:
    """The slice where spills were found (one consumer warpgroup at 256 registers, the bulk dQ
    path, a TMA ring; docs/NOTES.md, fourteenth session): the points its constraints leave,
    sampled across head dims, step orders and splits, compile with no spill; and the surveys'
    spilling points stay out."""
    import itertools
    import random

    sp, target = space("wgmma_bwd"), get_arch("sm_90a")
    spilled = [{**WARP_POINT, "BLOCK_N": 64, "DQ_BUFFERS": 1, "STAGES": 2,
                "STEP_ORDER": "dv_dq_dk"},
               {**WARP_POINT, "BLOCK_N": 64, "DQ_WRITER": "consumer", "DQ_BUFFERS": 1,
                "DQ_LAYOUT": "fragment", "STEP_ORDER": "dv_dq_dk"},
               {**WARP_POINT, "BLOCK_N": 64, "DQ_LAYOUT": "fragment", "STEP_ORDER": "dv_dq_dk",
                "GROUP_SPLIT": 4},
               {**WARP_POINT, "BLOCK_N": 64, "STAGES": 1, "DQ_BUFFERS": 1, "GROUP_SPLIT": 8}]
    for point in spilled:  # each kept out by a spill constraint alone
        why = sp.violations(point, TMA_PROBLEM, target)
        assert len(why) == 1 and "spill" in why[0], (point, why)
    rng, cands = random.Random(14), []
    for head_dim, order in itertools.product((64, 128), ("dv_dk_dq", "dv_dq_dk")):
        problem = dict(HEAD_DIM=head_dim, DTYPE="fp16", CAUSAL=order == "dv_dq_dk")
        admitted = [p for p in (dict(zip(sp.parameters, v, strict=True))
                                for v in itertools.product(*sp.parameters.values()))
                    if p["BLOCK_N"] == 64 and p["LOADER"] == "tma" and p["DQ_REDUCE"] == "bulk"
                    and p["STEP_ORDER"] == order and not sp.violations(p, problem, target)]
        cands += [make_candidate(sp, p, problem, target) for p in rng.sample(admitted, 2)]
    for c, r in zip(cands, compile_many(cands, target, workers=2), strict=True):
        assert r.ok and r.spill_bytes == 0 and r.stack_bytes == 0, f"{c.identity} spills: {r}"


def test_wgmma_bwd_space_targets_sm90a_and_says_why() -> None:
    sp = space("wgmma_bwd")
    assert sp.kind == "bwd" and sp.archs == ("sm_90a",)
    assert list(sp.problem) == ["HEAD_DIM", "DTYPE", "CAUSAL"]
    assert sp.parameters["DQ_ACCUM"] == ("atomic", "separate")
    assert all(c.why for c in sp.constraints)
    target = get_arch("sm_90a")
    for problem in sp.problems():
        assert sp.admitted(problem, target), problem
    d128 = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=False)
    big = sp.violations({**WGMMA_POINT, "BLOCK_M": 128}, d128, target)
    assert any("the kernel spills" in b for b in big)
    split = sp.violations({**WGMMA_POINT, "SWIZZLE": 128}, PROBLEM, target)  # dQ: 32 columns
    assert any("start on a panel of K" in b for b in split)
    parts = sp.violations({**WGMMA_POINT, "DQ_ACCUM": "separate"}, PROBLEM, target)
    assert any("adds into the atomic accumulator" in b for b in parts)
    # Points measured before DQ_REDUCE, REFILL, LOADER, DQ_WRITER, DQ_BUFFERS, ROWS_EARLY,
    # DQ_LAYOUT, DQ_TRANSPOSED, STEP_ORDER, GROUP_SPLIT, DS_BUFFERS, DS_STORE, MAIN_LAUNCH and
    # KV_LOAD build today's kernel as they did.
    assert sp.legacy == {"DQ_REDUCE": "red", "REFILL": "top", "LOADER": "cp_async",
                         "DQ_WRITER": "consumer", "DQ_BUFFERS": 1, "ROWS_EARLY": False,
                         "DQ_LAYOUT": "rows", "DQ_TRANSPOSED": False,
                         "STEP_ORDER": "dv_dk_dq", "GROUP_SPLIT": 1, "DS_BUFFERS": 1,
                         "DS_STORE": "after_dv", "MAIN_LAUNCH": "stream",
                         "KV_LOAD": "consumers"}
    # Points measured while DQ_DRAIN, DS_WITH_P and LSE_READ existed (their other values lost)
    # build the kernel their kept value built; a lost value is refused, not built as another.
    assert sp.retired == {"DQ_DRAIN": "complete", "DS_WITH_P": False, "LSE_READ": "chunk"}
    assert sp.complete({**WGMMA_POINT, "LSE_READ": "chunk", "DS_WITH_P": False}) == WGMMA_POINT
    assert any("LSE_READ='shfl' was retired" in b
               for b in sp.violations({**WGMMA_POINT, "LSE_READ": "shfl"}, PROBLEM, target))
    # dQ in fragment order is how staged dQ lies: only with the bulk reduction.
    frag = sp.with_untested().violations({**TMA_POINT, "DQ_LAYOUT": "fragment"}, TMA_PROBLEM,
                                         target)
    assert any("how staged dQ lies" in b for b in frag)
    # lse_log2 held across the S^T wait only where its registers fit.
    early = sp.violations({**WGMMA_POINT, "BLOCK_M": 128, "ROWS_EARLY": True},
                          dict(HEAD_DIM=64, DTYPE="bf16", CAUSAL=False), target)
    assert any("BLOCK_M / 4 more registers" in b for b in early)
    # A TMA producer refills a stage when its empty barrier completes: one REFILL value.
    refill = sp.violations({**TMA_POINT, "REFILL": "dq"}, TMA_PROBLEM, target)
    assert any("one REFILL value" in b for b in refill)
    assert not sp.violations(TMA_POINT, TMA_PROBLEM, target)
    tma = make_candidate(sp, TMA_POINT, TMA_PROBLEM, target)
    assert tma.threads == 384 and tma.smem_bytes == make_candidate(
        sp, {**TMA_POINT, "LOADER": "cp_async"}, TMA_PROBLEM, target).smem_bytes + 2 * 8 * 2
    old = {k: v for k, v in WGMMA_POINT.items() if k not in sp.legacy}
    assert sp.complete(old) == {**WGMMA_POINT, **sp.legacy}


def test_wgmma_bwd_transposed_dq_searched_only_where_the_rows_need_it() -> None:
    """DQ_TRANSPOSED (dQ^T = K^T dS^T) lets a step hold 80 or 96 query rows. Its GPU tests passed
    (H100, 75e5e01) and it is searched, but only there: at 64 rows it measured slower than dQ =
    dS K on every workload timed. d128 at 80 rows fits two consumer warpgroups (208 live
    registers), not 96 (224) nor one warpgroup (two m64 tiles of dQ^T); each warpgroup takes
    whole m64 tiles of the head dim (not d64 over two); staged dQ^T only in its fragment's
    order; without the transposition dQ stays in m64 tiles of query rows."""
    sp = space("wgmma_bwd")
    shipped = SearchSpace.load(paths.SPACES / "wgmma_bwd.toml")
    target = get_arch("sm_90a")
    assert sp.untested == {} and "DQ_TRANSPOSED" not in shipped.untested
    assert not sp.violations(T_POINT, T_PROBLEM, target)
    rows = {}
    for problem in shipped.problems():
        for p in shipped.admitted(problem, target):
            assert p["DQ_TRANSPOSED"] == bool(p["BLOCK_M"] % 64), p
            rows.setdefault(problem["HEAD_DIM"], set()).add(p["BLOCK_M"])
    assert rows == {64: {64, 80, 96, 128}, 128: {64, 80}}

    def why(point: dict, problem: dict = T_PROBLEM) -> list[str]:
        return sp.violations({**T_POINT, **point}, problem, target)

    assert any("in m64 tiles" in b for b in why({"DQ_TRANSPOSED": False}))
    assert any("measured slower" in b for b in why({"BLOCK_M": 64}))
    assert any("the kernel spills" in b for b in why({"BLOCK_M": 96}))
    assert any("spills" in b for b in why({"BLOCK_N": 64}))  # dQ^T: two m64 tiles
    d64 = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True)
    assert any("whole m64 tiles of the head dim" in b for b in why({}, d64))
    assert not why({"BLOCK_N": 64, "BLOCK_M": 96}, d64)
    assert any("fragment's order" in b for b in why({"DQ_LAYOUT": "rows"}))
    assert not why({"DQ_LAYOUT": "rows", "DQ_REDUCE": "red"})
    src = render(make_candidate(sp, T_POINT, T_PROBLEM, target))
    assert "constexpr bool DQ_T = true;" in src
    assert "mma_async<BLOCK_M>::ss<0, MNMajor<KTile>, KMajor<DSTile>, 1>(" in src
    old = render(make_candidate(sp, {**T_POINT, "BLOCK_M": 64, "DQ_TRANSPOSED": False},
                                T_PROBLEM, target))
    assert "constexpr bool DQ_T = false;" in old and "stage_dqt" not in old


@pytest.mark.parametrize(("point", "problem"), [
    ({**TMA_POINT, "DQ_REDUCE": "bulk", "DQ_LAYOUT": "fragment"}, TMA_PROBLEM),
    (T_POINT, T_PROBLEM),
    ({**WARP_POINT, "SWIZZLE": 64, "DQ_LAYOUT": "fragment", "ROWS_EARLY": True},
     dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=False)),
])
def test_wgmma_bwd_step_order_dq_under_dk(point: dict, problem: dict) -> None:
    """STEP_ORDER "dv_dq_dk" (FlashAttention-4's order: dQ issued before dK, staged while dK
    runs): searched; TMA with two stages or more only; compiles at the d128 winners' 64- and
    80-row steps and the dQ warp's d64 one without spills, and renders its switch."""
    sp, target = space("wgmma_bwd"), get_arch("sm_90a")
    assert SearchSpace.load(paths.SPACES / "wgmma_bwd.toml").parameters["STEP_ORDER"] == (
        "dv_dk_dq", "dv_dq_dk")
    new = {**point, "STEP_ORDER": "dv_dq_dk"}
    assert not sp.violations(new, problem, target)
    assert any("hands the stage back at the step's end" in b
               for b in sp.violations({**new, "STAGES": 1}, problem, target))
    assert any("hands the stage back at the step's end" in b for b in sp.violations(
        {**new, "LOADER": "cp_async", "REFILL": "dq", "DQ_WRITER": "consumer",
         "DQ_BUFFERS": 1}, problem, target))
    c = make_candidate(sp, new, problem, target)
    assert "constexpr bool DQ_UNDER_DK = true;" in render(c)
    (r,) = compile_many([c], target)
    assert r.ok, r.error
    assert r.spill_bytes == 0, f"{c.identity} spills"


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found")
@pytest.mark.parametrize(("point", "problem"), [
    (T_POINT, T_PROBLEM),  # FlashAttention-3's d128 tile, staged in fragment order
    ({**T_POINT, "LOADER": "cp_async", "SWIZZLE": 64, "DQ_REDUCE": "red", "DQ_LAYOUT": "rows"},
     T_PROBLEM),  # 255 registers, dQ^T added by scalar atomics
    ({**T_POINT, "BLOCK_N": 64, "BLOCK_M": 96, "DQ_ACCUM": "separate", "DQ_REDUCE": "red",
      "DQ_LAYOUT": "rows", "SWIZZLE": 32}, dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True)),
    ({**T_POINT, "DQ_WRITER": "warp"}, T_PROBLEM),
])
def test_wgmma_bwd_transposed_dq_compiles_to_its_own_gemm_without_spills(point: dict,
                                                                        problem: dict,
                                                                        cache: Path) -> None:
    """dQ^T is one m64nBLOCK_Mk16 wgmma per k-step of the block's keys per m64 tile of the
    warpgroup's head dim, next to S^T's and dP^T's of the same shape; dK and dV's k-steps run
    over the step's rows; staged dQ^T is BLOCK_M / 4 8-byte stores per tile (no 16-byte ones,
    no quad exchange); scalar REDs where atomics add it; nothing spilled or serialised."""
    cand, r, sass = clean_build(point, problem)
    d, m, n = problem["HEAD_DIM"], point["BLOCK_M"], point["BLOCK_N"]
    tiles = d // (n // 64) // 64
    assert len(re.findall(rf"HGMMA\.64x{m}x16\.", sass)) == 2 * d // 16 + tiles * n // 16
    assert len(re.findall(rf"HGMMA\.64x{d}x16\.", sass)) == 2 * m // 16
    ops = sass_opcodes(r.cubin or b"", "attn_bwd")
    assert "LDL" not in ops and "STL" not in ops
    assert ops.count("SHFL") <= 1  # the warpgroup index's broadcast; no quad exchange of dQ
    if point["DQ_REDUCE"] == "bulk":
        assert len(re.findall(r"\bSTS\.64\b", sass)) == tiles * m // 4
        assert "REDG" not in ops
    elif point["DQ_ACCUM"] == "atomic":
        assert "REDG" in ops and "UBLKRED" not in ops


@pytest.mark.parametrize(("head_dim", "causal"), [(48, False), (80, True), (96, False),
                                               (112, True)])
def test_wgmma_bwd_compiles_where_a_row_is_no_power_of_two_of_chunks(head_dim: int,
                                                                    causal: bool,
                                                                    cache: Path) -> None:
    """A row of 96 values is 12 16-byte chunks, which the consumer threads do not split evenly:
    K, V (and the cp.async ring's Q and dO) are then copied by chunk index. An admitted point
    of each loader compiles with no spill (every d96 point failed a static assertion before)."""
    sp = space("wgmma_bwd")
    target = get_arch("sm_90a")
    problem = dict(HEAD_DIM=head_dim, DTYPE="fp16", CAUSAL=causal)
    points = sp.admitted(problem, target)
    cands = [make_candidate(sp, next(p for p in points[i::7] if p["LOADER"] == loader),
                            problem, target)
             for i, loader in enumerate(("tma", "cp_async"))]
    for c, r in zip(cands, compile_many(cands, target, workers=2), strict=True):
        assert r.ok, f"{c.identity}: {r.error}"
        assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{c.identity} spills: {r}"


def test_wgmma_bwd_dq_warp_only_where_it_has_work_and_its_buffers_fit() -> None:
    """DQ_WRITER=warp needs the TMA producer (its warp 1) and the bulk reduction; a second
    staging buffer only with the dQ warp (no duplicate kernels) and where shared memory holds
    it; the space's shared memory is the template's (two more mbarriers per buffer)."""
    sp = space("wgmma_bwd")
    target = get_arch("sm_90a")
    assert not sp.violations(WARP_POINT, TMA_PROBLEM, target)
    why = "the dQ warp is warp 1 of the TMA producer"
    for other in ({"LOADER": "cp_async"}, {"DQ_REDUCE": "red"}):
        assert any(why in b for b in sp.violations({**WARP_POINT, **other}, TMA_PROBLEM, target))
    separate = {**WARP_POINT, "DQ_ACCUM": "separate", "DQ_REDUCE": "red"}
    assert any(why in b for b in sp.violations(separate, TMA_PROBLEM, target))
    two = {**TMA_POINT, "DQ_REDUCE": "bulk", "DQ_BUFFERS": 2}  # the consumer writes dQ
    assert any("second staging buffer" in b for b in sp.violations(two, TMA_PROBLEM, target))
    # d128 BLOCK_M 64 with three stages: one buffer fits, two do not.
    three = {**WARP_POINT, "STAGES": 3}
    assert any("shared memory" in b for b in sp.violations(three, TMA_PROBLEM, target))
    assert not sp.violations({**three, "DQ_BUFFERS": 1}, TMA_PROBLEM, target)
    consumer = make_candidate(sp, {**WARP_POINT, "DQ_WRITER": "consumer", "DQ_BUFFERS": 1},
                              TMA_PROBLEM, target)
    warp = make_candidate(sp, WARP_POINT, TMA_PROBLEM, target)
    assert warp.threads == consumer.threads == 384
    assert warp.smem_bytes == consumer.smem_bytes + 64 * 128 * 4 + 2 * 2 * 8
    src, old = render(warp), render(consumer)
    assert "reduce_dq(dQacc" in src and "constexpr bool DQ_WARP = true;" in src
    assert "constexpr bool DQ_WARP = false;" in old


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found")
@pytest.mark.parametrize("reduce", ["red", "bulk"])
def test_wgmma_bwd_dq_reduce_picks_the_instruction_that_adds_dq(reduce: str,
                                                                 cache: Path) -> None:
    """DQ_REDUCE=red adds dQ by per-thread REDG; bulk by the bulk-copy engine (UBLKRED: one in
    the loop for the previous step, one after it for the last), with no REDG left."""
    target = get_arch("sm_90a")
    cand = make_candidate(space("wgmma_bwd"), {**WGMMA_POINT, "DQ_REDUCE": reduce}, PROBLEM,
                          target)
    (r,) = compile_many([cand], target, workers=1)
    assert r.ok and r.spill_bytes == 0 and r.stack_bytes == 0, r
    ops = sass_opcodes(r.cubin or b"", "attn_bwd")
    if reduce == "bulk":
        assert ops.count("UBLKRED") == 2 and "REDG" not in ops
    else:
        assert "REDG" in ops and "UBLKRED" not in ops


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found")
@pytest.mark.parametrize(("point", "problem"), [
    (WARP_POINT, TMA_PROBLEM),  # two consumer warpgroups, two buffers
    ({**WARP_POINT, "BLOCK_M": 128, "SWIZZLE": 64, "STAGES": 1, "DQ_BUFFERS": 1}, PROBLEM),
    ({**WARP_POINT, "BLOCK_N": 64, "STAGES": 3}, TMA_PROBLEM),  # one consumer warpgroup
])
def test_wgmma_bwd_dq_warp_issues_the_only_bulk_reduction(point: dict, problem: dict,
                                                          cache: Path) -> None:
    """DQ_WRITER=warp: one UBLKRED in the kernel, in the producer's code (after its
    setmaxnreg.dec), none left in the consumers; the producer's code fits the registers it keeps
    (24 with two consumer warpgroups, 56 with one); nothing spilled, serialised or local."""
    cand, r, sass = clean_build(point, problem)
    producer_at = sass.index("USETMAXREG.DEALLOC")
    consumers, producer = sass[:producer_at], sass[producer_at:]
    assert "UBLKRED" not in consumers and producer.count("UBLKRED") == 1, cand.identity
    kept = 24 if point["BLOCK_N"] == 128 else 56
    assert max(int(x) for x in re.findall(r"\bR(\d+)\b", producer)) < kept, cand.identity
    ops = sass_opcodes(r.cubin or b"", "attn_bwd")
    assert "LDL" not in ops and "STL" not in ops and "REDG" not in ops, cand.identity


@pytest.mark.parametrize(("point", "problem"), [
    (TMA_POINT, TMA_PROBLEM),  # two consumer warpgroups at 240 registers
    ({**TMA_POINT, "BLOCK_N": 64, "STAGES": 1, "DQ_ACCUM": "separate"}, PROBLEM),  # one, 255
    ({**TMA_POINT, "BLOCK_M": 128, "SWIZZLE": 64, "DQ_REDUCE": "bulk"}, PROBLEM),
])
def test_wgmma_bwd_tma_loader_compiles_to_a_producer_without_spills(point: dict, problem: dict,
                                                                    cache: Path) -> None:
    """LOADER=tma: the ring by TMA tensor copies (UTMALDG: Q and dO, one per swizzle panel)
    and bulk copies (lse_log2, delta), registers moved by setmaxnreg, no cp.async of Q or dO
    left (K and V keep theirs), nothing spilled or serialised."""
    target = get_arch("sm_90a")
    cand = make_candidate(space("wgmma_bwd"), point, problem, target)
    src = render(cand)
    old = render(make_candidate(space("wgmma_bwd"), {**point, "LOADER": "cp_async"}, problem,
                                target))
    assert "wg::regs_inc" not in old and "TmaMap tm_q" not in old
    assert "wg::regs_inc" in src and "__grid_constant__ TmaMap tm_q" in src
    (r,) = compile_many([cand], target, workers=1)
    assert r.ok, r.error
    assert r.spill_bytes == 0 and r.stack_bytes == 0 and "serialized" not in r.log, r.log
    if CUOBJDUMP is None:
        return
    ops = sass_opcodes(r.cubin or b"", "attn_bwd")
    assert "UTMALDG" in ops and "UBLKCP" in ops, cand.identity
    assert "USETMAXREG" in ops, cand.identity
    assert "LDL" not in ops and "STL" not in ops, cand.identity


def test_parameter_buffer_of_a_tma_kernel_matches_its_signature() -> None:
    """Two 128-byte, 64-byte aligned tensor maps, then the cp.async kernel's parameters."""
    src = render(make_candidate(space("wgmma_bwd"), TMA_POINT, TMA_PROBLEM, get_arch("sm_90a")))
    found = re.search(r"\battn_bwd\(([^)]*)\)\s*{", src)
    assert found
    params = [p.split() for p in found.group(1).split(",")]
    assert [p[-1] for p in params[:2]] == ["tm_q", "tm_do"]
    assert all("TmaMap" in p for p in params[:2])
    pack = launch.BWD_MAIN_TMA_ARGS
    assert pack.offsets[:3] == (0, 128, 256)
    assert pack.offsets[2:] == tuple(o + 256 for o in launch.BWD_MAIN_ARGS.offsets)
    assert len(params) == len(pack.offsets)


def test_parameter_buffer_of_a_kernel_whose_producer_loads_k_and_v() -> None:
    """KV_LOAD "producer": four tensor maps (Q, dO, K, V), then the cp.async kernel's."""
    point = {**TMA_POINT, "KV_LOAD": "producer"}
    src = render(make_candidate(space("wgmma_bwd").with_untested(), point, TMA_PROBLEM,
                                get_arch("sm_90a")))
    found = re.search(r"\battn_bwd\(([^)]*)\)\s*{", src)
    assert found
    params = [p.split() for p in found.group(1).split(",")]
    assert [p[-1] for p in params[:4]] == ["tm_q", "tm_do", "tm_k", "tm_v"]
    pack = launch.BWD_MAIN_TMA_KV_ARGS
    assert pack.offsets[:5] == (0, 128, 256, 384, 512)
    assert pack.offsets[4:] == tuple(o + 512 for o in launch.BWD_MAIN_ARGS.offsets)
    assert len(params) == len(pack.offsets)
    # the consumers' loads of K and V are gone; the producer's are on barriers of their own
    assert "k_full" in src and "KV_BY_PRODUCER = true" in src
    with pytest.raises(ValueError, match=r"kv_load must be one of \('consumers', 'producer'\) "
                                         r"\('producer' with a TMA loader\), got 'producer'"):
        launch.CudaBackward("b", head_dim=64, dtype="fp16", causal=True, block_m=64,
                            block_n=64, threads=256, smem_bytes=0, dq_accum="atomic",
                            source="//", kv_load="producer")


def test_tma_operands_are_the_tensors_unless_a_map_cannot_describe_them() -> None:
    """Views with 16-byte multiple strides (bshd storage seen as bhsd, size-1 dims with any
    stride) go to the tensor map as they are; an expanded (stride-0) tensor as a copy."""
    bshd = torch.zeros(2, 33, 8, 64, dtype=F16).transpose(1, 2)
    assert launch.backward.tma_operand(bshd) is bshd
    one = torch.zeros(1, 8, 1, 64, dtype=F16)
    assert launch.backward.tma_operand(one) is one
    expanded = torch.zeros(64, dtype=F16).expand(2, 8, 33, 64)
    copy = launch.backward.tma_operand(expanded)
    assert copy is not expanded and copy.is_contiguous() and torch.equal(copy, expanded)


def test_a_rejected_point_says_why() -> None:
    sp = space()
    bad = sp.violations({**POINT, "BLOCK_N": 32}, PROBLEM, get_arch("sm_80"))
    assert any("each warp owns whole m16 tiles of keys" in b for b in bad)
    big = {**POINT, "BLOCK_M": 128, "BLOCK_N": 128, "NUM_WARPS": 8, "STAGES": 3}
    assert any("shared memory" in b for b in sp.violations(big, PROBLEM, get_arch("sm_89")))


# ---- the launcher matches the kernels ---------------------------------------------------------

_CODES = {"const elem_t*": "Q", "elem_t*": "Q", "const float*": "Q", "float*": "Q", "int": "i",
          "long long": "q", "float": "f"}


def signature(source: str, entry: str) -> str:
    """The struct codes of a rendered kernel's parameters, in order."""
    found = re.search(rf"\b{entry}\(([^)]*)\)\s*{{", source)
    assert found, entry
    codes = ""
    for param in found.group(1).split(","):
        words = param.replace("__restrict__", "").split()
        ctype = " ".join(words[:-1]).replace(" *", "*")
        codes += _CODES[ctype]
    return codes


@pytest.mark.parametrize("family", backward.BACKWARD_FAMILIES)
def test_parameter_buffers_match_the_kernel_signatures(family: str) -> None:
    point, arch = POINTS[family]
    src = render(make_candidate(space(family), point, PROBLEM, get_arch(arch)))
    packs = (launch.BWD_PRE_ARGS, launch.BWD_MAIN_ARGS, launch.BWD_POST_ARGS)
    for entry, pack in zip(backward.BACKWARD_ENTRIES, packs, strict=True):
        codes = signature(src, entry)
        assert len(codes) == len(pack.offsets)
        assert pack.struct.format.replace("4x", "").lstrip("=") == codes, entry
        for off, code in zip(pack.offsets, codes, strict=True):  # natural alignment
            assert off % {"Q": 8, "q": 8, "i": 4, "f": 4}[code] == 0


@pytest.mark.parametrize("family", backward.BACKWARD_FAMILIES)
def test_launch_shapes_match_the_template(family: str) -> None:
    point, arch = POINTS[family]
    src = render(make_candidate(space(family), point, PROBLEM, get_arch(arch)))
    for name in ("PRE_THREADS", "POST_THREADS"):
        assert f"constexpr int {name} = {getattr(launch, name)};" in src
    assert "constexpr int PRE_ROWS = PRE_THREADS / 8;" in src
    assert launch.PRE_ROWS == launch.PRE_THREADS // 8


def test_families_share_the_first_and_last_kernels() -> None:
    """One source (templates/common/bwd_prepost.cuh) for attn_bwd_pre and attn_bwd_post in
    every backward family, so the launcher runs them alike."""
    def kernel_text(src: str, entry: str) -> str:
        start = src.index(f"{entry}(")
        return src[start:src.index("\n}\n", start)]

    sources = [render(make_candidate(space(f), POINTS[f][0], PROBLEM, get_arch(POINTS[f][1])))
               for f in backward.BACKWARD_FAMILIES]
    for entry in ("attn_bwd_pre", "attn_bwd_post"):
        texts = {kernel_text(src, entry) for src in sources}
        assert len(texts) == 1, entry


# ---- input checks ---------------------------------------------------------------------------


class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def t(*shape: int, dtype: torch.dtype = F16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).as_subclass(FakeCuda)


@pytest.fixture
def kernel() -> BackwardKernel:
    """A kernel over a fake cubin: it loads on first launch, which these tests never reach."""
    cand = make_candidate(space(), POINT, PROBLEM, get_arch("sm_80"))
    return BackwardKernel(cand, CompileResult(cand.identity, "sm_80", True, cubin=b"\0"))


def call_args(**change: object) -> tuple[tuple, dict]:
    """Good arguments for a GQA call (8 query heads over 2), with ``change`` applied."""
    args = dict(q=t(2, 8, 33, 64), k=t(2, 2, 17, 64), v=t(2, 2, 17, 64), out=t(2, 8, 33, 64),
                lse=t(2, 8, 33, dtype=torch.float32), dout=t(2, 8, 33, 64))
    kw: dict[str, object] = dict(causal=True)
    for name, value in change.items():
        (args if name in args else kw)[name] = value
    return tuple(args.values()), kw


BAD_CALLS = [
    ("cpu q", dict(q=torch.zeros(2, 8, 33, 64, dtype=F16)), r"^q must be a CUDA tensor"),
    ("causal differs", dict(causal=False),
     r"^this kernel is compiled for causal=True, got causal=False$"),
    ("head dim", dict(q=t(2, 8, 33, 128), k=t(2, 2, 17, 128), v=t(2, 2, 17, 128)),
     r"^this kernel takes head_dim 64"),
    ("bf16", dict(q=t(2, 8, 33, 64, dtype=torch.bfloat16), k=t(2, 2, 17, 64, dtype=torch.bfloat16),
                  v=t(2, 2, 17, 64, dtype=torch.bfloat16)), r"^this kernel takes fp16"),
    ("out shape", dict(out=t(2, 8, 32, 64)), r"^out must match q: \(2, 8, 33, 64\)"),
    ("dout dtype", dict(dout=t(2, 8, 33, 64, dtype=torch.bfloat16)), r"^dout must match q"),
    ("dout strided", dict(dout=t(2, 8, 64, 33).mT),
     r"^dout must have a contiguous last dim and 16-byte aligned rows"),
    ("lse shape", dict(lse=t(2, 8, 32, dtype=torch.float32)),
     r"^lse must be a contiguous float32 \[2, 8, 33\]"),
    ("lse dtype", dict(lse=t(2, 8, 33)), r"^lse must be a contiguous float32"),
    ("lse strided", dict(lse=t(2, 33, 8, dtype=torch.float32).transpose(1, 2)),
     r"^lse must be a contiguous float32"),
    ("dq shape", dict(dq=t(2, 2, 33, 64)), r"^dq must match q"),
    ("dk like q", dict(dk=t(2, 8, 17, 64)), r"^dk must match k: \(2, 2, 17, 64\)"),
    ("dv rows unaligned", dict(dv=t(2, 2, 17, 68)[..., :64]),
     r"^dv must have a contiguous last dim and 16-byte aligned rows"),
    ("scale", dict(scale=math.inf), r"^scale must be finite"),
]


@pytest.mark.parametrize(("case", "change", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_are_one_line_value_errors(kernel: BackwardKernel, case: str, change: dict,
                                             message: str) -> None:
    args, kw = call_args(**change)
    with pytest.raises(ValueError, match=message) as err:
        kernel(*args, **kw)
    assert "\n" not in str(err.value)


def test_non_tensors_are_a_type_error(kernel: BackwardKernel) -> None:
    args, kw = call_args(lse=[0.0])
    with pytest.raises(TypeError, match=r"^lse must be a torch.Tensor, got list$"):
        kernel(*args, **kw)


def test_good_calls_reach_the_launch(kernel: BackwardKernel,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[dict] = []

    def launch(*tensors: torch.Tensor, scale: float, deterministic: bool) -> None:
        launched.append(dict(tensors=tensors, scale=scale, deterministic=deterministic))

    monkeypatch.setattr(kernel, "launch", launch)
    args, kw = call_args()
    dq, dk, dv = kernel(*args, **kw)
    (call,) = launched
    assert call["scale"] == 1 / 8 and call["deterministic"] is False
    assert (dq.shape, dk.shape, dv.shape) == (args[0].shape, args[1].shape, args[2].shape)
    assert all(g.is_contiguous() and g.dtype == F16 for g in (dq, dk, dv))
    assert call["tensors"][6:] == (dq, dk, dv)
    given = t(2, 33, 8, 64).transpose(1, 2)  # a strided dq view is written in place
    args, kw = call_args(dq=given, scale=0.5, deterministic=True)
    assert kernel(*args, **kw)[0] is given
    assert launched[1]["scale"] == 0.5 and launched[1]["deterministic"] is True


def test_only_backward_families(kernel: BackwardKernel) -> None:
    fwd = SearchSpace.load(paths.SPACES / "mma.toml")
    point = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                 LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split")
    cand = make_candidate(fwd, point, PROBLEM, get_arch("sm_80"))
    with pytest.raises(ValueError, match="is not a backward family"):
        BackwardKernel(cand, CompileResult(cand.identity, "sm_80", True, cubin=b"\0"))
    failed = CompileResult(kernel.candidate.identity, "sm_80", False, error="boom")
    with pytest.raises(ValueError, match="did not compile: boom"):
        BackwardKernel(kernel.candidate, failed)
