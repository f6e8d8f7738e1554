"""Tests of evoengine.space: the shipped spaces, their constraints, and malformed files."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from evoengine import paths
from evoengine.arch import ARCHS, Arch, get_arch
from evoengine.space import SearchSpace, SpaceError, default_spaces, sample

FAMILIES = ("mma", "wmma")
PARAM_ORDER = ["BLOCK_M", "BLOCK_N", "NUM_WARPS", "STAGES", "SWIZZLE", "Q_IN_REGS"]
# Parameters of one family only, after the shared ones.
FAMILY_PARAMS = {"mma": ["LAZY_RESCALE", "MIN_BLOCKS", "PIPELINE"], "wmma": []}
HD64 = {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}
HD128 = {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}

# A point each shipped space admits on every target (checked below).
BASE_POINT = {
    "mma": dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split"),
    "wmma": dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=1, SWIZZLE="pad", Q_IN_REGS=False),
}


def shipped_data(family: str) -> dict[str, object]:
    return tomllib.loads((paths.SPACES / f"{family}.toml").read_text())


def shipped(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def message_of(space: SearchSpace, rule_text: str) -> str:
    """What ``violations`` says for the constraint whose rule is ``rule_text``."""
    (c,) = [c for c in space.constraints if c.rule.text == rule_text]
    return f"{c.why} ({c.rule.text})"


# ---- the shipped spaces --------------------------------------------------------------------


def test_shipped_spaces_load() -> None:
    spaces = default_spaces()
    assert [s.family for s in spaces] == ["mma", "wgmma", "wmma"]
    for s in spaces:
        assert s.path == paths.SPACES / f"{s.family}.toml"
        assert list(s.problem) == ["HEAD_DIM", "DTYPE", "CAUSAL"]
        assert "SMEM_BYTES" in s.derived and "THREADS" in s.derived
        assert len(s.constraints) >= 5
        assert all(c.why for c in s.constraints)
        if s.family in FAMILIES:  # wgmma is Hopper-only, with its own parameters
            assert {"sm_80", "sm_89", "sm_90a"} <= set(s.archs)
            assert list(s.parameters) == PARAM_ORDER + FAMILY_PARAMS[s.family]


@pytest.mark.parametrize("family", FAMILIES)
def test_grid_size_and_order(family: str) -> None:
    space = shipped(family)
    expected = 1
    for values in space.parameters.values():
        expected *= len(values)
    grid = list(space.grid())
    assert space.size() == expected == len(grid)
    assert len({tuple(p.values()) for p in grid}) == expected
    assert grid[0] == {k: v[0] for k, v in space.parameters.items()}
    assert grid[-1] == {k: v[-1] for k, v in space.parameters.items()}
    assert list(grid[0]) == PARAM_ORDER + FAMILY_PARAMS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_problems_are_the_default_product(family: str) -> None:
    problems = list(shipped(family).problems())
    assert len(problems) == 8
    assert {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True} in problems
    assert {(p["HEAD_DIM"], p["DTYPE"], p["CAUSAL"]) for p in problems} == {
        (d, t, c) for d in (64, 128) for t in ("fp16", "bf16") for c in (False, True)
    }


def test_wmma_has_no_xor_swizzle_but_mma_does() -> None:
    assert "xor" in shipped("mma").parameters["SWIZZLE"]
    assert "xor" not in shipped("wmma").parameters["SWIZZLE"]


def test_derived_values_match_hand_computation() -> None:
    space = shipped("mma")
    arch = get_arch("sm_80")
    env = space.env(BASE_POINT["mma"], HD64, arch)
    # ROW_BYTES = 64 * 2; Q = 64 rows; K/V ring = 2 stages x (K + V) x 64 rows.
    assert env["THREADS"] == 128
    assert env["WARP_M"] == 16
    assert env["ROW_BYTES"] == 128
    assert env["Q_BYTES"] == 64 * 128
    assert env["KV_RING_BYTES"] == 2 * 2 * 64 * 128
    assert env["SMEM_BYTES"] == 32768  # max(Q, ring): Q lives in registers
    assert env["LIVE_REGS"] == 16 * (64 + 64) // 32 + 16 * 64 // 64
    assert env["REG_CAP"] == 255
    assert space.env({**BASE_POINT["mma"], "NUM_WARPS": 8, "BLOCK_M": 128, "MIN_BLOCKS": 2},
                     HD64, arch)["REG_CAP"] == 128
    assert env["SMEM_LIMIT"] == 163 * 1024
    env_q_in_smem = space.env({**BASE_POINT["mma"], "Q_IN_REGS": False}, HD64, arch)
    assert env_q_in_smem["SMEM_BYTES"] == 8192 + 32768


def test_wmma_derived_values_match_hand_computation() -> None:
    point = {**BASE_POINT["wmma"], "STAGES": 2}
    env = shipped("wmma").env(point, HD64, get_arch("sm_89"))
    row = (64 + 8) * 2
    tiles = 64 * row + 2 * 2 * 64 * row
    scratch = 4 * 16 * (64 + 4) * 4
    p_bytes = 4 * 16 * (64 + 8) * 2
    assert env["SMEM_BYTES"] == tiles + scratch + p_bytes == 72704
    assert env["LIVE_REGS"] == 32


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_base_points_are_admitted_everywhere(family: str, arch: str) -> None:
    space = shipped(family)
    for problem in space.problems():
        assert space.violations(BASE_POINT[family], problem, get_arch(arch)) == []


# ---- every constraint of every shipped space is exercised ----------------------------------

# (family, rule text, params override, problem, arch, extra domain values)
_TIGHT = dataclasses.replace(get_arch("sm_80"), max_threads=64)
CONSTRAINT_CASES = [
    ("mma", "HEAD_DIM % 16 == 0 and 16 <= HEAD_DIM <= 256", {}, {**HD64, "HEAD_DIM": 72},
     "sm_80", {}),
    ("mma", "BLOCK_M % (16 * NUM_WARPS) == 0", {"BLOCK_M": 32, "NUM_WARPS": 4}, HD64, "sm_80", {}),
    ("mma", "BLOCK_N % 16 == 0", {"BLOCK_N": 40}, HD64, "sm_80", {"BLOCK_N": 40}),
    ("mma", "THREADS <= MAX_THREADS", {}, HD64, _TIGHT, {}),
    ("mma", "SMEM_BYTES <= SMEM_LIMIT",
     dict(BLOCK_M=64, NUM_WARPS=4, BLOCK_N=128, STAGES=3, SWIZZLE="none", Q_IN_REGS=False),
     HD128, "sm_89", {}),
    ("mma", "LIVE_REGS <= 160",
     dict(BLOCK_M=128, NUM_WARPS=4, BLOCK_N=64, STAGES=1, SWIZZLE="none", Q_IN_REGS=True),
     HD128, "sm_80", {}),
    # 4 warps: 65536 / (2 * 128) registers is no cap below 255.
    ("mma", "MIN_BLOCKS == 1 or REG_CAP < 255", {"MIN_BLOCKS": 2}, HD64, "sm_80", {}),
    # 8 warps, 2 blocks: 128 registers, too few for 16 rows x (128 + 128) accumulators.
    ("mma", "MIN_BLOCKS == 1 or LIVE_REGS + HEAD_DIM // 2 + 24 <= REG_CAP",
     dict(BLOCK_M=128, NUM_WARPS=8, BLOCK_N=128, Q_IN_REGS=False, MIN_BLOCKS=2), HD128,
     "sm_80", {}),
    ("mma", "PIPELINE == 'split' or STAGES >= 2", {"PIPELINE": "joint", "STAGES": 1}, HD64,
     "sm_80", {}),
    ("wmma", "HEAD_DIM % 16 == 0 and 16 <= HEAD_DIM <= 256", {}, {**HD64, "HEAD_DIM": 72},
     "sm_80", {}),
    ("wmma", "WARP_M == 16", {"BLOCK_M": 64, "NUM_WARPS": 2}, HD64, "sm_80", {}),
    ("wmma", "BLOCK_N % 16 == 0", {"BLOCK_N": 40}, HD64, "sm_80", {"BLOCK_N": 40}),
    ("wmma", "THREADS <= MAX_THREADS", {}, HD64, _TIGHT, {}),
    ("wmma", "SMEM_BYTES <= SMEM_LIMIT",
     dict(BLOCK_M=128, NUM_WARPS=8, BLOCK_N=128, STAGES=1, SWIZZLE="pad", Q_IN_REGS=False),
     HD128, "sm_89", {}),
    ("wmma", "LIVE_REGS <= 160", {"Q_IN_REGS": True}, {**HD64, "HEAD_DIM": 176}, "sm_80", {}),
]


@pytest.mark.parametrize(
    ("family", "rule", "override", "problem", "arch", "extra"),
    CONSTRAINT_CASES,
    ids=[f"{c[0]}:{c[1]}" for c in CONSTRAINT_CASES],
)
def test_each_constraint_fires_alone(family: str, rule: str, override: dict, problem: dict,
                                     arch: str | Arch, extra: dict) -> None:
    data = shipped_data(family)
    params_table = dict(data["parameters"])  # type: ignore[call-overload]
    for name, value in extra.items():
        params_table[name] = [*params_table[name], value]
    space = SearchSpace.from_dict({**data, "parameters": params_table})
    target = get_arch(arch) if isinstance(arch, str) else arch
    point = {**BASE_POINT[family], **override}
    assert space.violations(point, problem, target) == [message_of(space, rule)]
    # The same point without the breaking change is admitted, so the case is about this rule.
    assert space.violations(BASE_POINT[family], HD64, get_arch("sm_80")) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_constraint_cases_cover_every_shipped_constraint(family: str) -> None:
    covered = {rule for fam, rule, *_ in CONSTRAINT_CASES if fam == family}
    assert covered == {c.rule.text for c in shipped(family).constraints}


@pytest.mark.parametrize("family", FAMILIES)
def test_big_config_breaks_only_the_sm89_shared_memory_limit(family: str) -> None:
    case = next(c for c in CONSTRAINT_CASES
                if c[0] == family and c[1] == "SMEM_BYTES <= SMEM_LIMIT")
    space = shipped(family)
    point = {**BASE_POINT[family], **case[2]}
    smem = space.env(point, HD128, get_arch("sm_89"))["SMEM_BYTES"]
    assert get_arch("sm_89").smem_per_block < smem <= get_arch("sm_90a").smem_per_block
    (why,) = space.violations(point, HD128, get_arch("sm_89"))
    assert "shared memory per block fits the target" in why
    assert "SMEM_BYTES <= SMEM_LIMIT" in why
    assert space.violations(point, HD128, get_arch("sm_90a")) == []


def test_block_m_not_a_multiple_of_warp_tiles_is_explained() -> None:
    point = {**BASE_POINT["mma"], "BLOCK_M": 64, "NUM_WARPS": 8}
    assert shipped("mma").violations(point, HD64, get_arch("sm_80")) == [
        "each warp owns whole m16 tiles of query rows (BLOCK_M % (16 * NUM_WARPS) == 0)"
    ]


def test_xor_swizzle_in_wmma_is_out_of_domain() -> None:
    point = {**BASE_POINT["wmma"], "SWIZZLE": "xor"}
    assert shipped("wmma").violations(point, HD64, get_arch("sm_80")) == [
        "SWIZZLE='xor' not in ('none', 'pad')"
    ]


def test_out_of_domain_and_missing_parameters_are_explained() -> None:
    space = shipped("mma")
    point = {**BASE_POINT["mma"], "BLOCK_M": 48}
    assert space.violations(point, HD64, get_arch("sm_80")) == [
        "BLOCK_M=48 not in (32, 64, 128, 256)"
    ]
    partial = {k: v for k, v in BASE_POINT["mma"].items() if k not in ("STAGES", "Q_IN_REGS")}
    assert space.violations(partial, HD64, get_arch("sm_80")) == [
        "missing parameters ['Q_IN_REGS', 'STAGES']"
    ]


# ---- parameters added later: legacy values ---------------------------------------------------

# What each shipped space fills into a point stored before the parameter existed: the value
# that builds the kernel as it was then (the commits that added them are in the TOMLs).
LEGACY = {
    "mma": {"LAZY_RESCALE": False, "MIN_BLOCKS": 1, "PIPELINE": "split"},
    "wgmma": {"TILE_ORDER": "head", "SCHEDULER": "static", "PACK_GQA": False,
              "P_BARRIER": "warpgroup", "O_STAGE": "own_or_q", "O_STORE": "threads"},
    "wmma": {},
}
WGMMA_BEFORE = dict(BLOCK_M=128, BLOCK_N=96, STAGES=2, SWIZZLE=128, P_FROM="regs",
                    INTRA_WG_OVERLAP=True, PINGPONG=False, PERSISTENT=True)  # as swept at ff1d722
WGMMA_CAUSAL = {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": True}


def test_shipped_spaces_declare_the_legacy_values() -> None:
    assert {s.family: s.legacy for s in default_spaces()} == LEGACY
    # and the parameters removed since, with the value each template still builds
    assert {s.family: s.retired for s in default_spaces()} == {
        "mma": {}, "wgmma": {"EXP_EMU": 0, "TILE_OVERLAP": False, "KV_MULTICAST": False},
        "wmma": {}}


def test_complete_fills_legacy_values_in_declared_order() -> None:
    space = shipped("wgmma")
    sm90 = get_arch("sm_90a")
    assert space.violations(WGMMA_BEFORE, WGMMA_CAUSAL, sm90) == [
        "missing parameters ['O_STAGE', 'O_STORE', 'PACK_GQA', 'P_BARRIER', 'SCHEDULER', "
        "'TILE_ORDER']"]
    done = space.complete(WGMMA_BEFORE)
    assert done == {**WGMMA_BEFORE, "TILE_ORDER": "head", "SCHEDULER": "static",
                    "PACK_GQA": False, "P_BARRIER": "warpgroup", "O_STAGE": "own_or_q",
                    "O_STORE": "threads"}
    assert list(done) == list(space.parameters)
    assert space.violations(done, WGMMA_CAUSAL, sm90) == []
    # A stored value wins over the legacy one; a complete point comes back as it was.
    later = {**done, "TILE_ORDER": "l2", "SCHEDULER": "dynamic"}
    assert space.complete(later) == later
    # Only the layout in between (TILE_ORDER, no SCHEDULER) is filled where it lacks.
    assert space.complete({**WGMMA_BEFORE, "TILE_ORDER": "l2"})["SCHEDULER"] == "static"
    assert WGMMA_BEFORE == dict(BLOCK_M=128, BLOCK_N=96, STAGES=2, SWIZZLE=128, P_FROM="regs",
                                INTRA_WG_OVERLAP=True, PINGPONG=False, PERSISTENT=True)


def test_complete_leaves_what_has_no_legacy_value_to_violations() -> None:
    space = shipped("mma")
    partial = {k: v for k, v in BASE_POINT["mma"].items() if k not in ("STAGES", "PIPELINE")}
    done = space.complete({**partial, "GONE": 1})
    assert done["PIPELINE"] == "split" and "STAGES" not in done
    assert list(done)[-1] == "GONE"  # undeclared names are kept, after the declared ones
    assert space.violations(done, HD64, get_arch("sm_80")) == ["missing parameters ['STAGES']"]


def test_the_shipped_sweeps_complete_to_points_todays_spaces_admit() -> None:
    """tests/data's sweeps were taken before TILE_ORDER and SCHEDULER: filled with their
    legacy values, every point they hold is a point of today's spaces."""
    from evoengine.search.replay import load_record

    spaces = {s.family: s for s in default_spaces()}
    sweeps = sorted((Path(__file__).parent / "data").glob("sweep-*.json.gz"))
    assert sweeps
    for path in sweeps:
        record = load_record(path)
        assert record.families["wgmma"]["parameters"] == list(WGMMA_BEFORE)
        problem, arch = record.workload.problem(), get_arch(record.arch)
        for p in record.points:
            space = spaces[p.family]
            done = space.complete(p.params)
            assert list(done) == list(space.parameters)
            assert space.violations(done, problem, arch) == [], (path.name, p.params)


