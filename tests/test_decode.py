"""The decode problem without a GPU: its workload, key and flags, its search space and offline
compilation for every target, the split policy, the launcher's input checks (on CPU
tensors where the check does not need the device) and the float64 reference."""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys

import pytest
import torch

from evoengine import paths, validate
from evoengine.arch import Arch, get_arch
from evoengine.compile import compile_candidate
from evoengine.launch.decode import (
    MAX_DECODE_SPLITS,
    CudaDecode,
    DecodeShape,
    check_decode_inputs,
    cluster_splits,
    decode_splits,
    nearest_decode,
    sdpa_decode,
)
from evoengine.launch.dispatch import Entry
from evoengine.problems import problem, workload_from_dict, workload_from_key
from evoengine.problems.decode import Decode, DecodeWorkload, bandwidth_fraction
from evoengine.render import Candidate, make_candidate, render
from evoengine.space import SearchSpace

SPACE = paths.SPACES / "decode.toml"


def clean_build(cand: Candidate, target: Arch) -> list[str]:
    """Compiles ``cand`` and asserts no spill and, where cuobjdump is found, no local memory in
    the main kernel; its SASS opcodes (none without cuobjdump)."""
    from tests.test_backward import CUOBJDUMP, sass_opcodes

    result = compile_candidate(cand, target)
    assert result.ok, result.error
    assert result.spill_bytes == 0, f"{cand.identity} spills on {target.name}"
    if CUOBJDUMP is None:
        return []
    ops = sass_opcodes(result.cubin or b"", "attn_decode")
    assert "LDL" not in ops and "STL" not in ops, cand.identity
    return ops


def test_workload_key_round_trips() -> None:
    paged = DecodeWorkload(8, 4, 32, 8, 128, 32768, layout="paged", page_size=64)
    contig = DecodeWorkload(1, 1, 64, 8, 128, 4096, layout="contiguous", page_size=64)
    assert paged.key() == "decode-b8-q4-h32-kv8-d128-c32768-paged64-fp16"
    assert contig.key() == "decode-b1-q1-h64-kv8-d128-c4096-contig-fp16"
    assert contig.page_size == 0  # a contiguous cache has no pages
    for w in (paged, contig):
        assert workload_from_key(w.key()) == w
        assert workload_from_dict(w.to_dict()) == w
    assert problem("decode").workload_from_key(paged.key()) == paged
    assert paged.problem() == {"HEAD_DIM": 128, "DTYPE": "fp16", "PAGED": True}


def test_workload_names_a_dispatch_entry() -> None:
    """export builds a dispatch entry from a won workload's seq_q, seq_k, heads and causal."""
    w = DecodeWorkload(8, 4, 32, 8, 128, 32768)
    assert (w.seq_q, w.seq_k, w.heads, w.causal) == (4, 32768, 32, True)


def test_launcher_carries_the_decode_kind() -> None:
    from evoengine.launch import MODULES, module_text
    from evoengine.launch.dispatch import KERNEL_CLASSES

    assert MODULES.index("decode") < MODULES.index("dispatch")
    assert KERNEL_CLASSES["decode"].__name__ == "CudaDecode"
    text = module_text()
    assert "class CudaDecode" in text and "class TunedDecode" in text
    compile(text, "launcher", "exec")  # one namespace: it parses


def test_workload_counts() -> None:
    w = DecodeWorkload(2, 4, 32, 8, 128, 100)
    assert w.visible_pairs() == 97 + 98 + 99 + 100  # query i sees 100 - 4 + i + 1 keys
    assert w.flops() == 4.0 * 2 * 32 * w.visible_pairs() * 128
    assert w.kv_bytes() == 2 * 2 * 2 * 100 * 8 * 128
    assert w.capacity == 128  # whole pages of 64
    assert bandwidth_fraction(w, 10.0, 20.0) == pytest.approx(1.0)


@pytest.mark.parametrize("bad, match", [
    (dict(q_len=17), "q_len must be at most 16"),
    (dict(q_heads=30), "multiple of kv heads"),
    (dict(page_size=48), "power of 2"),
    (dict(layout="ring"), "layout must be one of"),
    (dict(cache_len=0), "cache_len must be a positive integer"),
])
def test_workload_rejects(bad: dict, match: str) -> None:
    args = dict(batch=1, q_len=1, q_heads=32, kv_heads=8, head_dim=128, cache_len=64)
    with pytest.raises(ValueError, match=match):
        DecodeWorkload(**{**args, **bad})


def test_flags_name_a_workload() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp16")  # the forward's flag, shared
    Decode().add_arguments(parser)
    args = parser.parse_args(["--decode", "8,4,64,8,128", "--cache-len", "32768",
                              "--layout", "contiguous", "--dtype", "bf16"])
    w = Decode().workload_from_arguments(args)
    assert w.key() == "decode-b8-q4-h64-kv8-d128-c32768-contig-bf16"
    with pytest.raises(ValueError, match="--cache-len"):
        Decode().workload_from_arguments(parser.parse_args(["--decode", "1,1,8,8,64"]))
    with pytest.raises(ValueError, match="five integers"):
        Decode().workload_from_arguments(parser.parse_args(["--decode", "1,1,8",
                                                            "--cache-len", "9"]))


def test_cli_knows_the_kind() -> None:
    from evoengine.cli import build_parser

    args = build_parser().parse_args(["search", "--kind", "decode", "--decode", "1,1,32,8,128",
                                      "--cache-len", "4096"])
    assert problem(args.kind).workload_from_arguments(args).cache_len == 4096


def test_points_from_before_l2_prefetch_and_merge_complete() -> None:
    """The probe's points (benchmarks/results/2026-11-24-h100-decode-probe.json) predate
    L2_PREFETCH and MERGE, the L2 run's (2026-11-24-h100-decode-l2.json) MERGE: they
    complete to the kernels they measured."""
    space = SearchSpace.load(SPACE)
    old = dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=3, VEC_BYTES=16,
               SPLIT_POLICY="waves", SPLITS=1)
    assert space.complete(old)["L2_PREFETCH"] == 0
    assert space.complete(old)["MERGE"] == "atomic"
    assert space.complete(dict(old, L2_PREFETCH=256))["MERGE"] == "atomic"
    assert space.complete(old)["COMBINE"] == "kernel"
    assert space.complete(old)["COMBINE_ITEMS"] == 1
    assert space.complete(old)["CLUSTER"] == 1
    assert space.complete(old)["COMBINE_LAUNCH"] == "stream"
    assert space.complete(old)["MMA"] == "sync"
    assert space.legacy == {"L2_PREFETCH": 0, "MERGE": "atomic", "COMBINE": "kernel",
                            "COMBINE_ITEMS": 1, "CLUSTER": 1, "PAGE_STAGING": "regs",
                            "COMBINE_LAUNCH": "stream", "ROW_GROUPS": 1, "MMA": "sync"}


