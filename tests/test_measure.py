"""Tests of evoengine.measure that need no GPU: the method text result files carry."""

from __future__ import annotations

import re

import pytest

from evoengine import measure, paths


def test_method_text_reads_the_constants() -> None:
    assert measure.METHOD == (
        f"{measure.TIMING} (graph replay of {measure.GRAPH_CALLS} calls, for every contender, "
        f"when the workload is under {measure.GRAPH_BELOW_FLOPS / 1e9:g} GFLOP), inputs rotated "
        f"over >={measure.L2_FLUSH_BYTES >> 20} MB")
    for value in (measure.WARMUP_CALLS, measure.REPS, measure.SETTLE_S):
        assert f"{value:g}" in measure.TIMING


def test_the_method_is_spelled_out_only_in_measure() -> None:
    """A tool that writes the timing method in its own words keeps them when the constants
    change (the 10-warm-up, no-settling texts of 2026-11-22 outlived SETTLE_S)."""
    copies = re.compile(r"\d+ warm-up calls|median of \d+")
    files = [*(paths.ROOT / "evoengine").rglob("*.py"), *(paths.ROOT / "benchmarks").rglob("*.py"),
             *(paths.ROOT / "experiments").rglob("*.py")]
    found = [f.relative_to(paths.ROOT).as_posix() for f in files
             if f.name != "measure.py" and copies.search(f.read_text())]
    assert found == []


def test_flashattention4_is_skipped_with_one_note_where_it_does_not_import(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from evoengine import measure
    from evoengine.workload import Workload

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as if absent
    monkeypatch.setattr(measure, "_FA4_MISSING", [])
    w = Workload(1, 2, 64, 64)
    assert measure.fa4_attention() is None and measure.time_fa4(w, []) is None
    err = capsys.readouterr().err
    assert err.count("FlashAttention-4 not timed") == 1
