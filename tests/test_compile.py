"""Tests of evoengine.compile: offline NVRTC for every target, without a GPU.

Every test points EVOENGINE_CACHE at its own temporary folder, so no result leaks between
tests or from a user's cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evoengine import launch, paths
from evoengine.arch import Arch, get_arch
from evoengine.compile import (
    CompileResult,
    compile_candidate,
    compile_many,
    compile_source,
    cuda_include_dirs,
    launcher_options,
    nvrtc_options,
    nvrtc_version,
    serialized_code,
)
from evoengine.render import Candidate, make_candidate, render
from evoengine.space import SearchSpace, sample

compile_mod = importlib.import_module("evoengine.compile")

ARCHS = ("sm_80", "sm_89", "sm_90a")
ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
SMALL = {
    "mma": dict(BLOCK_M=64, BLOCK_N=32, NUM_WARPS=4, STAGES=1, SWIZZLE="none", Q_IN_REGS=True,
                LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split"),
    "wmma": dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=1, SWIZZLE="none", Q_IN_REGS=True),
}
HD64 = {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("EVOENGINE_CACHE", str(root))
    assert paths.cache_dir() == root
    return root


def space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def sampled(family: str, arch: str, n: int = 3) -> list[Candidate]:
    """``n`` admitted points, each for a different default problem, chosen with fixed seeds."""
    sp = space(family)
    target = get_arch(arch)
    problems = list(sp.problems())
    out = []
    for j in range(n):
        problem = problems[(ARCHS.index(arch) * n + j) % len(problems)]
        (point,) = sample(sp.admitted(problem, target), 1, seed=j)
        out.append(make_candidate(sp, point, problem, target))
    return out


def small(family: str, arch: str = "sm_80") -> Candidate:
    return make_candidate(space(family), SMALL[family], HD64, get_arch(arch))


def cache_entry(cache: Path, arch: str, candidate: Candidate) -> Path:
    """The one cached cubin of ``candidate`` for ``arch`` (its name starts with the identity)."""
    (entry,) = (cache / "cubin" / arch).glob(f"{candidate.identity}*.cubin")
    return entry


def assert_cubin_for(cubin: bytes, arch: Arch) -> None:
    assert cubin[:4] == ELF_MAGIC
    assert int.from_bytes(cubin[18:20], "little") == EM_CUDA  # e_machine
    if cubin[8] == 8:  # CUDA ELF ABI 8 (what NVRTC 13 writes): the SM sits in e_flags' byte 1
        assert (int.from_bytes(cubin[48:52], "little") >> 8) & 0xFF == arch.sm


# ---- every family on every target --------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", ["mma", "wmma"])
def test_sampled_candidates_compile(family: str, arch: str, cache: Path) -> None:
    cands = sampled(family, arch)
    assert len({c.identity for c in cands}) == 3
    results = list(compile_many(cands, arch, workers=2))
    assert [r.identity for r in results] == [c.identity for c in cands]  # order kept
    for c, r in zip(cands, results, strict=True):
        assert r.ok, f"{c.identity}: {r.error}\n{r.log}"
        assert r.arch == arch
        assert r.error is None
        assert r.registers is not None and 0 < r.registers <= 255
        assert r.cubin is not None
        assert_cubin_for(r.cubin, get_arch(arch))
        assert r.smem_bytes == c.smem_bytes
        assert r.spill_stores is not None and r.spill_loads is not None
        assert r.stack_bytes is not None and r.stack_bytes >= 0
        assert r.spill_bytes == r.spill_stores + r.spill_loads
        assert r.seconds > 0
        assert cache_entry(cache, arch, c).read_bytes() == r.cubin


def test_compile_many_with_no_candidates() -> None:
    assert list(compile_many([], "sm_80", workers=2)) == []
    assert list(compile_many([], "sm_80")) == []


def test_compile_many_spawns_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never forked: a forked child of a threaded caller (CUDA's, torch's threads) can deadlock
    on a lock another thread held. The workers still see the caller's EVOENGINE_CACHE."""
    contexts = []
    real = compile_mod.ProcessPoolExecutor

    def pool(*args, **kwargs):
        contexts.append(kwargs.get("mp_context"))
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_mod, "ProcessPoolExecutor", pool)
    cands = [small("wmma"), small("mma")]
    results = list(compile_many(cands, "sm_80", workers=2))
    assert [c.get_start_method() if c else None for c in contexts] == ["spawn"]
    assert [r.identity for r in results] == [c.identity for c in cands]
    for c, r in zip(cands, results, strict=True):
        assert r.ok, r.error
        assert cache_entry(paths.cache_dir(), "sm_80", c).read_bytes() == r.cubin