def test_space_is_of_kind_decode() -> None:
    space = SearchSpace.load(SPACE)
    assert space.kind == "decode" and space.family == "decode"
    arch = get_arch("sm_90a")
    admitted = space.admitted({"HEAD_DIM": 128, "DTYPE": "fp16", "PAGED": True}, arch)
    assert admitted
    bad = dict(admitted[0], BLOCK_N=32, NUM_WARPS=8)  # 4 keys a warp: not a k16 step
    assert any("k16 steps of keys" in why for why in
               space.violations(bad, {"HEAD_DIM": 128, "DTYPE": "fp16", "PAGED": True}, arch))


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("merge, combine, items", [
    ("slices", "kernel", 1), ("atomic", "kernel", 1), ("slices", "fused", 1),
    ("slices", "fused", 2), ("slices", "fused", 4)])
def test_compiles_offline_without_spills(arch: str, paged: bool, merge: str,
                                         combine: str, items: int) -> None:
    """Both merges and both combines (fused: 1, 2 or 4 quads a thread at once) compile without
    spills or local memory; where cuobjdump is found, the atomic merge is a CAS loop
    (ATOMS.CAST.SPIN) per value a thread adds, 2 x BLOCK_M / 16 x HEAD_DIM / 8 of them, and the
    slices merge has no shared atomic at all; the fused combine adds one global atomic (the
    count) and its two fences to the main kernel, and the kernel combine none."""
    space = SearchSpace.load(SPACE).with_untested()
    target = get_arch(arch)
    for head_dim, dtype, params in [
        (128, "fp16", dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=2, VEC_BYTES=16,
                           L2_PREFETCH=256, SPLIT_POLICY="waves", SPLITS=1)),
        (64, "bf16", dict(BLOCK_N=32, BLOCK_M=32, NUM_WARPS=2, STAGES=3, VEC_BYTES=8,
                          L2_PREFETCH=128, SPLIT_POLICY="fixed", SPLITS=8)),
    ]:
        params = space.complete(dict(params, MERGE=merge, COMBINE=combine,
                                     COMBINE_ITEMS=items))
        problem_ = {"HEAD_DIM": head_dim, "DTYPE": dtype, "PAGED": paged}
        cand = make_candidate(space, params, problem_, target)
        source = render(cand)
        assert "attn_decode_combine" in source and f"PAGED = {str(paged).lower()}" in source
        assert f"MERGE_SLICES = {str(merge == 'slices').lower()}" in source
        assert f"COMBINE_FUSED = {str(combine == 'fused').lower()}" in source
        assert f"COMBINE_ITEMS = {items};" in source
        ops = clean_build(cand, target)
        if not ops:
            continue
        adds = 2 * int(params["BLOCK_M"]) // 16 * head_dim // 8 * 2  # type: ignore[call-overload]
        assert ops.count("ATOMS") == (adds if merge == "atomic" else 0), cand.identity
        fused = combine == "fused"
        assert (ops.count("ATOMG"), ops.count("MEMBAR")) == ((1, 2) if fused else (0, 0))


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_page_staging_builds_without_spills(arch: str) -> None:
    """PAGE_STAGING "smem" is the paged cache's: a contiguous one is refused with the reason.
    Paged, from 2-stage rings of 32-key tiles to 8-stage ones of 256 (a tile's page numbers in
    a ring of 2 STAGES - 1 slots after the K/V ring, which the space's shared memory counts: the
    kernel asserts the same sum), it compiles without spills or local memory, as its "regs" twin
    does."""
    space = SearchSpace.load(SPACE)
    target = get_arch(arch)
    base = dict(BLOCK_M=16, VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves",
                SPLITS=1, COMBINE="fused", COMBINE_ITEMS=1, CLUSTER=1, PAGE_STAGING="smem",
                COMBINE_LAUNCH="stream", ROW_GROUPS=1, MMA="sync")
    contiguous = {"HEAD_DIM": 128, "DTYPE": "fp16", "PAGED": False}
    point = dict(base, BLOCK_N=64, NUM_WARPS=4, STAGES=4)
    assert any("no page numbers to stage" in why
               for why in space.violations(point, contiguous, target))
    for head_dim, tile in ((128, dict(BLOCK_N=64, NUM_WARPS=4, STAGES=4)),
                           (64, dict(BLOCK_N=32, NUM_WARPS=2, STAGES=2)),
                           (64, dict(BLOCK_N=256, NUM_WARPS=8, STAGES=8))):
        problem_ = {"HEAD_DIM": head_dim, "DTYPE": "bf16", "PAGED": True}
        params = dict(base, **tile)
        if space.violations(params, problem_, target):
            continue  # 8 stages of 256 keys pass sm_89's shared memory
        smem = make_candidate(space, params, problem_, target)
        regs = make_candidate(space, dict(params, PAGE_STAGING="regs"), problem_, target)
        assert int(smem.derived["SMEM_BYTES"]) > int(regs.derived["SMEM_BYTES"])  # type: ignore[call-overload]
        for cand in (smem, regs):
            clean_build(cand, target)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_row_groups_build_without_spills(arch: str) -> None:
    """ROW_GROUPS splits the rows over the warps before the keys: 64 rows at d128, which no
    point held before (64 rows a warp are over the register bound), fit as 4 groups of 16;
    groups that are no whole warps or m16 tiles are refused with the reason; 16 and 32 rows a
    warp, one to four key warps a group, both merges and (sm_90) a cluster build without spills
    or local memory."""
    space = SearchSpace.load(SPACE).with_untested()
    target = get_arch(arch)
    d128 = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    base = dict(VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
                COMBINE="kernel", COMBINE_ITEMS=1, CLUSTER=1, PAGE_STAGING="regs",
                COMBINE_LAUNCH="stream", MMA="sync")
    rows64 = dict(base, BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2)
    assert any("leave room in 255 registers" in why
               for why in space.violations(dict(rows64, ROW_GROUPS=1), d128, target))
    assert not space.violations(dict(rows64, ROW_GROUPS=4), d128, target)
    assert any("row groups of whole warps" in why
               for why in space.violations(dict(rows64, NUM_WARPS=2, ROW_GROUPS=4), d128, target))
    assert any("row groups of whole warps" in why for why in space.violations(
        dict(rows64, BLOCK_M=32, ROW_GROUPS=4), d128, target))
    cases = [(d128, dict(rows64, ROW_GROUPS=4)),
             (d128, dict(base, BLOCK_M=128, BLOCK_N=128, NUM_WARPS=8, STAGES=2, ROW_GROUPS=8,
                         COMBINE="fused")),
             (d128, dict(base, BLOCK_M=32, BLOCK_N=64, NUM_WARPS=8, STAGES=3, ROW_GROUPS=2,
                         MERGE="atomic")),
             ({"HEAD_DIM": 64, "DTYPE": "fp16", "PAGED": False},
              dict(base, BLOCK_M=128, BLOCK_N=64, NUM_WARPS=8, STAGES=4, ROW_GROUPS=4))]
    if target.sm >= 90:
        cases.append((d128, dict(base, BLOCK_M=64, BLOCK_N=128, NUM_WARPS=8, STAGES=2,
                                 ROW_GROUPS=4, CLUSTER=2)))
    for problem_, params in cases:
        bad = space.violations(params, problem_, target)
        if bad and target.smem_per_block < 128 << 10:
            continue  # 128 rows of d128 (Q, then the merge) pass sm_89's 99 KB
        assert not bad, params
        clean_build(make_candidate(space, params, problem_, target), target)


