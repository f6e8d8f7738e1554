"""The registry of problem kinds: one declared thing every stage dispatches on."""

from __future__ import annotations

import argparse

import pytest

from evoengine import problems
from evoengine.problems.base import Problem
from evoengine.workload import Workload


def test_the_forward_is_registered_under_its_kind() -> None:
    fwd = problems.problem("fwd")
    assert isinstance(fwd, Problem) and fwd.kind == "fwd" == Workload.kind
    assert problems.problem_of(Workload(1, 2, 3, 64)) is fwd
    assert fwd.anchors == ("flash", "cudnn", "fa4")


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown problem kind 'nope' \(known: fwd"):
        problems.problem("nope")


@pytest.mark.parametrize("w", [Workload(2, 8, 100, 64, kv_heads=2, seq_k=50, causal=True,
                                        dtype="bf16"), Workload(1, 1, 1, 16)])
def test_workloads_round_trip_through_keys_and_dicts(w: Workload) -> None:
    assert problems.workload_from_key(w.key()) == w
    assert problems.workload_from_dict(w.to_dict()) == w


def test_dicts_and_keys_from_before_kinds_are_forwards() -> None:
    old = {"batch": 2, "heads": 8, "seq_q": 100, "head_dim": 64, "kv_heads": 8, "seq_k": 100,
           "causal": False, "dtype": "fp16"}  # a run row written before kinds existed
    assert problems.workload_from_dict(old) == Workload(2, 8, 100, 64)
    assert problems.workload_from_key("b2-h8-kv8-sq100-sk100-d64-full-fp16") == Workload(
        2, 8, 100, 64)


def test_the_forward_names_its_workload_by_flags() -> None:
    fwd = problems.problem("fwd")
    parser = argparse.ArgumentParser()
    fwd.add_arguments(parser)
    args = parser.parse_args(["--shape", "2,8,100,64", "--kv-heads", "2", "--causal",
                              "--dtype", "bf16"])
    assert fwd.workload_from_arguments(args) == Workload(2, 8, 100, 64, kv_heads=2,
                                                         causal=True, dtype="bf16")
    with pytest.raises(ValueError, match="--shape"):
        fwd.workload_from_arguments(parser.parse_args([]))


def test_the_backward_is_a_kind_of_its_own_over_the_same_geometry() -> None:
    from evoengine.problems.backward import BackwardWorkload

    fwd = Workload(2, 8, 100, 64, kv_heads=2, causal=True)
    bwd = BackwardWorkload.of(fwd)
    assert problems.problem_of(bwd).kind == "bwd" and bwd != fwd
    assert bwd.key() == "bwd-" + fwd.key() and bwd.problem() == fwd.problem()
    assert bwd.flops() == 2.5 * fwd.flops()
    assert problems.workload_from_key(bwd.key()) == bwd
    assert problems.workload_from_dict(bwd.to_dict()) == bwd
    with pytest.raises(ValueError, match="not a backward workload key"):
        problems.problem("bwd").workload_from_key(fwd.key())


def test_every_shipped_space_names_a_registered_problem() -> None:
    from evoengine.space import default_spaces

    kinds = {space.family: space.kind for space in default_spaces(None)}
    assert set(kinds.values()) <= set(problems.PROBLEMS)
    assert kinds["mma_bwd"] == "bwd" and kinds["mma"] == kinds["wgmma"] == "fwd"


def test_each_kind_says_how_its_times_read_as_a_rate() -> None:
    """Attention in matrix TFLOPS; decode, memory-bound, in K/V bytes read per second: what
    the search's live line, the tune's and the report show."""
    from evoengine.problems import Rate
    from evoengine.problems.decode import DecodeWorkload
    from evoengine.search.progress import Progress, Tally

    fwd = Workload(batch=2, heads=4, seq_q=1024, seq_k=1024, head_dim=64)
    r = problems.problem("fwd").rate(fwd)
    assert r.unit == "TFLOPS" and r(100.0) == pytest.approx(fwd.flops() / 100e-6 / 1e12)
    dec = DecodeWorkload(batch=8, q_len=1, q_heads=32, kv_heads=8, head_dim=128,
                         cache_len=32768, layout="paged", page_size=64)
    r = problems.problem("decode").rate(dec)
    assert r.unit == "GB/s" and r(350.0) == pytest.approx(dec.kv_bytes() / 350e-6 / 1e9)
    t = Tally()
    t.best_us = 350.0
    assert f"best 350.0 us {r(350.0):.1f} GB/s" in Progress(r, quiet=True).line(t)
    assert "TFLOPS" in Progress(Rate.tflops(fwd.flops()), quiet=True).line(t)
