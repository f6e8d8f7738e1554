"""Tests of evoengine.render: candidate identities, template hashes and the rendered source."""

from __future__ import annotations

import importlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from evoengine import paths
from evoengine.arch import get_arch
from evoengine.render import KERNEL_NAME, Candidate, make_candidate, make_identity, template_hash
from evoengine.space import SearchSpace

# evoengine/__init__.py re-exports the function ``render``, which shadows the submodule as an
# attribute of the package, so ``from evoengine import render`` would give the function.
render = importlib.import_module("evoengine.render")

MMA_POINT = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                 LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split")
WMMA_POINT = dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=2, STAGES=3, SWIZZLE="none", Q_IN_REGS=False)
HD64 = {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}
HD128 = {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}
SM80 = get_arch("sm_80")


def space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def clear_caches() -> None:
    render.template_hash.cache_clear()
    render._environment_for.cache_clear()


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    """Hashes and the Jinja environment are cached per process; never leak a patched one."""
    clear_caches()
    yield
    clear_caches()


@pytest.fixture
def tmp_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of templates/ that paths.TEMPLATES points at for the test."""
    copy = tmp_path / "templates"
    shutil.copytree(paths.TEMPLATES, copy)
    monkeypatch.setattr(paths, "TEMPLATES", copy)
    clear_caches()
    return copy


def change_one_byte(path: Path, index: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[index] = ord("G") if data[index] != ord("G") else ord("H")
    path.write_bytes(bytes(data))


# ---- identity -----------------------------------------------------------------------------


def test_template_hash_is_short_hex_and_per_family() -> None:
    mma, wmma = template_hash("mma"), template_hash("wmma")
    assert re.fullmatch(r"[0-9a-f]{12}", mma)
    assert re.fullmatch(r"[0-9a-f]{12}", wmma)
    assert mma != wmma
    clear_caches()
    assert template_hash("mma") == mma


def test_identity_is_exact_and_ordered() -> None:
    c = make_candidate(space("mma"), MMA_POINT, HD64, SM80)
    assert c.identity == (
        "mma-head_dim64-dtypefp16-causal0-block_m64-block_n64-num_warps4-stages2-swizzlexor"
        f"-q_in_regs1-lazy_rescale0-min_blocks1-pipelinesplit-{template_hash('mma')}"
    )
    assert c.template_hash == template_hash("mma")


def test_identity_contains_family_every_parameter_and_problem_value() -> None:
    c = make_candidate(space("wmma"), WMMA_POINT, HD128, SM80)
    parts = c.identity.split("-")
    assert parts[0] == "wmma"
    assert parts[-1] == template_hash("wmma")
    assert parts[1:-1] == ["head_dim128", "dtypebf16", "causal1", "block_m32", "block_n32",
                           "num_warps2", "stages3", "swizzlenone", "q_in_regs0"]


def test_identity_is_deterministic_and_independent_of_dict_order() -> None:
    sp = space("mma")
    reversed_point = dict(reversed(list(MMA_POINT.items())))
    a = make_candidate(sp, MMA_POINT, HD64, SM80)
    b = make_candidate(space("mma"), reversed_point, HD64, SM80)
    assert a.identity == b.identity == make_candidate(sp, MMA_POINT, HD64, SM80).identity
    assert list(b.params) == list(sp.parameters)


def test_identity_is_independent_of_problem_dict_order() -> None:
    sp = space("mma")
    reversed_problem = dict(reversed(list(HD64.items())))
    a = make_candidate(sp, MMA_POINT, HD64, SM80)
    c = make_candidate(sp, MMA_POINT, reversed_problem, SM80)
    assert c.identity == a.identity
    assert list(c.problem) == list(sp.problem)


@pytest.mark.parametrize("problem", [{"HEAD_DIM": 64, "DTYPE": "fp16"},
                                     {**HD64, "SEQ": 128}])
def test_make_candidate_needs_exactly_the_problem_dimensions(problem: dict) -> None:
    with pytest.raises(ValueError, match="problem must name exactly"):
        make_candidate(space("mma"), MMA_POINT, problem, SM80)


@pytest.mark.parametrize("family", ["mma", "wmma"])
def test_identity_differs_when_any_single_value_changes(family: str) -> None:
    sp = space(family)
    point = MMA_POINT if family == "mma" else WMMA_POINT
    base = make_identity(family, HD64, point)
    seen = {base}
    for name, domain in sp.parameters.items():
        for value in domain:
            if value == point[name]:
                continue
            ident = make_identity(family, HD64, {**point, name: value})
            assert ident != base, (name, value)
            seen.add(ident)
    for name, other in (("HEAD_DIM", 128), ("DTYPE", "bf16"), ("CAUSAL", True)):
        ident = make_identity(family, {**HD64, name: other}, point)
        assert ident != base, name
        seen.add(ident)
    expected = 1 + sum(len(d) - 1 for d in sp.parameters.values()) + 3
    assert len(seen) == expected


def test_template_hash_changes_with_one_byte_of_the_template(tmp_templates: Path) -> None:
    sp = space("mma")
    before_hash = template_hash("mma")
    before_wmma = template_hash("wmma")
    before = make_candidate(sp, MMA_POINT, HD64, SM80)
    before_identity, before_source = before.identity, render.render(before)

    change_one_byte(tmp_templates / "mma" / "kernel.cu.j2")
    clear_caches()

    after = make_candidate(sp, MMA_POINT, HD64, SM80)
    assert template_hash("mma") != before_hash
    assert template_hash("wmma") == before_wmma  # another family's templates did not change
    assert after.identity != before_identity
    assert after.identity.removesuffix(template_hash("mma")) == \
        before_identity.removesuffix(before_hash)
    after_source = render.render(after)
    assert after.identity in after_source
    assert before_identity not in after_source
    assert "// GlashAttention-2" in after_source and "// GlashAttention-2" not in before_source


def test_template_hash_changes_with_a_shared_include(tmp_templates: Path) -> None:
    before = {f: template_hash(f) for f in ("mma", "wmma")}
    params = tmp_templates / "common" / "params.cuh.j2"
    params.write_text(params.read_text() + "// one more line\n")
    clear_caches()
    after = {f: template_hash(f) for f in ("mma", "wmma")}
    assert after["mma"] != before["mma"]
    assert after["wmma"] != before["wmma"]


def test_template_hash_sees_a_new_file(tmp_templates: Path) -> None:
    before = template_hash("mma")
    (tmp_templates / "mma" / "notes.txt").write_text("x")
    clear_caches()
    assert template_hash("mma") != before


def test_template_hash_covers_files_borrowed_from_another_family(tmp_templates: Path) -> None:
    """wgmma_bwd includes wgmma's hopper.cuh and imports its mma_async macros: a change to
    either changes both families' hashes, and none of a family that borrows nothing."""
    for borrowed in ("hopper.cuh", "mma_async.cuh.j2"):
        before = {f: template_hash(f) for f in ("wgmma_bwd", "wgmma", "mma_bwd")}
        change_one_byte(tmp_templates / "wgmma" / borrowed)
        clear_caches()
        after = {f: template_hash(f) for f in ("wgmma_bwd", "wgmma", "mma_bwd")}
        assert after["wgmma_bwd"] != before["wgmma_bwd"], borrowed
        assert after["wgmma"] != before["wgmma"], borrowed
        assert after["mma_bwd"] == before["mma_bwd"], borrowed