@pytest.mark.parametrize("arch", ["sm_89", "sm_90a"])
@pytest.mark.parametrize(("head_dim", "paged", "threads"), [(96, True, 128), (80, False, 256),
                                                            (112, True, 64)])
def test_rows_of_no_power_of_two_copies_are_copied_by_index(arch: str, head_dim: int,
                                                            paged: bool, threads: int) -> None:
    """d96 is 12 16-byte copies a row (d80 10, d112 14), which no thread count splits: such
    points copy K and V by index (and were refused before); their registers are bounded by a
    constraint of their own; one compiles with no spill or local memory."""
    space = SearchSpace.load(SPACE)
    target = get_arch(arch)
    problem_ = {"HEAD_DIM": head_dim, "DTYPE": "fp16", "PAGED": paged}
    block_n = 128 if threads == 256 else 64  # 16 keys a warp at least
    params = dict(BLOCK_N=block_n, BLOCK_M=16, NUM_WARPS=threads // 32, STAGES=2, VEC_BYTES=16,
                  L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=2,
                  COMBINE="fused", COMBINE_ITEMS=1, CLUSTER=1, PAGE_STAGING="regs",
                  COMBINE_LAUNCH="stream", ROW_GROUPS=1, MMA="sync")
    assert not space.violations(params, problem_, target)
    cand = make_candidate(space, params, problem_, target)
    assert "constexpr bool COLUMNS = THREADS % ROW_VECS == 0;" in render(cand)
    copies = -(-block_n * head_dim // 8 // threads)
    assert int(cand.derived["ROWS_PER_THREAD"]) == copies  # type: ignore[call-overload]
    clean_build(cand, target)
    many = {**params, "BLOCK_N": 64, "BLOCK_M": 32, "NUM_WARPS": 2, "VEC_BYTES": 8}  # 24 copies
    assert any("copies by index" in b for b in space.violations(
        many, {**problem_, "HEAD_DIM": 96}, target))


def test_merge_slices_fit_where_the_ring_does() -> None:
    """Both merges admit the same points on every target (the ring of at least two tiles of
    16 keys a warp is as large as the slices, and larger than them below 32 rows); the slices
    grow the shared memory past the ring's only at BLOCK_M 32 with two stages of the fewest
    keys per warp, and a merge that cannot fit is refused with its reason."""
    space = SearchSpace.load(SPACE)
    for arch in ("sm_80", "sm_89", "sm_90a"):
        target = get_arch(arch)
        for head_dim in (64, 128):
            problem_ = {"HEAD_DIM": head_dim, "DTYPE": "fp16", "PAGED": True}
            # Clusters (sm_90) follow the slices merge only, a programmatic launch (sm_90) the
            # kernel combine only: compared without them; and with every warp on every row
            # (row groups merge fewer slices, of the group's rows).
            admitted = [p for p in space.admitted(problem_, target)
                        if p["CLUSTER"] == 1 and p["COMBINE_LAUNCH"] == "stream"
                        and p["ROW_GROUPS"] == 1]
            kernel = [p for p in admitted if p["COMBINE"] == "kernel"]  # fused: slices only
            slices = [p for p in kernel if p["MERGE"] == "slices"]
            atomic = [dict(p, MERGE="slices") for p in kernel if p["MERGE"] == "atomic"]
            fused = [dict(p, COMBINE="kernel") for p in admitted
                     if p["COMBINE"] == "fused" and p["COMBINE_ITEMS"] == 1]
            assert fused == slices and all(p["MERGE"] == "slices" for p in fused)
            assert slices and slices == atomic, (arch, head_dim)
            for p in slices:
                env = space.env(p, problem_, target)
                if env["MERGE_BYTES"] > env["RING_BYTES"]:  # type: ignore[operator]
                    assert p["BLOCK_M"] == 32 and p["STAGES"] == 2, p
                    assert p["BLOCK_N"] == 16 * p["NUM_WARPS"], p  # type: ignore[operator]
    small = get_arch("sm_89")  # 99 KB: 8 slices of 32 x (256 + 8) floats do not fit
    big = dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, STAGES=2, VEC_BYTES=16, L2_PREFETCH=0,
               MERGE="slices", SPLIT_POLICY="waves", SPLITS=1, COMBINE="kernel",
               COMBINE_ITEMS=1, CLUSTER=1, PAGE_STAGING="regs", COMBINE_LAUNCH="stream",
               ROW_GROUPS=1, MMA="sync")
    bad = space.violations(big, {"HEAD_DIM": 256, "DTYPE": "fp16", "PAGED": True}, small)
    assert any("the warps' merge fits" in why for why in bad)


