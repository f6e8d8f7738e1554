"""``benchmarks/decode_bench.py`` without a GPU: the grid it times and the points it takes."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType

from evoengine import paths
from evoengine.problems.decode import DecodeWorkload
from tests.test_decode import decode_store


def load_benchmark() -> ModuleType:
    path = paths.ROOT / "benchmarks" / "decode_bench.py"
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_benchmark()


def grid_args(**over: object) -> argparse.Namespace:
    args = dict(workloads=None, layout=["paged", "contiguous"], q_len=[1, 4], heads=None,
                batch=[1, 8, 64], cache=[4096, 32768, 131072], dtype="fp16")
    return argparse.Namespace(**{**args, **over})


def test_grid_is_the_issues_less_rows_past_16_gb() -> None:
    rows = bench.grid(grid_args())
    assert len(rows) == 2 * 2 * 2 * 3 * 3 - 8  # batch 64 at 128K: 34 GB of K and V
    assert all(w.kv_bytes() <= bench.MAX_KV_BYTES and w.head_dim == 128 for w in rows)
    assert {w.page_size for w in rows if w.paged} == {64}
    keys = ["decode-b1-q1-h32-kv8-d128-c4096-contig-fp16"]
    assert [w.key() for w in bench.grid(grid_args(workloads=keys))] == keys


def test_points_from_json_and_from_a_store(tmp_path: Path) -> None:
    point = {"BLOCK_N": 64}
    (tmp_path / "p.json").write_text(json.dumps([point]))
    assert bench.points_for(argparse.Namespace(points=str(tmp_path / "p.json"), store=None)) \
        == {"*": [point]}
    w = DecodeWorkload(8, 1, 32, 8, 128, 4096)
    decode_store(tmp_path / "evo.db", "sm_90a", [w])
    found = bench.points_for(argparse.Namespace(points=None, store=str(tmp_path / "evo.db")),
                             "sm_90a")
    assert set(found) == {w.key(), "*"} and found[w.key()] == found["*"]
    assert found["*"][0]["SPLIT_POLICY"] == "waves"


def test_summary_reports_the_issues_targets() -> None:
    rows = [dict(batch=8, cache_len=32768, ours_us=1.0, bandwidth_fraction=0.97,
                 vs_best_anchor=1.1),
            dict(batch=1, cache_len=32768, ours_us=1.0, bandwidth_fraction=0.8,
                 vs_best_anchor=0.9)]
    text = bench.summary(rows)
    assert "0.970-0.970" in text and "0.800-0.800 at batch 1, cache 32K" in text
    assert "best anchor on 1 of 2 rows" in text


def test_merge_points_pair_the_two_merges() -> None:
    """benchmarks/decode_points.json: each point twice, slices then atomic, the rest equal,
    every one admitted for the bench's rows (d128 fp16, paged and contiguous) on sm_90a."""
    from evoengine.arch import get_arch
    from evoengine.space import SearchSpace

    points = json.loads((paths.ROOT / "benchmarks" / "decode_points.json").read_text())
    space = SearchSpace.load(paths.SPACES / "decode.toml")
    assert len(points) % 2 == 0 and len(points) >= 8
    for slices, atomic in zip(points[::2], points[1::2], strict=True):
        assert (slices["MERGE"], atomic["MERGE"]) == ("slices", "atomic")
        assert dict(slices, MERGE="atomic") == atomic
        for p in (slices, atomic):
            assert list(space.complete(p)) == list(space.parameters)  # the rest: legacy values
            for paged in (True, False):
                problem = {"HEAD_DIM": 128, "DTYPE": "fp16", "PAGED": paged}
                assert not space.violations(space.complete(p), problem, get_arch("sm_90a")), p