# Regression: membership used ==, so 64.0 and True passed for 64 and 1 and rendered as
# "64.0" / "True" in C++.
@pytest.mark.parametrize(("override", "message"), [({"BLOCK_M": 64.0}, "BLOCK_M=64.0 not in"),
                                                   ({"STAGES": True}, "STAGES=True not in"),
                                                   ({"Q_IN_REGS": 1}, "Q_IN_REGS=1 not in")])
def test_values_equal_to_but_not_of_the_domain_are_rejected(override: dict, message: str) -> None:
    point = {**BASE_POINT["mma"], **override}
    (why,) = shipped("mma").violations(point, HD64, get_arch("sm_80"))
    assert why.startswith(message)


@pytest.mark.parametrize("problem", [{**HD64, "HEAD_DIM": 64.0}, {**HD64, "CAUSAL": 0}])
def test_problem_values_of_the_wrong_type_are_rejected(problem: dict) -> None:
    (why,) = shipped("mma").violations(BASE_POINT["mma"], problem, get_arch("sm_80"))
    assert "not a problem value of type" in why


# ---- admitted ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_admitted_nonempty_and_within_shared_memory(family: str, arch: str) -> None:
    space = shipped(family)
    target = get_arch(arch)
    for problem in space.problems():
        admitted = space.admitted(problem, target)
        assert admitted, (family, arch, problem)
        assert len(admitted) < space.size()  # the constraints reject something
        for point in admitted:
            env = space.env(point, problem, target)
            assert env["SMEM_BYTES"] <= target.smem_per_block
            assert env["THREADS"] <= target.max_threads