def test_split_policies() -> None:
    # waves: whole waves of the GPU's slots; fixed: as asked; both capped by the tiles.
    assert decode_splits("waves", 1, units=8, tiles=512, slots=132) == 16
    assert decode_splits("waves", 2, units=8, tiles=512, slots=264) == 66
    assert decode_splits("waves", 1, units=512, tiles=512, slots=132) == 1
    assert decode_splits("waves", 4, units=1, tiles=10, slots=132) == 10
    assert decode_splits("fixed", 8, units=1, tiles=3, slots=132) == 3
    assert decode_splits("fixed", 10_000, units=1, tiles=10_000, slots=1) == MAX_DECODE_SPLITS
    with pytest.raises(ValueError, match="split policy"):
        decode_splits("auto", 1, units=1, tiles=1, slots=1)


def test_nearest_entry_by_cache_then_batch() -> None:
    entries = [Entry(0, "fp16", 128, True, 1, 4096, 8, 32, kind="decode"),
               Entry(1, "fp16", 128, True, 1, 131072, 1, 32, kind="decode"),
               Entry(2, "fp16", 128, True, 1, 131072, 64, 32, kind="decode")]
    assert nearest_decode(entries, 3000, 1).kernel == 0
    assert nearest_decode(entries, 100_000, 2).kernel == 1
    assert nearest_decode(entries, 100_000, 32).kernel == 2


def _tensors(**over: object) -> dict:
    base = dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.float16),
                k=torch.zeros(10, 16, 2, 64, dtype=torch.float16),
                v=torch.zeros(10, 16, 2, 64, dtype=torch.float16),
                lens=torch.zeros(2, dtype=torch.int32),
                table=torch.zeros(2, 4, dtype=torch.int32))
    base.update(over)
    return base


@pytest.mark.parametrize("over, match", [
    (dict(q=torch.zeros(2, 17, 8, 64, dtype=torch.float16)), "q_len must be at most 16.*forward"),
    (dict(q=torch.zeros(2, 1, 8, 64)), "float16 or bfloat16"),
    (dict(k=torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16)), "share a dtype"),
    (dict(lens=torch.zeros(2, dtype=torch.int64)), "cache_seqlens must be a contiguous int32"),
    (dict(table=torch.zeros(2, 4, dtype=torch.int64)), "block_table must be int32"),
    (dict(q=torch.zeros(2, 1, 7, 64, dtype=torch.float16)), "multiple of kv heads"),
    (dict(k=torch.zeros(10, 16, 2, 32, dtype=torch.float16),
          v=torch.zeros(10, 16, 2, 32, dtype=torch.float16)), "head_dim must be q's"),
])
def test_input_checks_name_what_was_expected(over: dict, match: str) -> None:
    t = _tensors(**over)
    with pytest.raises(ValueError, match=match):
        check_decode_inputs(t["q"], t["k"], t["v"], t["lens"], t["table"])


@pytest.mark.parametrize("paged", [True, False])
def test_input_checks_refuse_strides_past_32_bits(paged: bool) -> None:
    # The kernels' row offsets are 32-bit products; meta tensors hold the strides without
    # the memory (the device is checked last, so the strides are what fails).
    def meta(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=torch.float16, device="meta")
    q = meta((2, 1, 8, 64), (512, 512, 64, 1))
    lens = torch.zeros(2, dtype=torch.int32, device="meta")
    table = torch.zeros(2, 4, dtype=torch.int32, device="meta") if paged else None
    far = (2**31, 128, 64, 1) if paged else (2**32, 2**31, 64, 1)
    near = (16 * 128, 128, 64, 1) if paged else (4 * 128, 128, 64, 1)
    shape = (10, 16, 2, 64) if paged else (2, 4, 2, 64)
    with pytest.raises(ValueError, match="k_cache's .*stride.* reach past 2\\^31"):
        check_decode_inputs(q, meta(shape, far), meta(shape, near), lens, table)
    with pytest.raises(ValueError, match="v_cache's .*stride.* reach past 2\\^31"):
        check_decode_inputs(q, meta(shape, near), meta(shape, far), lens, table)
    with pytest.raises(ValueError, match="one CUDA device"):  # the same inputs, near rows
        check_decode_inputs(q, meta(shape, near), meta(shape, near), lens, table)
    with pytest.raises(ValueError, match="one CUDA device"):  # for SDPA: checked at launch
        check_decode_inputs(q, meta(shape, far), meta(shape, near), lens, table,
                            aligned=False)


def test_input_checks_need_a_cuda_device() -> None:
    t = _tensors()
    with pytest.raises(ValueError, match="one CUDA device"):
        check_decode_inputs(t["q"], t["k"], t["v"], t["lens"], t["table"])


def test_reference_agrees_with_sdpa_on_cpu() -> None:
    """The float64 reference and the SDPA baseline on a shuffled paged cache with ragged
    lengths (0, queries that see no key), float32 on the CPU; NaN past each sequence never
    reaches either."""
    gen = torch.Generator().manual_seed(0)
    for paged in (True, False):
        lengths = [0, 3, 700, 131]
        cap = 704 if paged else 700
        k, v, lens, table = validate.decode_cache(4, lengths, cap, 2, 64, torch.float32,
                                                  paged=paged, page_size=64, gen=gen,
                                                  device="cpu")
        assert torch.isnan(k).any()  # poisoned past each sequence
        q = torch.randn(4, 4, 8, 64, generator=gen)
        ref, lse = validate.decode_reference(q, k, v, lens, table)
        base = sdpa_decode(q, k, v, lens, table)
        assert torch.isfinite(ref).all() and torch.isfinite(base).all()
        assert (base.double() - ref).abs().max() < 1e-5
        # no key: the empty sequence, and query 0 of the length-3 one (3 - 4 + 0 + 1 = 0)
        assert int(torch.isneginf(lse).sum()) == 4 * 8 + 8
        assert bool((ref[0] == 0).all())
        verdict = validate.judge(base, ref, base, lse=None, ref_lse=lse)
        assert verdict.ok


def test_plan_covers_ragged_and_own_length() -> None:
    w = DecodeWorkload(64, 4, 64, 8, 128, 131072)
    ragged, own = validate.decode_plan(w)
    assert 0 in ragged.lengths and ragged.lengths[1] < w.q_len
    assert ragged.capacity % 64 == 0 and ragged.heads == 2 * 8
    assert max(own.lengths) == w.cache_len and len(set(own.lengths)) == 2
    assert len(own.lengths) * own.heads * w.q_len * w.cache_len <= validate.MAX_REFERENCE_SCORES