def test_compile_many_in_process_matches_workers() -> None:
    c = small("wmma")
    (one,) = compile_many([c], get_arch("sm_80"), workers=1)
    assert one.ok and one.identity == c.identity
    assert_cubin_for(one.cubin or b"", get_arch("sm_80"))


def test_same_source_differs_by_target() -> None:
    c80, c90 = small("mma", "sm_80"), small("mma", "sm_90a")
    assert c80.identity == c90.identity  # the source is arch-independent
    r80, r90 = compile_candidate(c80, "sm_80"), compile_candidate(c90, "sm_90a")
    assert r80.ok and r90.ok
    assert r80.cubin != r90.cubin
    assert_cubin_for(r80.cubin or b"", get_arch("sm_80"))
    assert_cubin_for(r90.cubin or b"", get_arch("sm_90a"))


def test_arch_alias_is_resolved(cache: Path) -> None:
    r = compile_candidate(small("wmma", "sm_90a"), "sm_90")
    assert r.ok and r.arch == "sm_90a"
    assert (cache / "cubin" / "sm_90a").is_dir()


# ---- failures are results ----------------------------------------------------------------


@pytest.mark.parametrize("source", ["this is not C++", "__global__ void k() { undefined(); }",
                                    'extern "C" __global__ void k() { int x = ; }'])
def test_broken_source_is_a_result(source: str) -> None:
    r = compile_source(source, get_arch("sm_80"), {}, identity="broken")
    assert r.ok is False
    assert r.error and "error" in r.error
    assert r.error in r.log
    assert r.cubin is None
    assert r.registers is None
    assert r.identity == "broken" and r.arch == "sm_80"
    assert r.report()["ok"] is False


def test_smem_static_assert_ties_space_to_kernel() -> None:
    arch = get_arch("sm_80")
    for family in ("mma", "wmma"):
        c = small(family)
        src = render(c)
        good = compile_source(src, arch, c.defines(arch))
        assert good.ok, good.error  # the control: the right value compiles
        bad = compile_source(src, arch, {**c.defines(arch), "EVO_SMEM_BYTES": c.smem_bytes + 16},
                             smem_bytes=c.smem_bytes + 16)
        assert bad.ok is False
        assert "static assertion failed" in (bad.error or "")
        assert "the search space computes the same shared memory" in (bad.error or "")
        assert bad.cubin is None
        assert bad.smem_bytes == c.smem_bytes + 16


def test_smem_limit_static_assert_fires() -> None:
    arch = get_arch("sm_89")
    c = small("wmma", "sm_89")
    r = compile_source(render(c), arch, {**c.defines(arch), "EVO_SMEM_LIMIT": c.smem_bytes - 1})
    assert r.ok is False
    assert "shared memory fits the target" in (r.error or "")


def test_missing_defines_are_refused() -> None:
    c = small("mma")
    r = compile_source(render(c), get_arch("sm_80"), {})
    assert r.ok is False
    assert "EVO_SMEM_LIMIT" in (r.error or "")


def test_failed_compile_is_not_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_mod, "render", lambda candidate: "this is not C++")
    c = small("mma")
    r = compile_candidate(c, "sm_80")
    assert r.ok is False and r.error
    assert r.smem_bytes == c.smem_bytes
    assert not list(cache.rglob("*.cubin")) and not list(cache.rglob("*.json"))


# ---- the cache ---------------------------------------------------------------------------


def test_cache_returns_the_same_cubin_faster(cache: Path) -> None:
    c = small("mma")
    start = time.perf_counter()
    first = compile_candidate(c, "sm_80")
    cold = time.perf_counter() - start
    assert first.ok, first.error

    entry = cache_entry(cache, "sm_80", c)
    meta = entry.with_suffix(".json")
    assert entry.is_file() and meta.is_file()
    assert entry.read_bytes() == first.cubin
    assert not list(entry.parent.glob("*.tmp"))

    start = time.perf_counter()
    second = compile_candidate(c, "sm_80")
    warm = time.perf_counter() - start
    assert second.cubin == first.cubin
    assert second.report() == first.report()
    assert warm < cold / 5, (warm, cold)


def test_cache_is_what_is_served(cache: Path) -> None:
    c = small("wmma")
    first = compile_candidate(c, "sm_80")
    entry = cache_entry(cache, "sm_80", c)
    entry.write_bytes(ELF_MAGIC + b"from the cache")
    assert compile_candidate(c, "sm_80").cubin == ELF_MAGIC + b"from the cache"
    # A cubin without its report is not an entry: it is compiled again.
    entry.with_suffix(".json").unlink()
    assert compile_candidate(c, "sm_80").cubin == first.cubin


