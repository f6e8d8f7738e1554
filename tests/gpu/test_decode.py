"""The decode family against the float64 reference on a real GPU, and its dispatcher.

Fresh random inputs per check (``validate.check_decode``): pages shuffled in memory,
everything past a sequence's length NaN, ragged lengths with 0 and queries that see no key,
lengths no multiple of a tile or a page, GQA 32/8 and 64/8 and MQA, q_len 1, 4 and 16, one
split and many (the combine), contiguous and paged caches; the warps splitting the keys only,
and the rows first (ROW_GROUPS; 128 rows a block at q_len 16); every point with both merges of
the warps (MERGE: slices, and the legacy atomics) and, after the slices merge, both combines of
the splits (COMBINE: the combine kernel, and fused into the last block of each group, merging
one or several quads a thread at once: COMBINE_ITEMS); on sm_90, the splits in thread block
clusters that merge through distributed shared memory (CLUSTER), with one cluster of every
split and several, and clusters whose splits outnumber the cache's tiles, and the combine
kernel launched as the main kernel's programmatic dependent (COMBINE_LAUNCH); paged, the tiles'
page numbers staged in shared memory (PAGE_STAGING "smem") as well as in registers; on sm_90a,
S and P.V on wgmma (MMA "wgmma") with every merge, combine and a cluster.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from evoengine import paths, validate
from evoengine.compile import compile_many
from evoengine.decode import DecodeKernel
from evoengine.launch.decode import TunedDecode, sdpa_decode
from evoengine.launch.dispatch import Entry
from evoengine.problems.decode import Decode, DecodeWorkload
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import gpu_arch
from evoengine.space import SearchSpace

# Hand-picked points: one split and many, every tile and ring depth, both copy widths, one
# and two m16 row tiles, 2 to 8 warps, each L2 prefetch hint; each is built with both MERGE
# values (the test's parameter).
POINTS = [
    dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=4, VEC_BYTES=16, L2_PREFETCH=256,
         SPLIT_POLICY="waves", SPLITS=2),
    dict(BLOCK_N=32, BLOCK_M=32, NUM_WARPS=2, STAGES=2, VEC_BYTES=8, L2_PREFETCH=128,
         SPLIT_POLICY="fixed", SPLITS=1),
    dict(BLOCK_N=128, BLOCK_M=16, NUM_WARPS=8, STAGES=3, VEC_BYTES=16, L2_PREFETCH=0,
         SPLIT_POLICY="fixed", SPLITS=32),
    dict(BLOCK_N=256, BLOCK_M=16, NUM_WARPS=4, STAGES=2, VEC_BYTES=16, L2_PREFETCH=256,
         SPLIT_POLICY="waves", SPLITS=4),
]
# Rows split over the warps first (ROW_GROUPS): 16 and 32 rows a warp, one to four key warps a
# group, up to 128 rows a block; each is built with both MERGE values.
ROW_POINTS = [
    dict(BLOCK_N=64, BLOCK_M=32, NUM_WARPS=8, ROW_GROUPS=2, STAGES=3, VEC_BYTES=16,
         L2_PREFETCH=0, SPLIT_POLICY="waves", SPLITS=1),
    dict(BLOCK_N=64, BLOCK_M=64, NUM_WARPS=4, ROW_GROUPS=4, STAGES=2, VEC_BYTES=16,
         L2_PREFETCH=0, SPLIT_POLICY="fixed", SPLITS=8),
    dict(BLOCK_N=128, BLOCK_M=128, NUM_WARPS=8, ROW_GROUPS=8, STAGES=2, VEC_BYTES=16,
         L2_PREFETCH=0, SPLIT_POLICY="waves", SPLITS=2),
    dict(BLOCK_N=64, BLOCK_M=64, NUM_WARPS=8, ROW_GROUPS=2, STAGES=4, VEC_BYTES=8,
         L2_PREFETCH=128, SPLIT_POLICY="fixed", SPLITS=4),
]
# S and P.V on wgmma (MMA "wgmma", sm_90a): one and two warpgroups of rows, one and two of keys
# (64 and 16 keys a warpgroup: wgmma n64 and n16), up to 128 rows a block.
WGMMA_POINTS = [
    dict(BLOCK_N=64, BLOCK_M=64, NUM_WARPS=4, ROW_GROUPS=4, STAGES=3, VEC_BYTES=16,
         L2_PREFETCH=0, SPLIT_POLICY="waves", SPLITS=1),
    dict(BLOCK_N=128, BLOCK_M=128, NUM_WARPS=8, ROW_GROUPS=8, STAGES=2, VEC_BYTES=16,
         L2_PREFETCH=0, SPLIT_POLICY="waves", SPLITS=2),
    dict(BLOCK_N=128, BLOCK_M=64, NUM_WARPS=8, ROW_GROUPS=4, STAGES=2, VEC_BYTES=16,
         L2_PREFETCH=256, SPLIT_POLICY="fixed", SPLITS=8),
    dict(BLOCK_N=32, BLOCK_M=64, NUM_WARPS=8, ROW_GROUPS=4, STAGES=4, VEC_BYTES=8,
         L2_PREFETCH=128, SPLIT_POLICY="fixed", SPLITS=4),
]
# (lengths, q_len, heads, kv_heads, page_size)
CASES = [
    ((0, 3, 700, 1531), 4, 8, 2, 64),    # ragged, a sequence with no key, queries with none
    ((1, 129, 4099), 1, 32, 8, 16),      # GQA 32/8, pages smaller than a tile
    ((5000, 17), 4, 64, 8, 256),         # GQA 64/8: two m16 tiles of rows per head at q_len 4
    ((333,), 16, 4, 1, 64),              # MQA, q_len 16
    ((65, 2000, 0), 1, 16, 16, 32),      # MHA
]


def check_cases(ks: list[DecodeKernel], head_dim: int, dtype: torch.dtype, paged: bool,
                cases: list[tuple] = CASES) -> None:
    """The criterion (``validate.check_decode``, fresh inputs) on every kernel and case."""
    for kernel in ks:
        for lengths, q_len, heads, kv, page in cases:
            capacity = max(lengths)
            if paged:
                capacity = -(-capacity // page) * page
            v = validate.check_decode(kernel, lengths=list(lengths), capacity=capacity,
                                      q_len=q_len, heads=heads, kv_heads=kv,
                                      head_dim=head_dim, dtype=dtype, paged=paged,
                                      page_size=page, seed=len(lengths) * 1000 + q_len)
            assert v.ok, f"{kernel.name} {lengths} q{q_len} {heads}/{kv}: {v.reason}"


@functools.cache
def space() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "decode.toml").with_untested()


@functools.cache
def kernels(head_dim: int, dtype: str, paged: bool, merge: str = "slices",
            combine: str = "kernel", items: int = 1, cluster: int = 1,
            one_wave: bool = False, staging: str = "regs",
            launch: str = "stream", row_groups: bool = False,
            mma: str = "sync") -> list[DecodeKernel]:
    arch = gpu_arch()
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, PAGED=paged)
    chosen = WGMMA_POINTS if mma == "wgmma" else ROW_POINTS if row_groups else POINTS
    points = [space().complete(dict(p, MERGE=merge, COMBINE=combine, COMBINE_ITEMS=items,
                                    CLUSTER=cluster, PAGE_STAGING=staging,
                                    COMBINE_LAUNCH=launch, MMA=mma))
              for p in chosen]
    if one_wave:  # the cooperative combine's policy (and its twins')
        points = [dict(p, SPLIT_POLICY="waves", SPLITS=1) for p in points]
    cands: list[Candidate] = [make_candidate(space(), p, problem, arch) for p in points
                              if not space().violations(p, problem, arch)]
    return [DecodeKernel(c, r) for c, r in zip(cands, compile_many(cands, arch), strict=True)]


@pytest.mark.parametrize("merge, combine, items", [
    ("slices", "kernel", 1), ("atomic", "kernel", 1), ("slices", "fused", 1),
    ("slices", "fused", 2), ("slices", "fused", 4)])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_decode_criterion(head_dim: int, dtype: str, paged: bool, merge: str,
                          combine: str, items: int) -> None:
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ks = kernels(head_dim, dtype, paged, merge, combine, items)
    assert ks
    check_cases(ks, head_dim, torch_dtype, paged)


# Many rows a KV head (128 at q_len 16 with 64/8, which 128-row blocks take at once), and a
# row count that fills no m16 tile of any group (15: q_len 3 of a group of 5).
ROW_CASES = [((3000, 77, 0), 16, 64, 8, 64), ((900, 4100), 3, 40, 8, 16)]


@pytest.mark.parametrize("merge, combine, items, cluster", [
    ("slices", "kernel", 1, 1), ("atomic", "kernel", 1, 1), ("slices", "fused", 2, 1),
    ("slices", "cooperative", 1, 1), ("slices", "kernel", 1, 2)])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_row_groups(head_dim: int, paged: bool, merge: str, combine: str, items: int,
                    cluster: int) -> None:
    if cluster > 1 and gpu_arch().sm < 90:
        pytest.skip("thread block clusters are sm_90's")
    ks = kernels(head_dim, "bf16", paged, merge, combine, items, cluster,
                 one_wave=combine == "cooperative", row_groups=True)
    assert len(ks) >= 2
    check_cases(ks, head_dim, torch.bfloat16, paged, CASES + ROW_CASES)


@pytest.mark.parametrize("merge, combine, items, cluster, staging", [
    ("slices", "kernel", 1, 1, "regs"), ("atomic", "kernel", 1, 1, "smem"),
    ("slices", "fused", 2, 1, "regs"), ("slices", "cooperative", 1, 1, "regs"),
    ("slices", "kernel", 1, 2, "smem")])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_wgmma(head_dim: int, dtype: str, paged: bool, merge: str, combine: str, items: int,
               cluster: int, staging: str) -> None:
    if gpu_arch().sm < 90:
        pytest.skip("wgmma is sm_90a's")
    staging = staging if paged else "regs"
    ks = kernels(head_dim, dtype, paged, merge, combine, items, cluster,
                 one_wave=combine == "cooperative", staging=staging, mma="wgmma")
    assert len(ks) >= 3
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    check_cases(ks, head_dim, torch_dtype, paged, CASES + ROW_CASES)


@pytest.mark.parametrize("combine, items", [("kernel", 1), ("fused", 4)])
@pytest.mark.parametrize("cluster", [2, 8])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_clusters(head_dim: int, dtype: str, paged: bool, cluster: int, combine: str,
                  items: int) -> None:
    """CLUSTER on every point and case: one split (fixed 1) becomes one cluster whose blocks
    past the cache's tiles see no key; 32 fixed splits are 16, 8 or 4 clusters' parts; the
    waves points' splits are rounded down to whole clusters."""
    if gpu_arch().sm < 90:
        pytest.skip("thread block clusters are sm_90's")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ks = kernels(head_dim, dtype, paged, "slices", combine, items, cluster)
    assert ks
    assert all(kernel.cluster == cluster for kernel in ks)
    check_cases(ks, head_dim, torch_dtype, paged)