DECODE_POINT = dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=3, VEC_BYTES=16,
                    L2_PREFETCH=256, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
                    COMBINE="kernel", COMBINE_ITEMS=1, CLUSTER=1,
                    PAGE_STAGING="regs", COMBINE_LAUNCH="stream", ROW_GROUPS=1, MMA="sync")


def decode_store(db: object, arch: str, workloads: list[DecodeWorkload]) -> None:
    """A store whose decode elites are DECODE_POINT, one per workload (tests/gpu too)."""
    from evoengine.store import Store

    space = SearchSpace.load(SPACE)
    target = get_arch(arch)
    with Store(f"sqlite:///{db}") as store:
        for w in workloads:
            cand = make_candidate(space, DECODE_POINT, w.problem(), target)
            if store.candidate(cand.identity) is None:
                store.add_candidate(identity=cand.identity, family=cand.family,
                                    template_hash=cand.template_hash, params=cand.params,
                                    problem=cand.problem, source=render(cand))
            run = store.start_run(arch=target.name, workload=w.to_dict(), workload_key=w.key(),
                                  device="test", study="decode-test")
            store.set_elites(arch=target.name, workload_key=w.key(),
                             entries=[(cand.identity, 50.0)], run_id=run)


def test_export_carries_attention_decode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from evoengine.export import export_best

    workloads = [DecodeWorkload(8, 1, 32, 8, 128, 4096),
                 DecodeWorkload(1, 1, 32, 8, 128, 131072)]
    decode_store(tmp_path / "evo.db", "sm_90a", workloads)
    done = export_best(str(tmp_path / "evo.db"), "sm_90a", output=tmp_path / "tuned.py")
    text = done.path.read_text()
    assert "attention_decode = TunedDecode(attention.kernels, DISPATCH)" in text
    assert "Decode (sq: q_len, sk: cache length):" in text
    entries = [line for line in text.splitlines() if line.startswith("    Entry(")]
    assert len(entries) == 2 and all("kind='decode'" in e for e in entries)  # one per win
    compile(text, "tuned.py", "exec")


def test_tune_plans_decode_steps_of_a_model() -> None:
    from evoengine.geometry import ModelGeometry

    g = ModelGeometry(heads=32, head_dim=128, kv_heads=8, dtype="bf16", max_seq=131072)
    calls = Decode().tune_workloads(g)
    assert [(w.batch, w.cache_len) for w in calls] == [
        (1, 4096), (8, 4096), (1, 32768), (8, 32768), (1, 131072), (8, 131072)]
    assert all(w.q_len == 1 and w.paged and w.dtype == "bf16" and w.kv_heads == 8
               for w in calls)
    short = Decode().tune_workloads(ModelGeometry(heads=8, head_dim=64, max_seq=2048))
    assert [w.cache_len for w in short] == [2048, 2048]


def test_launcher_and_template_agree_on_the_combine_block() -> None:
    """The launcher launches attn_decode_combine with DECODE_COMBINE_THREADS threads; the
    template's __launch_bounds__ and row mapping take cfg::COMBINE_THREADS."""
    import re

    from evoengine.launch.decode import DECODE_COMBINE_THREADS, DECODE_ENTRIES

    space = SearchSpace.load(SPACE)
    cand = make_candidate(space, DECODE_POINT, {"HEAD_DIM": 64, "DTYPE": "fp16", "PAGED": True},
                          get_arch("sm_90a"))
    source = render(cand)
    m = re.search(r"constexpr int COMBINE_THREADS = (\d+);", source)
    assert m is not None and int(m.group(1)) == DECODE_COMBINE_THREADS
    for entry in DECODE_ENTRIES:
        assert 'extern "C" __global__ void __launch_bounds__' in source and f"\n{entry}(" in source


class _FakeDriver:
    """Stands in for cuLaunchKernel: records each launch's entry and, for the main kernel,
    the counters argument and what the counters held at launch; the main kernel's grid x (its
    splits) and the combine kernel's parts argument."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int, list[int] | None]] = []
        self.splits: list[int] = []
        self.parts: list[int] = []

    def __call__(self, loaded: object, args: tuple) -> None:
        import ctypes

        fn, argv = args[0], ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
        if fn == 1:  # the main kernel: its 8th argument is the counters' address
            (address,) = struct.unpack("=Q", ctypes.string_at(argv[7], 8))
            held = list((ctypes.c_int32 * 4).from_address(address)) if address else None
            self.launches.append(("main", address, held))
            self.splits.append(args[1])
        else:  # the combine: its 8th argument is the number of parts
            self.launches.append(("combine", 0, None))
            (n,) = struct.unpack("=i", ctypes.string_at(argv[7], 4))
            self.parts.append(n)


def _fake_decode(combine: str, monkeypatch: pytest.MonkeyPatch, stream: list[int],
                 cluster: int = 1) -> tuple[CudaDecode, _FakeDriver]:
    import evoengine.launch.decode as launch_decode
    from evoengine.launch.core import Loaded

    k = CudaDecode("d", head_dim=128, dtype="fp16", paged=False, block_m=16, block_n=64,
                   threads=128, smem_bytes=1024, split_policy="fixed", splits=4,
                   combine=combine, cluster=cluster, arch="sm_90a", cubin=b"x")
    fake = _FakeDriver()
    monkeypatch.setattr(launch_decode, "launch_in_context", fake)
    monkeypatch.setattr(launch_decode, "raw_stream", lambda index: stream[0])
    # CPU tensors are device index -1; only the fields the launch reads are filled in.
    k.main._loaded[-1] = Loaded(1, 0, lambda *a: None, lambda: 0, lambda c: None, None)
    k.combine._loaded[-1] = Loaded(2, 0, lambda *a: None, lambda: 0, lambda c: None, None)
    k._slots[-1] = 132
    return k, fake


def _launch(k: CudaDecode) -> None:
    """One launch of a faked kernel (``_fake_decode``) on CPU tensors: batch 2, q_len 1, 8/2
    heads, a contiguous cache of 4096 keys."""
    q = torch.zeros(2, 1, 8, 128, dtype=torch.float16)
    cache = torch.zeros(2, 4096, 2, 128, dtype=torch.float16)
    lens = torch.full((2,), 4096, dtype=torch.int32)
    shape = DecodeShape(batch=2, q_len=1, q_heads=8, kv_heads=2, head_dim=128, paged=False,
                        page_size=0, capacity=4096, num_pages=0)
    k.launch(q, cache, cache, lens, None, torch.empty_like(q), None, shape, causal=True,
             scale=0.1)


@pytest.mark.parametrize("combine", ["kernel", "fused"])
def test_the_fused_combine_launches_once_with_the_streams_zeroed_counters(
        combine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's side of the ABI, on CPU tensors with the driver faked: with several
    splits a fused kernel is one launch given its stream's counters (zero, the same set on
    every launch of that stream, another set on another stream), a kernel combine two
    launches and no counters; with one split, one launch and no counters either way."""
    stream = [7001]
    k, fake = _fake_decode(combine, monkeypatch, stream)
    for s in (7001, 7001, 7002):
        stream[0] = s
        _launch(k)
    if combine == "kernel":
        assert [e for e, _, _ in fake.launches] == ["main", "combine"] * 3
        assert all(address == 0 for e, address, _ in fake.launches if e == "main")
    else:
        assert [e for e, _, _ in fake.launches] == ["main"] * 3
        first, again, other = (address for _, address, _ in fake.launches)
        assert first != 0 and first == again and other not in (0, first)
        assert all(held == [0, 0, 0, 0] for _, _, held in fake.launches)
    fake.launches.clear()
    k.splits = 1
    _launch(k)
    assert fake.launches == [("main", 0, None)]
    with pytest.raises(ValueError, match="combine must be one of"):
        CudaDecode("d", head_dim=128, dtype="fp16", paged=False, block_m=16, block_n=64,
                   threads=128, smem_bytes=1024, split_policy="fixed", splits=4,
                   combine="atomic")