@pytest.mark.parametrize("family", FAMILIES)
def test_sm89_admits_a_strict_subset_of_sm90a_at_head_dim_128(family: str) -> None:
    space = shipped(family)
    on_89 = space.admitted(HD128, get_arch("sm_89"))
    on_90 = space.admitted(HD128, get_arch("sm_90a"))
    assert len(on_89) < len(on_90)
    assert all(p in on_90 for p in on_89)


def test_family_not_targeting_an_arch_is_rejected() -> None:
    space = SearchSpace.from_dict({**shipped_data("mma"), "archs": ["sm_90a"]})
    assert space.archs == ("sm_90a",)
    assert space.supports(get_arch("sm_90a"))
    assert not space.supports(get_arch("sm_80"))
    assert space.violations(BASE_POINT["mma"], HD64, get_arch("sm_80")) == [
        "family mma does not target sm_80"
    ]
    assert space.admitted(HD64, get_arch("sm_80")) == []
    assert space.admitted(HD64, get_arch("sm_90a"))


def test_arch_alias_in_space_targets_the_canonical_arch() -> None:
    # Regression: the alias used to be kept as typed, so the space targeted nothing.
    space = SearchSpace.from_dict({**shipped_data("mma"), "archs": ["sm_90", "SM80"]})
    assert space.archs == ("sm_90a", "sm_80")
    assert space.supports(get_arch("sm_90a"))
    assert space.admitted(HD64, get_arch("sm_90a"))


