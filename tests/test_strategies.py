"""``benchmarks/strategies.py`` at a small budget: every strategy, Kernel Tuner's GA in its
simulation mode included, runs on a (SYNTHETIC) record and finds the optimum, counting
evaluations the way the search loop does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from evoengine import paths
from evoengine.search.replay import Record, replay_domain, synthetic_record
from evoengine.space import SearchSpace
from tests.test_search import WORKLOAD


def load_benchmark() -> ModuleType:
    path = paths.ROOT / "benchmarks" / "strategies.py"
    spec = importlib.util.spec_from_file_location("strategies_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


strategies = load_benchmark()


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> SearchSpace:
    """mma with 144 grid points (BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, SWIZZLE, Q_IN_REGS)."""
    text = (paths.SPACES / "mma.toml").read_text()
    start, end = text.index("[parameters]"), text.index("[derived]")
    params = ('[parameters]\nBLOCK_M = [64, 128]\nBLOCK_N = [32, 64, 128]\nNUM_WARPS = [4, 8]\n'
              'STAGES = [1, 2, 3]\nSWIZZLE = ["pad", "xor"]\nQ_IN_REGS = [true, false]\n'
              'LAZY_RESCALE = [true]\nMIN_BLOCKS = [1]\nPIPELINE = ["split"]\n\n')
    path = tmp_path_factory.mktemp("space") / "mma.toml"
    path.write_text(text[:start] + params + text[end:])
    return SearchSpace.load(path)


@pytest.fixture(scope="module")
def record(space: SearchSpace) -> Record:
    return synthetic_record(WORKLOAD, spaces=[space], seed=1)


def test_every_strategy_finds_the_optimum(record: Record, space: SearchSpace) -> None:
    res = strategies.benchmark(record, strategies.STRATEGIES, seeds=3, budget=None, within=0.0,
                               spaces=[space])
    n = res["domain"]
    assert n == len(replay_domain(record, [space])) > 50
    assert res["points_within"] == 1 and res["optimum_us"] == record.optimum().median_us
    for name in strategies.STRATEGIES:
        s = res["strategies"][name]
        assert s["reached"] == s["runs"] == 3, (name, s)
        assert all(1 <= c <= n for c in s["evaluations"]), (name, s)
    assert len(set(res["strategies"]["random"]["evaluations"])) > 1  # seeds differ
    assert len(set(res["strategies"]["kt-ga"]["evaluations"])) > 1
    text = strategies.table([res])
    assert "SYNTHETIC" in text and "kt-ga" in text and "evo/random" in text


def test_a_loose_target_is_met_by_the_first_valid_evaluation(record: Record, space: SearchSpace,
                                                             tmp_path: Path) -> None:
    """With every valid time on target, the count is 1 + the failures drawn before it: the
    same rule for our strategies and for Kernel Tuner."""
    domain = replay_domain(record, [space])
    failures = sum(not p.ok for p in record.points)
    assert failures > 0
    for seed in range(4):
        count = strategies.run_ours("random", domain, record, seed, len(domain), float("inf"))
        assert count is not None and 1 <= count <= failures + 1
    kt = strategies.KernelTuner(domain, record, tmp_path)
    kt.check_space()
    for seed in range(3):
        count = kt.run(seed, len(domain), float("inf"))
        assert count is not None and 1 <= count <= failures + 1


def test_a_budget_censors_runs(record: Record, space: SearchSpace) -> None:
    res = strategies.benchmark(record, ["random"], seeds=4, budget=2, within=0.0,
                               spaces=[space])
    s = res["strategies"]["random"]
    assert res["budget"] == 2 and s["reached"] < 4
    assert s["median"] is None or s["median"] <= 2
    assert all(c is None or c <= 2 for c in s["evaluations"])