def test_a_wave_of_clusters_is_the_clusters_that_fit() -> None:
    """The waves policy in clusters counts the clusters the driver says fit (they stay inside a
    GPC), so that every cluster of a wave is resident at once: on the H100's 132 SMs 30 of 4 and
    15 of 8, whose splits for 8 groups (batch 1, 8 KV heads) make 24 and 8 clusters. Without a
    driver's answer (no GPU here: None, not an exception) the blocks' count stands."""
    from evoengine.launch.decode import resident_clusters, wave_slots

    assert wave_slots(132, 30, 4) == 120 and wave_slots(132, 15, 8) == 120
    assert wave_slots(132, None, 4) == 132 and wave_slots(132, 40, 1) == 132
    assert wave_slots(64, 30, 4) == 64  # never more than the blocks that fit
    for cluster, clusters in ((4, 30), (8, 15)):
        splits = cluster_splits(decode_splits("waves", 1, units=8, tiles=256,
                                              slots=wave_slots(132, clusters, cluster)), cluster)
        assert 8 * splits // cluster <= clusters
    assert cluster_splits(decode_splits("waves", 1, units=8, tiles=256,
                                        slots=wave_slots(132, 30, 4)), 4) == 12
    assert resident_clusters(0, 256, 1024, 4) is None


def test_cluster_splits_are_whole_clusters() -> None:
    assert cluster_splits(16, 8) == 16
    assert cluster_splits(17, 8) == 16  # rounded down: a partial cluster cannot launch
    assert cluster_splits(5, 8) == 8  # at least one cluster; its empty splits merge as nothing
    assert cluster_splits(3, 2) == 2
    assert cluster_splits(7, 1) == 7


@pytest.mark.parametrize("combine", ["kernel", "fused"])
def test_a_cluster_writes_one_part(combine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's side of CLUSTER, driver faked: the grid's splits are whole clusters, and
    what goes to the combine is a part per cluster: with one cluster, the output itself (one
    launch, no counters); with several, a combine over the clusters' parts."""
    stream = [7001]
    k, fake = _fake_decode(combine, monkeypatch, stream, cluster=8)
    _launch(k)  # 4 splits -> 8
    assert fake.launches == [("main", 0, None)] and fake.splits == [8]
    fake.launches.clear()
    k.splits = 20  # -> 16 splits, two clusters' parts
    _launch(k)
    assert fake.splits == [8, 16]
    if combine == "kernel":
        assert [e for e, _, _ in fake.launches] == ["main", "combine"] and fake.parts == [2]
    else:
        assert [e for e, _, _ in fake.launches] == ["main"] and fake.launches[0][1] != 0


def test_clusters_build_on_sm90_only() -> None:
    """CLUSTER > 1 (an [untested] value until its GPU tests pass) is sm_90's, after the slices
    merge; on sm_90a it compiles without spills or local memory for both combines, with the
    cluster shape in the kernel's declaration, which CLUSTER 1 leaves as it was."""
    space = SearchSpace.load(SPACE).with_untested()
    base = dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, STAGES=2, VEC_BYTES=16, L2_PREFETCH=0,
                MERGE="slices", SPLIT_POLICY="waves", SPLITS=1, CLUSTER=4)
    problem_ = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    fused = space.complete(dict(base, COMBINE="fused", COMBINE_ITEMS=4))
    assert any("sm_90" in why for why in space.violations(fused, problem_, get_arch("sm_89")))
    atomic = dict(fused, MERGE="atomic", COMBINE="kernel", COMBINE_ITEMS=1)
    assert any("slices merge" in why
               for why in space.violations(atomic, problem_, get_arch("sm_90a")))
    target = get_arch("sm_90a")
    for params in (fused, dict(fused, COMBINE="kernel", COMBINE_ITEMS=1, CLUSTER=8),
                   dict(fused, BLOCK_M=16, NUM_WARPS=4, BLOCK_N=64, STAGES=4, CLUSTER=2)):
        cand = make_candidate(space, params, problem_, target)
        assert "__cluster_dims__(cfg::CLUSTER, 1, 1)" in render(cand)
        clean_build(cand, target)
    plain = make_candidate(space, dict(fused, CLUSTER=1), problem_, target)
    assert "__cluster_dims__" not in render(plain)


