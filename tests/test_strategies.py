"""``benchmarks/strategies.py`` at a small budget: every strategy, Kernel Tuner's GA in its
simulation mode included, runs on a (SYNTHETIC) record and gets within 2% of its optimum;
ours run the search loop itself, counted in the search's own store."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import optuna
import pytest

from evoengine import paths
from evoengine.search.replay import (
    Record,
    load_record,
    replay_domain,
    save_record,
    synthetic_record,
)
from evoengine.space import SearchSpace
from evoengine.store import Store
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
def record(space: SearchSpace, tmp_path_factory: pytest.TempPathFactory) -> Record:
    """A SYNTHETIC record, saved (the search's compiler processes read it from its file)."""
    return load_record(save_record(synthetic_record(WORKLOAD, spaces=[space], seed=1),
                                   tmp_path_factory.mktemp("record") / "sweep.json.gz"))


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=strategies.scratch_dir()) as tmp:
        yield Path(tmp)


def search_measurements(path: Path) -> list[Any]:
    with Store(f"sqlite:///{path}") as store:
        return [m for m in store.measurements() if m.extra["phase"] == "search"]


def test_every_strategy_gets_within_the_target(record: Record, space: SearchSpace) -> None:
    res = strategies.benchmark(record, strategies.STRATEGIES, seeds=1, budget=None,
                               spaces=[space])
    n = res["domain"]
    assert n == len(replay_domain(record, [space])) > 50
    assert res["optimum_us"] == record.optimum().median_us
    assert res["target_us"] == res["optimum_us"] * (1 + strategies.WITHIN)
    assert 1 < res["points_within"] < 10
    for name in strategies.STRATEGIES:
        s = res["strategies"][name]
        assert s["reached"] == s["runs"] == 1, (name, s)
        assert all(1 <= c <= n for c in s["evaluations"]), (name, s)
    text = strategies.table([res])
    assert "SYNTHETIC" in text and "kt-ga" in text and "evo/random" in text


def test_our_strategies_are_counted_in_the_search_s_own_store(record: Record, space: SearchSpace,
                                                               workdir: Path) -> None:
    """Each run is ``evoengine.search.search`` on the replay, in a store of its own: the count
    is the position of the first measurement within the target among the search-phase
    measurements it wrote, and the search stopped there (only the points already in flight
    were measured after it). With every valid time on target, that is 1 + the failures
    drawn before the first valid point."""
    domain = replay_domain(record, [space])
    failures = sum(not p.ok for p in record.points)
    assert failures > 0
    measured = []
    for seed in range(2):
        count = strategies.run_ours("random", domain, record, seed, len(domain),
                                    float("inf"), workdir)
        store = workdir / f"random-seed{seed}.db"
        ms = search_measurements(store)
        assert count is not None and 1 <= count <= failures + 1
        assert [m.ok for m in ms[:count]] == [False] * (count - 1) + [True]
        assert len(ms) <= count + 4  # and those in flight: the lookahead of one worker
        measured.append([m.identity for m in ms])
        study = optuna.load_study(study_name=f"sm_90a-{WORKLOAD.key()}",
                                  storage=f"sqlite:///{store}")
        assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) >= 1
    assert measured[0] != measured[1]  # the seeds differ


def test_kernel_tuner_counts_the_same_way(record: Record, space: SearchSpace,
                                          workdir: Path) -> None:
    """The same rule for Kernel Tuner: with every valid time on target, 1 + the failures
    drawn before the first valid point; and its seeds differ."""
    domain = replay_domain(record, [space])
    failures = sum(not p.ok for p in record.points)
    kt = strategies.KernelTuner(domain, record, workdir)
    kt.check_space()
    for seed in range(3):
        count = kt.run(seed, len(domain), float("inf"))
        assert count is not None and 1 <= count <= failures + 1
    target = record.optimum().median_us * (1 + strategies.WITHIN)
    counts = [kt.run(seed, len(domain), target) for seed in range(3)]
    assert None not in counts and len(set(counts)) > 1


def test_a_budget_censors_runs(record: Record, space: SearchSpace) -> None:
    res = strategies.benchmark(record, ["random"], seeds=2, budget=2, within=0.0,
                               spaces=[space])
    s = res["strategies"]["random"]
    assert res["budget"] == 2 and s["reached"] < 2
    assert s["median"] is None or s["median"] <= 2
    assert all(c is None or c <= 2 for c in s["evaluations"])