# ---- sample -----------------------------------------------------------------------------------


def test_sample_is_deterministic() -> None:
    items = list(range(100))
    first = sample(items, 5, seed=3)
    assert first == sample(items, 5, seed=3)
    assert len(first) == 5 == len(set(first))
    assert set(first) <= set(items)
    assert first != sample(items, 5, seed=4)
    assert sample(items, 5) == sample(items, 5, seed=0)
    assert items == list(range(100))  # input not shuffled in place


def test_sample_all_when_n_is_none_or_large() -> None:
    items = [3, 1, 2]
    for n in (None, 3, 10):
        got = sample(items, n)
        assert got == [3, 1, 2]
        assert got is not items
    assert sample(items, 0) == []


def test_sample_of_admitted_points_is_stable() -> None:
    space = shipped("mma")
    admitted = space.admitted(HD64, get_arch("sm_80"))
    picks = sample(admitted, 3, seed=7)
    assert picks == sample(space.admitted(HD64, get_arch("sm_80")), 3, seed=7)
    assert all(p in admitted for p in picks)


# ---- malformed files --------------------------------------------------------------------------

TINY = """\
family = "mma"
description = "tiny"
archs = ["sm_80", "sm_90a"]

[problem]
HEAD_DIM = [64]

[parameters]
BLOCK_M = [32, 64]

[derived]
BYTES = "BLOCK_M * HEAD_DIM * 2"

[[constraints]]
rule = "BYTES <= SMEM_LIMIT"
why = "fits"
"""