def test_a_cluster_pushes_its_rows_with_no_gpu_wide_fence() -> None:
    """In a cluster each block sends its merged rows to the block that merges them by st.async
    (SASS STAS), counted on that block's mbarrier (SYNCS), and no barrier arrival releases
    memory: a release at cluster scope compiles to a GPU-wide MEMBAR, which the pulled merge
    before 2026-11-29 paid once a block. Clusters of 2 and 8, rows of 16 and 32, the kernel
    combine (the fused one's hand-over keeps its __threadfence)."""
    from tests.test_backward import CUOBJDUMP

    space = SearchSpace.load(SPACE).with_untested()
    problem_ = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    target = get_arch("sm_90a")
    base = dict(BLOCK_N=128, VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves",
                SPLITS=1, COMBINE="kernel", COMBINE_ITEMS=1)
    for cluster, rows in ((2, dict(BLOCK_M=32, NUM_WARPS=8, ROW_GROUPS=2, STAGES=3)),
                          (8, dict(BLOCK_M=16, NUM_WARPS=4, STAGES=3))):
        cand = make_candidate(space, space.complete(dict(base, CLUSTER=cluster, **rows)),
                              problem_, target)
        ops = clean_build(cand, target)
        if CUOBJDUMP is not None:
            assert "STAS" in ops and "SYNCS" in ops, cand.identity
            assert "MEMBAR" not in ops, cand.identity


def test_the_cooperative_combine_launches_cooperatively(monkeypatch: pytest.MonkeyPatch) -> None:
    """COMBINE "cooperative", driver faked: with several splits one cooperative launch (every
    block resident) given two zeroed counters a group from its stream's set; with one split an
    ordinary launch and no counters."""
    import evoengine.launch.decode as launch_decode

    stream = [7001]
    k, fake = _fake_decode("cooperative", monkeypatch, stream)
    cooperative: list[int] = []

    def coop(loaded: object, args: tuple) -> None:
        cooperative.append(len(args))
        fake(loaded, (*args, 0))
    monkeypatch.setattr(launch_decode, "launch_cooperative_in_context", coop)
    _launch(k)
    assert cooperative == [10]  # no `extra`: cuLaunchCooperativeKernel's arguments
    ((entry, address, held),) = fake.launches
    assert entry == "main" and address != 0 and held == [0, 0, 0, 0]
    assert list((ctypes.c_int32 * 8).from_address(address)) == [0] * 8  # 2 groups x 2 each
    fake.launches.clear()
    k.splits = 1
    _launch(k)
    assert fake.launches == [("main", 0, None)] and cooperative == [10]


def test_the_cooperative_combine_builds_for_one_wave_of_every_target() -> None:
    """COMBINE "cooperative" (its GPU tests: tests/gpu/test_decode.py) compiles without
    spills on every target; the space keeps it to the waves policy's one wave (a cooperative
    launch must fit the GPU at once), after the slices merge and without clusters."""
    space = SearchSpace.load(SPACE).with_untested()
    problem_ = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    params = space.complete(dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=2, VEC_BYTES=16,
                                 L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
                                 COMBINE="cooperative", COMBINE_ITEMS=1))
    for arch in ("sm_80", "sm_89", "sm_90a"):
        cand = make_candidate(space, params, problem_, get_arch(arch))
        assert "COMBINE_COOP = true;" in render(cand)
        result = compile_candidate(cand, get_arch(arch))
        assert result.ok, result.error
        assert result.spill_bytes == 0, (arch, cand.identity)
    target = get_arch("sm_90a")
    for bad in (dict(params, SPLIT_POLICY="fixed"), dict(params, SPLITS=2),
                dict(params, CLUSTER=2), dict(params, MERGE="atomic")):
        assert space.violations(bad, problem_, target), bad


def test_the_programmatic_combine_launch_waits_for_the_main_kernel() -> None:
    """COMBINE_LAUNCH "programmatic" is the kernel combine's on sm_90: the main kernel lets its
    dependents launch (griddepcontrol.launch_dependents, SASS PREEXIT) and the combine waits for
    its completion (griddepcontrol.wait, ACQBULK) before reading a part; "stream" builds
    neither. Refused elsewhere with the reason."""
    from tests.test_backward import CUOBJDUMP, sass_opcodes

    space = SearchSpace.load(SPACE).with_untested()
    problem_ = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    params = space.complete(dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, STAGES=3, VEC_BYTES=16,
                                 L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
                                 COMBINE="kernel", COMBINE_ITEMS=1, CLUSTER=2,
                                 COMBINE_LAUNCH="programmatic"))
    target = get_arch("sm_90a")
    assert not space.violations(params, problem_, target)
    for bad, arch in ((dict(params, CLUSTER=1), "sm_89"), (dict(params, COMBINE="fused"), "sm_90a"),
                      (dict(params, COMBINE="cooperative", CLUSTER=1), "sm_90a")):
        assert any("programmatic launch" in why
                   for why in space.violations(bad, problem_, get_arch(arch))), bad
    for launch in ("programmatic", "stream"):
        cand = make_candidate(space, dict(params, COMBINE_LAUNCH=launch), problem_, target)
        assert (f"COMBINE_PDL = {'true' if launch == 'programmatic' else 'false'};"
                in render(cand))
        clean_build(cand, target)
        if CUOBJDUMP is not None:
            cubin = compile_candidate(cand, target).cubin or b""
            main = sass_opcodes(cubin, "attn_decode")
            combine = sass_opcodes(cubin, "attn_decode_combine")
            assert ("PREEXIT" in main) == ("ACQBULK" in combine) == (launch == "programmatic")
            if launch == "programmatic":
                assert merges_dry_before_the_wait(cubin)
                assert loads_in_one_run(cubin) >= 16, "8 LSEs and 8 parts with no branch between"


def combine_sass(cubin: bytes) -> str:
    from tests.test_backward import sass_text

    return sass_text(cubin, "attn_decode_combine")


def loads_in_one_run(cubin: bytes) -> int:
    """The most global loads of the combine kernel (its called function included) with no
    branch, call or return between them: a merge of up to 8 splits with all its loads in
    flight at once has at least 16 in one run (8 LSEs, 8 parts)."""
    best = run = 0
    for line in combine_sass(cubin).splitlines():
        if " BRA " in line or "CALL.REL" in line or "RET.REL" in line:
            run = 0
        elif "LDG.E" in line:
            run += 1
            best = max(best, run)
    return best