def test_template_hash_is_cached_until_cleared(tmp_templates: Path) -> None:
    before = template_hash("mma")
    change_one_byte(tmp_templates / "mma" / "kernel.cu.j2")
    assert template_hash("mma") == before  # cached: the documented reason to cache_clear
    clear_caches()
    assert template_hash("mma") != before


# ---- make_candidate -------------------------------------------------------------------------


def test_candidate_carries_derived_values() -> None:
    sp = space("mma")
    c = make_candidate(sp, MMA_POINT, HD64, SM80)
    assert c.family == "mma"
    assert c.problem == HD64
    assert c.params == MMA_POINT
    assert list(c.derived) == list(sp.derived)
    assert c.threads == 128
    assert c.block_m == 64
    assert c.smem_bytes == 2 * 2 * 64 * 128  # K/V ring; Q lives in registers
    assert c.defines(SM80) == {"EVO_SMEM_LIMIT": 163 * 1024, "EVO_SMEM_BYTES": 32768}
    assert c.defines(get_arch("sm_90a"))["EVO_SMEM_LIMIT"] == 227 * 1024


def test_candidate_copies_its_inputs() -> None:
    point, problem = dict(MMA_POINT), dict(HD64)
    c = make_candidate(space("mma"), point, problem, SM80)
    point["BLOCK_M"] = 128
    problem["HEAD_DIM"] = 128
    assert c.params["BLOCK_M"] == 64
    assert c.problem["HEAD_DIM"] == 64


def test_candidate_equality_ignores_derived() -> None:
    a = Candidate("mma", dict(HD64), dict(MMA_POINT), {"SMEM_BYTES": 1})
    b = Candidate("mma", dict(HD64), dict(MMA_POINT), {"SMEM_BYTES": 2})
    assert a == b
    assert a != Candidate("mma", dict(HD64), {**MMA_POINT, "STAGES": 3}, {})