# Regression: the key was identity + arch only, so a cubin from another NVRTC or with other
# options was served as is.
@pytest.mark.parametrize("change", ["version", "options"])
def test_cache_does_not_serve_another_compilers_cubin(cache: Path, change: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    c = small("wmma")
    first = compile_candidate(c, "sm_80")
    assert first.ok
    assert compile_candidate(c, "sm_80").log == ""  # served from the cache
    if change == "version":
        monkeypatch.setattr(compile_mod, "nvrtc_version", lambda: "nvrtc 99.0")
    else:
        monkeypatch.setattr(compile_mod, "nvrtc_options",
                            lambda arch, defines: [*nvrtc_options(arch, defines), "-lineinfo"])
    again = compile_candidate(c, "sm_80")
    assert again.ok
    assert again.log, "served from the cache: no compiler log"
    assert len(list((cache / "cubin" / "sm_80").glob(f"{c.identity}*.cubin"))) == 2


def test_cache_key_ignores_include_paths(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = small("wmma")
    compile_candidate(c, "sm_80")
    monkeypatch.setattr(compile_mod, "cuda_include_dirs", lambda: [*cuda_include_dirs(), "/x"])
    assert compile_candidate(c, "sm_80").log == ""  # the same headers elsewhere: still cached


# Regression: the entry was named by the identity alone, and a ragged wgmma point's identity
# with every parameter passed the file system's 255 bytes a name (OSError on writing).
def test_cache_names_a_long_identity_by_its_hash(cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sp = SearchSpace.load(paths.SPACES / "wgmma.toml")
    problem = {"HEAD_DIM": 64, "DTYPE": "bf16", "CAUSAL": True, "VARLEN": True}
    point = dict(BLOCK_M=192, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="smem",
                 INTRA_WG_OVERLAP=True, PINGPONG=True, PERSISTENT=True, TILE_ORDER="head",
                 SCHEDULER="dynamic", PACK_GQA=True, P_BARRIER="turn", O_STAGE="own_or_q",
                 O_STORE="threads")
    long = make_candidate(sp, point, problem, get_arch("sm_90a"))
    name = compile_mod._cache_path(long, get_arch("sm_90a")).name
    assert len(long.identity) > compile_mod.CACHE_NAME_MAX
    assert len(name) <= compile_mod.CACHE_NAME_MAX and name.startswith("wgmma-")
    c = small("wmma")
    monkeypatch.setattr(compile_mod, "CACHE_NAME_MAX", 40)  # this one goes by its hash too
    first = compile_candidate(c, "sm_80")
    (entry,) = (cache / "cubin" / "sm_80").glob("*.cubin")
    assert entry.name.startswith("wmma-") and len(entry.name) <= 40 + 20
    assert entry.read_bytes() == first.cubin
    assert compile_candidate(c, "sm_80").log == ""  # served from it
    other = make_candidate(space("wmma"), {**SMALL["wmma"], "STAGES": 3}, HD64, get_arch("sm_80"))
    assert compile_mod._cache_path(other, get_arch("sm_80")).name != entry.name


def test_cache_is_per_target(cache: Path) -> None:
    c = small("wmma")
    compile_candidate(c, "sm_80")
    compile_candidate(c, "sm_89")
    assert sorted(p.parent.name for p in cache.rglob("*.cubin")) == ["sm_80", "sm_89"]


# ---- the result and the options ----------------------------------------------------------


def test_spill_bytes_is_stores_plus_loads() -> None:
    r = CompileResult("x", "sm_80", True, registers=64, spill_stores=12, spill_loads=20)
    assert r.spill_bytes == 32
    assert CompileResult("x", "sm_80", True, spill_stores=12).spill_bytes is None
    assert CompileResult("x", "sm_80", False).spill_bytes is None


def test_report_leaves_out_cubin_and_log() -> None:
    r = CompileResult("x", "sm_80", True, registers=64, spill_stores=4, spill_loads=8,
                      stack_bytes=16, smem_bytes=1024, seconds=0.5, log="ptxas info",
                      cubin=b"\x7fELF")
    report = r.report()
    assert "cubin" not in report and "log" not in report
    assert report["spill_bytes"] == 12
    assert report["registers"] == 64 and report["smem_bytes"] == 1024
    assert report["identity"] == "x" and report["ok"] is True


# ptxas's own lines (NVRTC 13.0 and 13.5, sm_90a, 2026-11-28): two that serialised every wgmma
# of a kernel, and one that only injected a wait.
SERIALIZED_13_0 = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async "
                   "instructions are serialized due to program dependence on compiler-inserted "
                   "WG.DP in divergent path in the function 'attn_fwd'")
SERIALIZED_13_5 = ("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async "
                   "instructions are serialized due to non wgmma instructions defining input "
                   "registers of a wgmma between start and end of the pipeline stage in the "
                   "function 'attn_fwd' in line 0")
INJECTED = ("ptxas info    : (C7517) wgmma.wait_group is injected in around line 54 by compiler "
            "to allow use of registers defined by GMMA in function 'k'")


def test_serialized_wgmma_is_named_by_its_code() -> None:
    assert serialized_code(f"{INJECTED}\n{SERIALIZED_13_0}\nptxas info : Used 128 registers") \
        == "C7518"
    assert serialized_code(SERIALIZED_13_5) == "C7513"
    assert serialized_code(INJECTED) is None and serialized_code("") is None


def test_serialized_survives_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached entry says what the compile said: a serialised kernel stays marked."""
    c = small("mma")
    real = compile_mod.compile_source

    def marked(*args: object, **kw: object) -> CompileResult:
        r = real(*args, **kw)  # type: ignore[arg-type]
        return dataclasses.replace(r, serialized="C7518", log=r.log + "\n" + SERIALIZED_13_0)

    monkeypatch.setattr(compile_mod, "compile_source", marked)
    first = compile_candidate(c, "sm_80")
    second = compile_candidate(c, "sm_80")
    assert first.serialized == second.serialized == "C7518"
    assert second.log == "" and second.report() == first.report()


def test_resource_report_is_parsed_from_the_log() -> None:
    c = small("wmma")
    r = compile_source(render(c), get_arch("sm_80"), c.defines(get_arch("sm_80")))
    assert r.ok
    regs = re.search(r"Used (\d+) registers", r.log)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", r.log)
    assert regs and spill
    assert r.registers == int(regs.group(1))
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == tuple(map(int, spill.groups()))


def test_resource_report_covers_every_kernel_of_a_cubin() -> None:
    """A backward cubin holds four kernels (pre, main, post, and the group split's kv_post):
    the report is the most registers and stack of any, and the spills of all of them."""
    target = get_arch("sm_80")
    c = make_candidate(space("mma_bwd"), dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2,
                                              SWIZZLE="xor", DQ_ACCUM="atomic",
                                              KV_IN_REGS=False, GROUP_SPLIT=1), HD64, target)
    r = compile_source(render(c), target, c.defines(target))
    assert r.ok, r.error
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", r.log)]
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                        r"spill loads", r.log)
    # Not every kernel is the largest (ptxas logs them in reverse source order: the main
    # kernel, after the shared pre/post include, comes first and the smallest last).
    assert len(regs) == len(spills) == 4 and regs[-1] != max(regs)
    assert r.registers == max(regs)
    assert r.stack_bytes == max(int(s[0]) for s in spills)
    assert r.spill_stores == sum(int(s[1]) for s in spills)
    assert r.spill_loads == sum(int(s[2]) for s in spills)


def test_nvrtc_options() -> None:
    opts = nvrtc_options(get_arch("sm_90a"), {"EVO_SMEM_LIMIT": 1, "EVO_SMEM_BYTES": 2})
    assert "--gpu-architecture=sm_90a" in opts
    assert "-DEVO_SMEM_LIMIT=1" in opts and "-DEVO_SMEM_BYTES=2" in opts
    assert "-Xptxas=-v" in opts  # the resource report comes from ptxas' verbose output
    includes = [o for o in opts if o.startswith("-I")]
    assert includes == [f"-I{d}" for d in cuda_include_dirs()]


def test_nvrtc_options_are_the_launchers_own() -> None:
    """Offline builds and an exported module's builds on another GPU get the same flags: the
    launcher's NVRTC_OPTIONS, read from its source."""
    assert launcher_options() == launch.NVRTC_OPTIONS
    opts = nvrtc_options(get_arch("sm_90a"), {})
    assert opts[1:1 + len(launch.NVRTC_OPTIONS)] == list(launch.NVRTC_OPTIONS)


def test_compiling_does_not_import_torch() -> None:
    """Reading the launcher's options must not import it: it imports torch, which costs
    every compile worker seconds."""
    code = ("import sys; from evoengine.arch import get_arch; from evoengine.compile import "
            "nvrtc_options; nvrtc_options(get_arch('sm_80'), {}); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=paths.ROOT, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_cuda_headers_are_found() -> None:
    dirs = cuda_include_dirs()
    assert len(dirs) == 1
    assert (Path(dirs[0]) / "cuda_fp16.h").is_file()


def test_nvrtc_version() -> None:
    assert re.fullmatch(r"nvrtc \d+\.\d+", nvrtc_version())