def merges_dry_before_the_wait(cubin: bytes) -> bool:
    """Whether the programmatic combine's last call before its griddepcontrol.wait (ACQBULK)
    and its first after it go to one function: its merge run dry before the wait and for real
    after it, the same instructions."""
    lines = [line for line in combine_sass(cubin).splitlines()
             if "ACQBULK" in line or "CALL.REL" in line]
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    before = [line.split("CALL.REL.NOINC")[1].split(";")[0].strip()
              for line in lines[:wait] if "CALL.REL" in line]
    after = [line.split("CALL.REL.NOINC")[1].split(";")[0].strip()
             for line in lines[wait + 1:] if "CALL.REL" in line]
    return bool(before) and bool(after) and before[-1] == after[0]


def test_a_programmatic_combine_spreads_over_the_sms() -> None:
    """The shared memory a programmatic combine asks for holds an SM to ceil(blocks / SMs) of
    its blocks (the runtime keeps 1 KB a block besides), none where the threads hold it there."""
    from evoengine.launch.decode import combine_spread_smem

    sm = 233472  # sm_90's 228 KB an SM
    for blocks in (1, 8, 32, 132, 133, 256, 500, 1000):
        smem = combine_spread_smem(blocks, 132, sm)
        cap = -(-blocks // 132)
        if cap * 256 >= 2048:
            assert smem == 0
            continue
        assert cap * (smem + 1024) <= sm < (cap + 1) * smem, blocks
    assert combine_spread_smem(32, 132, sm) == sm // 2 + 1


def test_the_programmatic_combine_launch_is_the_main_kernels_dependent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's side of COMBINE_LAUNCH, driver faked: "programmatic" launches the combine
    through cuLaunchKernelEx with programmatic serialization (no ``extra``), the main kernel as
    before; with one split, no combine at all. The launcher refuses it beside another combine."""
    import evoengine.launch.decode as launch_decode

    stream = [7001]
    k, fake = _fake_decode("kernel", monkeypatch, stream)
    k.programmatic = True
    programmatic: list[int] = []

    def pdl(loaded: object, args: tuple) -> None:
        programmatic.append(len(args))
        smem.append(args[7])
        fake(loaded, (*args, 0))
    smem: list[int] = []
    monkeypatch.setattr(launch_decode, "launch_programmatic_in_context", pdl)
    monkeypatch.setattr(launch_decode, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_decode, "sm_shared_memory", lambda index: 233472)
    _launch(k)
    assert [e for e, _, _ in fake.launches] == ["main", "combine"] and programmatic == [10]
    assert smem == [233472 // 2 + 1]  # 2 blocks on 132 SMs: one an SM at most
    assert fake.parts == [4]
    fake.launches.clear()
    k.splits = 1
    _launch(k)
    assert fake.launches == [("main", 0, None)] and programmatic == [10]
    with pytest.raises(ValueError, match="'programmatic' only with the kernel combine"):
        CudaDecode("d", head_dim=128, dtype="fp16", paged=False, block_m=16, block_n=64,
                   threads=128, smem_bytes=1024, split_policy="fixed", splits=4,
                   combine="fused", combine_launch="programmatic")


def test_flashinfer_is_an_anchor_that_steps_aside_where_it_does_not_import(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """FlashInfer is one of decode's anchors; where its wheel (or its JIT toolchain) does not
    import, its timing is None with one line said, and no set is touched."""
    from evoengine.problems import decode as decode_mod

    assert "flashinfer" in decode_mod.Decode.anchors
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    decode_mod.flashinfer_module.cache_clear()
    try:
        w = decode_mod.DecodeWorkload(batch=1, q_len=1, q_heads=32, kv_heads=8, head_dim=128,
                                      cache_len=4096, layout="paged", page_size=64,
                                      dtype="fp16")
        assert decode_mod.Decode().time_anchor("flashinfer", w, []) is None
        assert decode_mod.time_flashinfer_decode(w, []) is None
    finally:
        decode_mod.flashinfer_module.cache_clear()
    assert capsys.readouterr().err.count("FlashInfer not timed") == 1


def test_wgmma_builds_without_spills() -> None:
    """MMA "wgmma" runs S and P.V as wgmma m64 per warpgroup: refused off sm_90a, with rows a
    warp other than 16 and with head dims of partial 128-byte panels; on sm_90a one and two
    warpgroups of rows and of keys, both merges, the fused combine and a cluster build without
    spills, local memory or serialized wgmmas, and issue wgmma (HGMMA) where cuobjdump is
    found."""
    space = SearchSpace.load(SPACE).with_untested()
    hopper = get_arch("sm_90a")
    d128 = {"HEAD_DIM": 128, "DTYPE": "bf16", "PAGED": True}
    base = dict(VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
                COMBINE="kernel", COMBINE_ITEMS=1, CLUSTER=1, PAGE_STAGING="regs",
                COMBINE_LAUNCH="stream", MMA="wgmma")
    rows64 = dict(base, BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, ROW_GROUPS=4, STAGES=3)
    assert not space.violations(rows64, d128, hopper)
    assert any("wgmma is sm_90a's" in why
               for why in space.violations(rows64, d128, get_arch("sm_89")))
    assert any("wgmma is sm_90a's" in why
               for why in space.violations(dict(rows64, BLOCK_M=128), d128, hopper))
    assert any("wgmma is sm_90a's" in why for why in space.violations(
        rows64, dict(d128, HEAD_DIM=96), hopper))
    cases = [(d128, rows64),
             (d128, dict(base, BLOCK_M=128, BLOCK_N=128, NUM_WARPS=8, ROW_GROUPS=8, STAGES=2)),
             (dict(d128, DTYPE="fp16", PAGED=False),
              dict(base, BLOCK_M=64, BLOCK_N=32, NUM_WARPS=8, ROW_GROUPS=4, STAGES=4,
                   MERGE="atomic")),
             ({"HEAD_DIM": 64, "DTYPE": "fp16", "PAGED": True},
              dict(base, BLOCK_M=128, BLOCK_N=64, NUM_WARPS=8, ROW_GROUPS=8, STAGES=4,
                   COMBINE="fused", COMBINE_ITEMS=2, CLUSTER=2, PAGE_STAGING="smem"))]
    for problem_, params in cases:
        assert not space.violations(params, problem_, hopper), params
        cand = make_candidate(space, params, problem_, hopper)
        ops = clean_build(cand, hopper)
        assert not ops or "HGMMA" in ops
        # ptxas keeps the wgmmas pipelined (no C7514-style serialization warning)
        assert compile_candidate(cand, hopper).serialized is None, cand.identity