def edit(old: str, new: str) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, 1)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def test_tiny_space_loads(tmp_path: Path) -> None:
    space = SearchSpace.load(write(tmp_path, TINY))
    assert space.family == "mma"
    assert space.archs == ("sm_80", "sm_90a")
    assert space.parameters == {"BLOCK_M": (32, 64)}
    assert space.admitted({"HEAD_DIM": 64}, get_arch("sm_80")) == [{"BLOCK_M": 32},
                                                                   {"BLOCK_M": 64}]
    assert space.legacy == {} and space.complete({}) == {}
    later = SearchSpace.load(write(tmp_path, TINY + "\n[legacy]\nBLOCK_M = 64\n"))
    assert later.legacy == {"BLOCK_M": 64} and later.complete({}) == {"BLOCK_M": 64}
    assert later != space  # the legacy values are part of the space


def test_a_retired_parameter_keeps_its_points_and_rejects_its_other_values(
        tmp_path: Path) -> None:
    """A parameter removed after points were measured with it: a point naming the value the
    template still builds completes without it (and so keeps building what it measured); one
    naming a removed value is rejected, not built as the other."""
    space = SearchSpace.load(write(tmp_path, TINY + '\n[retired]\nLSE_READ = "chunk"\n'))
    sm80 = get_arch("sm_80")
    assert space.retired == {"LSE_READ": "chunk"}
    assert space.complete({"BLOCK_M": 32, "LSE_READ": "chunk"}) == {"BLOCK_M": 32}
    assert space.violations({"BLOCK_M": 32, "LSE_READ": "chunk"}, {"HEAD_DIM": 64}, sm80) == []
    shfl = space.complete({"BLOCK_M": 32, "LSE_READ": "shfl"})
    assert shfl == {"BLOCK_M": 32, "LSE_READ": "shfl"}
    assert space.violations(shfl, {"HEAD_DIM": 64}, sm80) == [
        "LSE_READ='shfl' was retired: only 'chunk' is built now"]
    with pytest.raises(SpaceError, match="retired.BLOCK_M is still declared"):
        SearchSpace.load(write(tmp_path, TINY + "\n[retired]\nBLOCK_M = 32\n"))
    # A search's domain: the kept value names today's point (a stored elite or prior seeds
    # it); the removed value names no point, so it seeds nothing.
    from evoengine.search.domain import Domain
    from evoengine.workload import Workload

    domain = Domain([space], Workload(1, 1, 128, 64), sm80)
    assert domain.point(domain.identity("mma", {"BLOCK_M": 32, "LSE_READ": "chunk"})) == (
        "mma", {"BLOCK_M": 32})
    assert domain.point(domain.identity("mma", {"BLOCK_M": 32, "LSE_READ": "shfl"})) is None