@pytest.mark.parametrize("merge, combine, items, cluster", [
    ("slices", "kernel", 1, 1), ("atomic", "kernel", 1, 1), ("slices", "fused", 4, 1),
    ("slices", "fused", 1, 2), ("slices", "cooperative", 1, 1)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_page_staging(head_dim: int, dtype: str, merge: str, combine: str, items: int,
                      cluster: int) -> None:
    """PAGE_STAGING "smem" on every point and case: pages of 16 to 256 keys, smaller than a
    tile (several a tile's slot), as large and larger (one), with both merges and combines,
    and in clusters (sm_90)."""
    if cluster > 1 and gpu_arch().sm < 90:
        pytest.skip("thread block clusters are sm_90's")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ks = kernels(head_dim, dtype, True, merge, combine, items, cluster,
                 one_wave=combine == "cooperative", staging="smem")
    assert ks and all(k.candidate.params["PAGE_STAGING"] == "smem" for k in ks)
    check_cases(ks, head_dim, torch_dtype, True)


@pytest.mark.parametrize("staging", ["regs", "smem"])
def test_pages_of_a_few_keys(staging: str) -> None:
    """Pages of 1, 2 and 8 keys (a token-level page table, as some servers keep): every key row
    of a tile in a page of its own, on every point, q_len 1 and 4, GQA 32/8, ragged with 0."""
    ks = kernels(128, "fp16", True, "slices", "fused", staging=staging)
    assert ks
    check_cases(ks, 128, torch.float16, True, [((0, 3, 700, 1531), 4, 32, 8, 1),
                                               ((1, 129, 4099), 1, 32, 8, 2),
                                               ((333, 17), 4, 32, 8, 8)])


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_page_staging_is_the_registers_bit_for_bit(page_size: int) -> None:
    """Where the page numbers wait changes no arithmetic: each "smem" point gives its "regs"
    twin's bits (out and lse) on shuffled pages smaller than, as large as and larger than its
    tiles, ragged lengths with 0, one split and many."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    pairs = list(zip(kernels(128, "bf16", True, "slices", "fused", staging="smem"),
                     kernels(128, "bf16", True, "slices", "fused"), strict=True))
    assert pairs
    same_bits(pairs, ((3, [4099, 0, 700], 4, 32), (1, [30000], 1, 64)), torch.bfloat16,
              page_size, gen)


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_programmatic_combine_launch(head_dim: int, dtype: str, paged: bool,
                                         cluster: int) -> None:
    """COMBINE_LAUNCH "programmatic" (sm_90): the combine kernel launched as the main kernel's
    dependent, on every point and case, with and without clusters."""
    if gpu_arch().sm < 90:
        pytest.skip("a programmatic launch is sm_90's")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ks = kernels(head_dim, dtype, paged, cluster=cluster, launch="programmatic")
    assert ks and all(k.programmatic for k in ks)
    check_cases(ks, head_dim, torch_dtype, paged)


def test_the_programmatic_combine_is_the_streams_bit_for_bit_and_replays() -> None:
    """The programmatic launch changes when the combine starts, not what it computes: each
    point gives its "stream" twin's bits over calls of fresh inputs one after another on one
    stream (a combine that read its parts before the main kernel finished would find the last
    call's), and a captured call replays to the eager answer."""
    if gpu_arch().sm < 90:
        pytest.skip("a programmatic launch is sm_90's")
    gen = torch.Generator(device="cuda").manual_seed(6)
    pairs = [(a, b) for a, b in zip(kernels(128, "bf16", True, launch="programmatic"),
                                    kernels(128, "bf16", True), strict=True)
             if a.split_policy == "waves" or a.splits > 1]
    assert pairs
    same_bits(pairs, ((3, [4099, 0, 700], 4, 32), (1, [30000], 1, 64), (1, [30000], 1, 64),
                      (5, [0, 5, 64, 65, 2000], 16, 8)), torch.bfloat16, 64, gen)
    pdl = pairs[0][0]
    k, v, lens, table = validate.decode_cache(2, [8000, 3000], 8000, 8, 128, torch.bfloat16,
                                              paged=True, page_size=64, gen=gen, device="cuda")
    q = torch.randn(2, 4, 64, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    replays_to_eager(pdl, (q, k, v, lens, table))


def replays_to_eager(kernel: DecodeKernel, args: tuple) -> torch.Tensor:
    """A call captured in a CUDA graph (after a warm-up off the capture, as torch asks) gives
    the eager call's bits on each of 5 replays into a NaN-filled output; the eager answer."""
    want = kernel(*args)
    out = torch.empty_like(want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel(*args, out=out, check=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(*args, out=out, check=False)
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), kernel.name
    return want


def same_bits(pairs: list[tuple[DecodeKernel, DecodeKernel]], calls: tuple, dtype: torch.dtype,
              page_size: int, gen: torch.Generator) -> None:
    """Each pair gives the same bits (out and lse) on fresh paged inputs of each (batch,
    lengths, q_len, heads) call, 8 KV heads, d128."""
    for batch, lengths, q_len, heads in calls:
        cap = -(-max(lengths) // page_size) * page_size
        k, v, lens, table = validate.decode_cache(batch, lengths, cap, 8, 128, dtype,
                                                  paged=True, page_size=page_size, gen=gen,
                                                  device="cuda")
        q = torch.randn(batch, q_len, heads, 128, device="cuda", dtype=dtype, generator=gen)
        for a, b in pairs:
            lse_a = torch.full((batch, heads, q_len), float("nan"), device="cuda")
            lse_b = torch.full_like(lse_a, float("nan"))
            out_a = a(q, k, v, lens, table, lse=lse_a)
            out_b = b(q, k, v, lens, table, lse=lse_b)
            assert torch.equal(out_a, out_b), (a.name, page_size, lengths)
            assert torch.equal(lse_a, lse_b), (a.name, page_size, lengths)


@pytest.mark.parametrize("cluster", [4, 8])
def test_clusters_are_sized_to_one_wave(cluster: int) -> None:
    """The waves policy in clusters: the driver says how many clusters fit at once, fewer than
    the SMs would suggest (a cluster stays inside a GPC), and a batch-1 call's splits make no more
    clusters than that, so none waits for a second wave, unless every group is down to one
    cluster (16 groups of 16-row blocks at q_len 4, 64/8: 16 clusters of 8, where 15 fit)."""
    if gpu_arch().sm < 90:
        pytest.skip("thread block clusters are sm_90's")
    from evoengine.launch.core import sm_count
    from evoengine.launch.decode import DecodeShape, resident_clusters

    index = torch.cuda.current_device()
    kernel = kernels(128, "bf16", True, "slices", "fused", 4, cluster, one_wave=True)[0]
    kernel.load(index)
    main = kernel.main.load(index)
    clusters = resident_clusters(main.fn, kernel.main.threads, kernel.main.smem_bytes, cluster)
    assert clusters and clusters * cluster <= sm_count(index)
    for q_len, heads in ((4, 64), (1, 32)):
        shape = DecodeShape(batch=1, q_len=q_len, q_heads=heads, kv_heads=8, head_dim=128,
                            paged=True, page_size=64, capacity=32768, num_pages=512)
        chunks, splits = kernel.plan(shape, index)
        groups = 8 * chunks
        assert splits % cluster == 0
        assert groups * splits // cluster <= clusters or splits == cluster, (q_len, heads)


@functools.cache
def other_kernels(head_dim: int, paged: bool, combine: str) -> list[DecodeKernel]:
    """The hand-picked points the space admits at ``head_dim``, topped up to three with
    admitted points drawn at random (at d256 no hand-picked point fits), those that compile
    without spills."""
    arch = gpu_arch()
    problem = dict(HEAD_DIM=head_dim, DTYPE="bf16", PAGED=paged)
    points = [space().complete(dict(p, MERGE="slices", COMBINE=combine, COMBINE_ITEMS=1,
                                    CLUSTER=1, PAGE_STAGING="regs")) for p in POINTS]
    points = [p for p in points if not space().violations(p, problem, arch)]
    drawn = [p for p in space().admitted(problem, arch)
             if p["MERGE"] == "slices" and p["COMBINE"] == combine]
    random.Random(head_dim).shuffle(drawn)
    points += drawn[:max(0, 3 - len(points))]
    cands = [make_candidate(space(), p, problem, arch) for p in points]
    return [DecodeKernel(c, r) for c, r in zip(cands, compile_many(cands, arch), strict=True)
            if r.ok and not r.spill_bytes]


@pytest.mark.parametrize("combine", ["kernel", "fused"])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_other_head_dims(head_dim: int, paged: bool, combine: str) -> None:
    """Head dims other than 64 and 128: d80 and d96 copy K and V by index (10 or 12 16-byte
    copies a row, which no thread count splits), and the combine takes rows of 20 and 24
    float4s; d32 and d256 keep the column walk."""
    ks = other_kernels(head_dim, paged, combine)
    assert ks
    check_cases(ks, head_dim, torch.bfloat16, paged, CASES[:3])


def test_slices_merge_is_deterministic() -> None:
    """MERGE=slices sums the warps in a fixed order: two calls on the same inputs give the
    same bits, one split and many (the atomics add in whatever order the warps arrive)."""
    lengths = [4099, 1, 700]
    k, v, lens, table = validate.decode_cache(3, lengths, 4160, 8, 128, torch.float16,
                                              paged=True, page_size=64, device="cuda")
    q = torch.randn(3, 4, 32, 128, device="cuda", dtype=torch.float16)
    for kernel in kernels(128, "fp16", True, "slices") + kernels(128, "fp16", True, "slices",
                                                                  "fused"):
        first = kernel(q, k, v, lens, table)
        assert torch.equal(first, kernel(q, k, v, lens, table)), kernel.name


def _fused_and_kernel(head_dim: int = 128,
                      items: int = 1) -> list[tuple[DecodeKernel, DecodeKernel]]:
    """(fused, kernel) twins of the points with several splits."""
    pairs = zip(kernels(head_dim, "fp16", True, "slices", "fused", items),
                kernels(head_dim, "fp16", True, "slices", "kernel"), strict=True)
    return [(f, k) for f, k in pairs if f.split_policy == "waves" or f.splits > 1]


def _cooperative_and_kernel(head_dim: int = 128) -> list[tuple[DecodeKernel, DecodeKernel]]:
    """(cooperative, kernel) combine twins of the points, at the waves policy's one wave."""
    return list(zip(kernels(head_dim, "fp16", True, "slices", "cooperative", one_wave=True),
                    kernels(head_dim, "fp16", True, "slices", "kernel", one_wave=True),
                    strict=True))


@pytest.mark.parametrize("combine", ["kernel", "cooperative"])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_one_wave_and_the_cooperative_combine(head_dim: int, dtype: str, paged: bool,
                                             combine: str) -> None:
    """The points at the waves policy's one wave (every case has several splits a group), with
    the kernel combine and the cooperative one (every block of a group merges a share)."""
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ks = kernels(head_dim, dtype, paged, "slices", combine, one_wave=True)
    assert ks
    check_cases(ks, head_dim, torch_dtype, paged)


@pytest.mark.parametrize("items", [1, 2, 4])
def test_the_fused_combine_is_the_combine_kernel_bit_for_bit(items: int) -> None:
    """The fused combine runs the combine kernel's arithmetic in the same order: the same
    bits out and lse, over calls of several shapes one after another on one stream (each
    launch must find its counters as the last left them: zero), on a contiguous and a paged
    cache, with one split and many, one quad a thread at a time or ``items`` at once."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    pairs = _fused_and_kernel(items=items)
    if items == 1:  # and the cooperative combine, the same arithmetic by other blocks
        pairs += _cooperative_and_kernel()
    assert pairs
    same_bits(pairs, ((3, [4099, 1, 700], 4, 32), (1, [30000], 1, 64),
                      (5, [0, 5, 64, 65, 2000], 16, 8), (2, [9, 8191], 1, 8)),
              torch.float16, 64, gen)


@pytest.mark.parametrize("combine", ["fused", "cooperative"])
def test_the_fused_combine_replays_in_a_cuda_graph_and_on_two_streams(combine: str) -> None:
    """Graph replay, as servers run decode: 5 replays of a captured fused (or cooperative)
    call give the eager answer each time (the counters reset themselves); two streams running
    such calls at once each use their own counters and give the eager answers."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    fused, _ = (_fused_and_kernel() if combine == "fused" else _cooperative_and_kernel())[0]
    k, v, lens, table = validate.decode_cache(4, [4096, 100, 3000, 1], 4096, 8, 128,
                                              torch.float16, paged=True, page_size=64,
                                              gen=gen, device="cuda")
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.float16, generator=gen)
    want = replays_to_eager(fused, (q, k, v, lens, table))
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [torch.empty_like(q) for _ in streams]
    for _ in range(3):
        for s, o in zip(streams, outs, strict=True):
            o.fill_(float("nan"))
            s.wait_stream(torch.cuda.current_stream())
        for _ in range(4):
            for s, o in zip(streams, outs, strict=True):
                with torch.cuda.stream(s):
                    fused(q, k, v, lens, table, out=o, check=False)
        torch.cuda.synchronize()
        assert all(torch.equal(o, want) for o in outs)


def test_decode_workload_plan_and_timing() -> None:
    """The problem's own path: the criterion over its plan, then one timed call each of
    ours, an anchor and the copy (graph replay)."""
    from evoengine.problems.decode import time_copy

    w = DecodeWorkload(batch=2, q_len=4, q_heads=32, kv_heads=8, head_dim=128,
                       cache_len=4096, layout="paged", page_size=64)
    problem = Decode()
    kernel = kernels(128, "fp16", True)[0]
    verdict = problem.check(kernel, w)
    assert verdict.ok, verdict.reason
    sets = problem.inputs(w)
    call = problem.timed_call(kernel, w, sets)
    from evoengine import measure

    ours = measure.time_calls(call, len(sets), graph=True, reps=10)
    copy = time_copy(w, sets, graph=True, reps=10)
    by_kernel = time_copy(w, sets, kernel=True, graph=True, reps=10)
    cudnn = problem.time_anchor("cudnn", w, sets, graph=True, reps=10)
    print(f"\nours {ours.median_us:.1f} us, copy {copy.median_us:.1f} us, cuDNN "
          f"{cudnn.median_us if cudnn else None}")
    assert ours.median_us > 0 and copy.median_us > 0 and by_kernel.median_us > 0


def test_values_are_checked_before_launch() -> None:
    kernel = kernels(128, "fp16", True)[0]
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.float16)
    k, v, lens, table = validate.decode_cache(2, [100, 64], 128, 2, 128, torch.float16,
                                              paged=True, page_size=64, device="cuda")
    table_bad = table.clone()
    table_bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table entries"):
        kernel(q, k, v, lens, table_bad)
    with pytest.raises(ValueError, match="cache_seqlens must lie"):
        kernel(q, k, v, torch.tensor([129, 1], dtype=torch.int32, device="cuda"), table)
    with pytest.raises(ValueError, match="q_len must be at most 16"):
        kernel(q.expand(2, 17, 8, 128).contiguous(), k, v, lens, table)


def test_tuned_decode_dispatch_end_to_end() -> None:
    """The exported entry point over two tuned kernels: nearest by cache length, the SDPA
    fallback where no kernel has the layout."""
    paged = kernels(128, "fp16", True)
    entries = [Entry(0, "fp16", 128, True, 1, 4096, 8, 32, workload="a", kind="decode"),
               Entry(1, "fp16", 128, True, 1, 131072, 1, 32, workload="b", kind="decode")]
    tuned = TunedDecode(paged[:2], entries)
    assert tuned.select("fp16", 128, True, 100_000, 1) is entries[1]
    lengths = [3000, 1, 4095]
    k, v, lens, table = validate.decode_cache(3, lengths, 4096, 8, 128, torch.float16,
                                              paged=True, page_size=64, device="cuda")
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.float16)
    out = tuned(q, k, v, lens, table)
    ref, _ = validate.decode_reference(q, k, v, lens, table)
    base = sdpa_decode(q, k, v, lens, table)
    assert validate.judge(out, ref, base).ok
    kc, vc, lc, _ = validate.decode_cache(3, lengths, 4096, 8, 128, torch.float16,
                                          paged=False, page_size=0, device="cuda")
    with pytest.raises(ValueError, match="no tuned decode kernel"):
        tuned(q, kc, vc, lc)
    out = tuned(q, kc, vc, lc, fallback="sdpa")
    assert torch.isfinite(out).all()


def test_exported_module_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A store with decode elites, exported, imported as a plain module: attention_decode
    over a shuffled paged cache passes the criterion; the contiguous layout it has no kernel
    for raises one line or runs SDPA."""
    from evoengine.export import export_best
    from tests.test_decode import decode_store
    from tests.test_export import import_path

    arch = gpu_arch()
    workloads = [DecodeWorkload(8, 1, 32, 8, 128, 4096), DecodeWorkload(1, 4, 64, 8, 128, 32768)]
    decode_store(tmp_path / "evo.db", arch.name, workloads)
    done = export_best(str(tmp_path / "evo.db"), arch, output=tmp_path / "tuned_decode.py")
    module = import_path(done.path, "tuned_decode_gpu")

    def fn(q, k, v, lens, table, *, causal, scale, out, lse):  # type: ignore[no-untyped-def]
        out.copy_(module.attention_decode(q, k, v, lens, table, causal=causal, scale=scale))
        lse.zero_()  # attention_decode returns no lse; judged on out alone
        return out

    for lengths, q_len, heads in (((0, 3, 4095, 1000), 4, 64), ((4096, 1, 77), 1, 32)):
        v = validate.check_decode(fn, lengths=list(lengths), capacity=4096, q_len=q_len,
                                  heads=heads, kv_heads=8, head_dim=128, dtype=torch.float16,
                                  paged=True, page_size=64, seed=7)
        # the lse written here is zeros, not the reference's: only the output is judged
        assert v.ok or "log-sum-exp" in v.reason, v.reason
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.float16)
    k, vc, lens, _ = validate.decode_cache(2, [10, 20], 32, 8, 128, torch.float16,
                                           paged=False, page_size=0, device="cuda")
    with pytest.raises(module.NoKernelError, match="no tuned decode kernel"):
        module.attention_decode(q, k, vc, lens)
    assert torch.isfinite(module.attention_decode(q, k, vc, lens, fallback="sdpa")).all()