@pytest.mark.parametrize(
    ("family", "override", "problem", "arch", "reason"),
    [
        ("mma", {"BLOCK_M": 32, "NUM_WARPS": 4}, HD64, "sm_80", "each warp owns whole m16 tiles"),
        ("mma", {"BLOCK_M": 48}, HD64, "sm_80", "BLOCK_M=48 not in"),
        ("mma", dict(BLOCK_N=128, STAGES=3, SWIZZLE="none", Q_IN_REGS=False), HD128, "sm_89",
         "shared memory per block fits the target"),
        ("wmma", {"SWIZZLE": "xor"}, HD64, "sm_80", "SWIZZLE='xor' not in"),
        ("wmma", {"NUM_WARPS": 4}, HD64, "sm_80", "each warp owns one m16 block"),
    ],
)
def test_make_candidate_rejects_a_violating_point(family: str, override: dict, problem: dict,
                                                  arch: str, reason: str) -> None:
    point = {**(MMA_POINT if family == "mma" else WMMA_POINT), **override}
    with pytest.raises(ValueError, match="rejected by the search space") as info:
        make_candidate(space(family), point, problem, get_arch(arch))
    assert reason in str(info.value)


def test_make_candidate_rejects_an_untargeted_arch() -> None:
    data_space = space("mma")
    only_90 = SearchSpace(data_space.family, data_space.description, ("sm_90a",),
                          data_space.problem, data_space.parameters, data_space.derived,
                          data_space.constraints)
    with pytest.raises(ValueError, match="family mma does not target sm_80"):
        make_candidate(only_90, MMA_POINT, HD64, SM80)


# ---- rendered source ----------------------------------------------------------------------


def test_rendered_mma_source_declares_the_point() -> None:
    c = make_candidate(space("mma"), MMA_POINT, HD128, SM80)
    src = render.render(c)
    for line in (
        f"// evoengine candidate {c.identity}",
        f"// family mma, template {template_hash('mma')}",
        "constexpr int HEAD_DIM = 128;",
        "constexpr bool IS_BF16 = true;",
        "constexpr bool CAUSAL = true;",
        "constexpr int BLOCK_M = 64;",
        "constexpr int BLOCK_N = 64;",
        "constexpr int NUM_WARPS = 4;",
        "constexpr int STAGES = 2;",
        "constexpr int SWIZZLE = SWIZZLE_XOR;",
        "constexpr bool Q_IN_REGS = true;",
    ):
        assert line in src, line
    assert f"{KERNEL_NAME}(" in src
    for marker in ("{{", "}}", "/*%", "%*/", "/*#"):
        assert marker not in src, marker


def test_rendered_wmma_source_declares_the_point() -> None:
    c = make_candidate(space("wmma"), WMMA_POINT, HD64, SM80)
    src = render.render(c)
    for line in (
        c.identity,
        "constexpr int HEAD_DIM = 64;",
        "constexpr bool IS_BF16 = false;",
        "constexpr bool CAUSAL = false;",
        "constexpr int BLOCK_M = 32;",
        "constexpr int BLOCK_N = 32;",
        "constexpr int NUM_WARPS = 2;",
        "constexpr int STAGES = 3;",
        "constexpr int SWIZZLE = SWIZZLE_NONE;",
        "constexpr bool Q_IN_REGS = false;",
        "#include <mma.h>",
    ):
        assert line in src, line
    assert "constexpr int BLOCK_M = 64;" not in src


def test_rendering_twice_is_byte_identical() -> None:
    c = make_candidate(space("mma"), MMA_POINT, HD64, SM80)
    first = render.render(c)
    assert render.render(c) == first
    clear_caches()  # a fresh environment and hash give the same bytes
    assert render.render(make_candidate(space("mma"), MMA_POINT, HD64, SM80)) == first


def test_different_points_render_differently() -> None:
    sp = space("mma")
    a = render.render(make_candidate(sp, MMA_POINT, HD64, SM80))
    b = render.render(make_candidate(sp, {**MMA_POINT, "SWIZZLE": "pad"}, HD64, SM80))
    assert a != b
    assert "SWIZZLE_PAD;" in b and "SWIZZLE_PAD;" not in a


def test_render_from_another_trees_templates(tmp_path: Path) -> None:
    """``render(c, templates)`` reads that folder (a change's base, for benchmarks/retime.py
    --base-templates) and leaves the default environment alone."""
    other = tmp_path / "templates"
    shutil.copytree(paths.TEMPLATES, other)
    c = make_candidate(space("mma"), MMA_POINT, HD64, SM80)
    assert render.render(c, paths.TEMPLATES) == render.render(c)
    path = other / "mma" / "kernel.cu.j2"
    path.write_text("// the base tree\n" + path.read_text())
    assert render.render(c, other) == "// the base tree\n" + render.render(c)
    assert not render.render(c).startswith("// the base tree")