BAD_FILES = {
    "missing family": (edit('family = "mma"\n', ""), "missing 'family'"),
    "missing archs": (edit('archs = ["sm_80", "sm_90a"]\n', ""), "missing 'archs'"),
    "missing problem": (edit("[problem]\nHEAD_DIM = [64]\n", ""), "missing 'problem'"),
    "missing parameters": (edit("[parameters]\nBLOCK_M = [32, 64]\n", ""),
                           "missing 'parameters'"),
    "unknown top-level key": (edit('family = "mma"\n', 'family = "mma"\nfamilly = "x"\n'),
                              "unknown keys ['familly']"),
    "empty parameter domain": (edit("BLOCK_M = [32, 64]", "BLOCK_M = []"),
                               "parameters.BLOCK_M must be a non-empty list"),
    "scalar problem domain": (edit("HEAD_DIM = [64]", "HEAD_DIM = 64"),
                              "problem.HEAD_DIM must be a non-empty list"),
    "parameters not a table": (edit('description = "tiny"\n', 'description = "t"\nparameters = 1\n')
                               .replace("[parameters]\nBLOCK_M = [32, 64]\n", ""),
                               "[parameters] must be a table"),
    "name in problem and parameters": (edit("HEAD_DIM = [64]", "HEAD_DIM = [64]\nBLOCK_M = [8]"),
                                       "names in both [problem] and [parameters]: ['BLOCK_M']"),
    "unknown name in rule": (edit("BYTES <= SMEM_LIMIT", "BYTES <= SMEM_LIMT"),
                             "unknown names ['SMEM_LIMT']"),
    "unknown name in derived": (edit("BLOCK_M * HEAD_DIM * 2", "BLOCK_M * HEAD_DIMS * 2"),
                                "derived.BYTES: unknown names ['HEAD_DIMS']"),
    "derived uses a later name": (edit('BYTES = "BLOCK_M * HEAD_DIM * 2"',
                                       'BYTES = "LATER * 2"\nLATER = "BLOCK_M"'),
                                  "derived.BYTES: unknown names ['LATER']"),
    "unparsable rule": (edit('"BYTES <= SMEM_LIMIT"', '"BYTES <="'), "cannot parse"),
    "call in rule": (edit('"BYTES <= SMEM_LIMIT"', '"len(BYTES) > 0"'), "Call not allowed"),
    "dunder in derived": (edit('"BLOCK_M * HEAD_DIM * 2"', '"().__class__"'),
                          "Attribute not allowed"),
    "rule not a string": (edit('rule = "BYTES <= SMEM_LIMIT"', "rule = 3"),
                          "expected an expression string"),
    "unknown arch": (edit('"sm_80", "sm_90a"', '"sm_80", "sm_75"'), "unknown arch 'sm_75'"),
    "unknown family": (edit('family = "mma"', 'family = "nosuch"'), "family 'nosuch' has no"),
    "family not a string": (edit('family = "mma"', "family = 3"), "family 3 has no"),
    "constraint without why": (edit('why = "fits"\n', ""),
                               "constraints[0] must have exactly 'rule' and 'why'"),
    "constraint with extra key": (edit('why = "fits"', 'why = "fits"\nnote = "x"'),
                                  "constraints[0] must have exactly 'rule' and 'why'"),
    "second constraint bad": (TINY + '\n[[constraints]]\nrule = "1 == 1"\n',
                              "constraints[1] must have exactly 'rule' and 'why'"),
    "toml syntax error": (edit('family = "mma"', 'family = "mma'), "not valid TOML"),
    "legacy not a table": (edit('description = "tiny"\n', 'description = "tiny"\nlegacy = 1\n'),
                           "[legacy] must be a table"),
    "legacy of no parameter": (TINY + "\n[legacy]\nBLOCK_N = 64\n",
                               "legacy.BLOCK_N is not a parameter"),
    "legacy out of domain": (TINY + "\n[legacy]\nBLOCK_M = 128\n",
                             "legacy.BLOCK_M = 128 is not in its domain (32, 64)"),
    "legacy of another type": (TINY + '\n[legacy]\nBLOCK_M = "64"\n',
                               "legacy.BLOCK_M = '64' is not in its domain"),
    "untested of no parameter": (TINY + "\n[untested]\nBLOCK_N = [64]\n",
                                 "untested.BLOCK_N is not a parameter"),
    "untested already searched": (TINY + "\n[untested]\nBLOCK_M = [64, 128]\n",
                                  "untested.BLOCK_M: [64] already in its domain"),
    "untested not a list": (TINY + "\n[untested]\nBLOCK_M = 128\n",
                            "untested.BLOCK_M must be a non-empty list"),
    "constraint reads the workload": (edit("BYTES <= SMEM_LIMIT", "KV_GROUP > 0"),
                                      "unknown names ['KV_GROUP']"),
    "workload rule without why": (TINY + '\n[[workload_rules]]\nrule = "KV_GROUP > 1"\n',
                                  "workload_rules[0] must have exactly 'rule' and 'why'"),
    "workload rule of an unknown name": (TINY + '\n[[workload_rules]]\nrule = "SEQ > 1"\n'
                                         'why = "x"\n', "unknown names ['SEQ']"),
    "workload rules not an array": (edit('description = "tiny"\n',
                                         'description = "tiny"\nworkload_rules = 1\n'),
                                    "workload_rules must be an array of tables"),
}


GROUP_RULE = (TINY.replace("BLOCK_M = [32, 64]", "BLOCK_M = [32, 64]\nPACK = [false, true]")
              + '\n[[workload_rules]]\nrule = "not PACK or KV_GROUP % 2 == 0"\n'
                'why = "one head per token"\n')


def test_workload_rules_drop_points_only_for_the_workload(tmp_path: Path) -> None:
    """[[workload_rules]] read the workload's KV_GROUP: a domain for an MHA workload drops the
    packed points (they would repeat the unpacked kernels' work) and reports why; a GQA
    workload's keeps them; the space alone (compile-check) admits every point."""
    from evoengine.search.domain import Domain
    from evoengine.workload import Workload

    space = SearchSpace.load(write(tmp_path, GROUP_RULE))
    sm80, hd64 = get_arch("sm_80"), {"HEAD_DIM": 64}
    assert len(space.admitted(hd64, sm80)) == 4
    assert space.workload_violations({"BLOCK_M": 32, "PACK": True}, hd64, sm80,
                                     {"KV_GROUP": 1}) == [
        "one head per token (not PACK or KV_GROUP % 2 == 0)"]
    for kv_heads, packed in ((8, []), (4, [True]), (1, [True])):
        w = Workload.parse("1,8,256,64", kv_heads=kv_heads)
        domain = Domain([space], w, sm80)
        assert sorted({p["PACK"] for _, p in domain.all_points()}) == [False, *packed]
        bad = domain.violations("mma", {"BLOCK_M": 32, "PACK": True})
        assert bool(bad) is not bool(packed), (kv_heads, bad)


def test_first_admitted_is_the_first_in_order_and_reads_workload_rules(tmp_path: Path) -> None:
    """The first admitted point of the grid, or None; given a workload's facts, its rules too
    (an MHA workload's first point is unpacked whatever the order)."""
    space = SearchSpace.load(write(tmp_path, GROUP_RULE.replace("PACK = [false, true]",
                                                                 "PACK = [true, false]")))
    sm80, hd64 = get_arch("sm_80"), {"HEAD_DIM": 64}
    assert space.first_admitted(hd64, sm80) == space.admitted(hd64, sm80)[0] == {
        "BLOCK_M": 32, "PACK": True}
    assert space.first_admitted(hd64, sm80, {"KV_GROUP": 1}) == {"BLOCK_M": 32, "PACK": False}
    assert space.first_admitted(hd64, sm80, {"KV_GROUP": 4}) == {"BLOCK_M": 32, "PACK": True}
    assert space.first_admitted({"HEAD_DIM": 10**6}, sm80) is None  # no tile fits


def test_untested_values_are_admitted_only_when_asked(tmp_path: Path) -> None:
    """[untested]: built and checked offline, not yet on a GPU. The search's space never
    admits them (nor proposes them); ``with_untested()`` does, for the GPU tests."""
    space = SearchSpace.load(write(tmp_path, TINY + "\n[untested]\nBLOCK_M = [128]\n"))
    sm80 = get_arch("sm_80")
    assert space.parameters == {"BLOCK_M": (32, 64)} and space.untested == {"BLOCK_M": (128,)}
    assert space.violations({"BLOCK_M": 128}, {"HEAD_DIM": 64}, sm80)
    trial = space.with_untested()
    assert trial.parameters == {"BLOCK_M": (32, 64, 128)} and trial.untested == {}
    assert trial.admitted({"HEAD_DIM": 64}, sm80) == [{"BLOCK_M": 32}, {"BLOCK_M": 64},
                                                      {"BLOCK_M": 128}]


def test_shipped_untested_values_are_outside_the_searched_domains() -> None:
    for path in sorted(paths.SPACES.glob("*.toml")):
        space = SearchSpace.load(path)
        for name, values in space.untested.items():
            assert not set(values) & set(space.parameters[name]), (path.name, name)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_names_file_and_problem(tmp_path: Path, case: str) -> None:
    text, problem = BAD_FILES[case]
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as info:
        SearchSpace.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert problem in message.removeprefix(f"{path}: "), message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(SpaceError, match="no such search-space file") as info:
        SearchSpace.load(path)
    assert str(info.value).startswith(f"{path}: ")


def test_from_dict_without_path_says_search_space() -> None:
    with pytest.raises(SpaceError, match=r"^search space: missing 'archs'"):
        SearchSpace.from_dict({"family": "mma", "problem": {}, "parameters": {}})


# Regressions: these were accepted (any folder under templates/ passed as a family, and a
# non-string why), raised a bare TypeError/ValueError, or named the wrong problem ("unknown
# arch 's'" for archs = "sm_80").
@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        pytest.param('family = "mma"', 'family = ""', "family", id="empty"),
        pytest.param('family = "mma"', 'family = "."', "family", id="dot"),
        pytest.param('family = "mma"', 'family = ".."', "family", id="parent"),
        pytest.param('family = "mma"', 'family = "common"', "family", id="common"),
        pytest.param('family = "mma"', 'family = "mma/../wmma"', "family", id="path"),
        pytest.param('archs = ["sm_80", "sm_90a"]', "archs = 5", "archs", id="archs-int"),
        pytest.param('archs = ["sm_80", "sm_90a"]', 'archs = "sm_80"', "archs", id="archs-str"),
        pytest.param('archs = ["sm_80", "sm_90a"]', "archs = []", "archs", id="archs-empty"),
        pytest.param('archs = ["sm_80", "sm_90a"]', "archs = [80]", "archs", id="archs-number"),
        pytest.param('[derived]\nBYTES = "BLOCK_M * HEAD_DIM * 2"\n', "", "derived",
                     id="derived-int"),
        pytest.param('[[constraints]]\nrule = "BYTES <= SMEM_LIMIT"\nwhy = "fits"\n', "",
                     "constraints", id="constraints-int"),
        pytest.param('family = "mma"', 'family = "mma"\nkind = 5', "kind",
                     id="kind-not-a-name"),
        pytest.param('why = "fits"', "why = 3", "why", id="why-not-string"),
        pytest.param('why = "fits"', 'why = "  "', "why", id="why-blank"),
    ],
)
def test_more_bad_files_give_space_error(tmp_path: Path, old: str, new: str,
                                         problem: str) -> None:
    text = edit(old, new)
    if not new:  # the table is gone; a top-level scalar takes its place, before any table
        text = text.replace('description = "tiny"\n', f'description = "tiny"\n{problem} = 5\n')
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as info:
        SearchSpace.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert problem in message.removeprefix(f"{path}: "), message


# Regression: a derived SMEM_LIMIT used to override the target's, defeating the constraint.
@pytest.mark.parametrize("name", ["BLOCK_M", "HEAD_DIM", "SMEM_LIMIT"])
def test_derived_may_not_shadow_known_names(tmp_path: Path, name: str) -> None:
    text = edit('BYTES = "BLOCK_M * HEAD_DIM * 2"',
                f'{name} = "10 ** 9"\nBYTES = "BLOCK_M * HEAD_DIM * 2"')
    with pytest.raises(SpaceError, match=name):
        SearchSpace.load(write(tmp_path, text))


# ---- backward families -------------------------------------------------------------------


def test_backward_spaces_stay_out_of_the_forward_default() -> None:
    everything = default_spaces(None)
    backward = [s for s in everything if s.kind == "bwd"]
    assert [s.family for s in backward] == ["mma_bwd", "wgmma_bwd"]
    assert all(s.kind == "fwd" for s in default_spaces())
    assert {s.family for s in default_spaces()} | {"mma_bwd", "wgmma_bwd", "decode"} == \
        {s.family for s in everything}
    assert [s.family for s in default_spaces("bwd")] == ["mma_bwd", "wgmma_bwd"]
    assert [s.family for s in default_spaces("decode")] == ["decode"]


def test_kind_defaults_to_forward(tmp_path: Path) -> None:
    assert SearchSpace.load(write(tmp_path, edit("", ""))).kind == "fwd"
    text = edit('family = "mma"', 'family = "mma"\nkind = "bwd"')
    assert SearchSpace.load(write(tmp_path, text)).kind == "bwd"


def test_mma_bwd_space_declares_the_issue_parameters() -> None:
    sp = shipped("mma_bwd")
    assert sp.kind == "bwd" and {"sm_80", "sm_86", "sm_89", "sm_90a"} == set(sp.archs)
    assert list(sp.problem) == ["HEAD_DIM", "DTYPE", "CAUSAL"]
    assert {"BLOCK_M", "BLOCK_N", "NUM_WARPS", "STAGES", "SWIZZLE"} <= set(sp.parameters)
    assert sp.parameters["DQ_ACCUM"] == ("atomic", "separate")
    assert "SMEM_BYTES" in sp.derived and "THREADS" in sp.derived
    assert all(c.why for c in sp.constraints)
    for arch in ("sm_80", "sm_89", "sm_90a"):
        for problem in sp.problems():
            assert sp.admitted(problem, get_arch(arch)), (arch, problem)


@pytest.mark.parametrize("name, problem_, arch, workload", [
    ("wgmma.toml", {"HEAD_DIM": 64, "DTYPE": "bf16", "CAUSAL": True}, "sm_90a", {"KV_GROUP": 4}),
    ("wgmma.toml", {"HEAD_DIM": 48, "DTYPE": "fp16", "CAUSAL": False}, "sm_90a", None),
    ("wgmma_bwd.toml", {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}, "sm_90a", None),
    ("mma.toml", {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": False}, "sm_89", None),
    ("mma.toml", {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": False}, "sm_90a", None),
])
def test_admitted_prunes_to_the_points_every_constraint_admits(
        name: str, problem_: dict, arch: str, workload: dict | None) -> None:
    """iter_admitted checks each constraint once its parameters have values and never extends
    a prefix that breaks one: the same points, in the same order, as ``violations`` (and the
    workload rules) on every grid point; none for a target the family does not build."""
    space = SearchSpace.load(paths.SPACES / name).with_untested()
    target = get_arch(arch)
    want = [p for p in space.grid() if not space.violations(p, problem_, target) and not (
        workload is not None and space.workload_violations(p, problem_, target, workload))]
    assert want
    assert list(space.iter_admitted(problem_, target, workload)) == want
    assert not space.admitted(problem_, get_arch("sm_80")) or space.supports(get_arch("sm_80"))
