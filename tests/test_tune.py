"""Tests of evoengine.tune without a GPU: the plan (workloads of every kind asked for, their
studies, the budget split), the loop over workloads (run through the real search with the
fake evaluator and stub compiler of tests/test_search.py, or a fake searcher on a fake
clock), resuming, and the module it exports covering the model's geometry. Configs are
written by the tests; the exported kernels compile offline for sm_90a.
"""

from __future__ import annotations

import io
import json
import re
import zlib
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import optuna
import pytest
import torch

from evoengine import paths, tune
from evoengine.cli import main
from evoengine.compile import CompileResult
from evoengine.export import import_module_file as import_path
from evoengine.geometry import ModelGeometry
from evoengine.launch.dispatch import nearest
from evoengine.problems import PROBLEMS, problem
from evoengine.problems.backward import Backward
from evoengine.render import Candidate
from evoengine.search import Progress, SearchConfig, SearchResult, Tally, cross, search
from evoengine.search.evaluator import DeviceInfo, Evaluation
from evoengine.store import Store
from tests.test_search import SM90, FakeEvaluator, stub_compile

MMA = [str(paths.SPACES / "mma.toml")]
TINY = ModelGeometry(heads=4, kv_heads=2, head_dim=64, dtype="fp16", causal=True,
                     max_seq=1024, min_seq=512, latency_max_seq=0, name="tiny")


def any_time(params: dict[str, Any]) -> float:
    """A made-up time for a point of any family: deterministic in its parameters."""
    return 100.0 + sum(zlib.crc32(f"{k}={v}".encode()) % 97 for k, v in params.items()) / 10


class AnyFamily(FakeEvaluator):
    """test_search's fake evaluator, for forward and backward families alike; ``final_on``
    (the cross re-time) times a point alike on every workload."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        super().__init__(interrupt_after)
        self.timed_on: list[str] = []

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        if self.interrupt_after is not None and len(self.evaluated) == self.interrupt_after:
            raise KeyboardInterrupt
        self.evaluated.append(candidate.identity)
        return Evaluation(True, median_us=any_time(candidate.params), spread_us=0.5, reps=50,
                          graph=False, max_err=1e-3, tolerance=2e-3)

    def final(self, entries: Any, rounds: int) -> dict[str, Any]:
        return {"candidates": [{"median_us": any_time(c.params), "spread_us": 0.1,
                                "rounds": rounds} for c, _ in entries],
                "flash": 110.0, "cudnn": 80.0}

    def final_on(self, workload: Any, entries: Any, rounds: int) -> dict[str, Any]:
        self.timed_on.append(workload.key())
        return self.final(entries, rounds)


class OffLadder(AnyFamily):
    """Times as AnyFamily's, but the candidates in ``slow`` take 3x as long off the ladder
    (odd lengths: the cells' workloads)."""

    def __init__(self, slow: set[str]) -> None:
        super().__init__()
        self.slow = slow

    def final_on(self, workload: Any, entries: Any, rounds: int) -> dict[str, Any]:
        timed = super().final_on(workload, entries, rounds)
        for (c, _), t in zip(entries, timed["candidates"], strict=True):
            if c.identity in self.slow and workload.seq_q % 2:
                t["median_us"] *= 3
        return timed


def fake_search(interrupt: set[str] | None = None) -> tune.Searcher:
    """The real search loop on a fake evaluator and the stub compiler; studies whose name is
    in ``interrupt`` are Ctrl-C'd after two evaluations."""
    def run(config: SearchConfig, progress: Progress) -> SearchResult:
        stop = 2 if interrupt and config.study in interrupt else None
        return search(replace(config, compile_workers=1), evaluator=AnyFamily(stop),
                      progress=progress, compile_fn=stub_compile)
    return run


@pytest.fixture(autouse=True)
def no_gpu_cross(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tune's cross re-time times on the fake evaluator, never a GPU worker."""
    monkeypatch.setattr(tune, "_gpu_evaluator", lambda options: lambda w: AnyFamily())


def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tune.db'}"


# ---- the plan -----------------------------------------------------------------------------

def test_the_plan_is_each_kinds_ladder_with_deterministic_studies() -> None:
    tp = tune.plan(TINY, SM90, name="tiny", kinds=("fwd", "bwd"), timeout_s=600)
    assert [(p.kind, p.workload.seq_q, p.workload.batch) for p in tp.parts] == [
        ("fwd", 512, 32), ("fwd", 1024, 16), ("bwd", 512, 32), ("bwd", 1024, 16)]
    assert [p.study for p in tp.parts] == [
        f"tiny/sm_90a-{p.workload.key()}" for p in tp.parts]
    assert tp.parts[2].study == "tiny/sm_90a-bwd-b32-h4-kv2-sq512-sk512-d64-causal-fp16"
    assert tune.plan(TINY, SM90, name="tiny", kinds=("fwd", "bwd")) == tune.plan(
        TINY, SM90, name="tiny", kinds=("fwd", "bwd"))


def test_the_workloads_of_a_kind_are_what_its_problem_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kinds are read from the problems registry: a kind that tunes other calls (decode,
    ragged batches) says so in its problem, and the plan follows."""
    monkeypatch.setattr(Backward, "tune_workloads",
                        lambda self, g: [self.workload_from_dict(g.prefill_calls()[-1])])
    tp = tune.plan(TINY, SM90, name="tiny", kinds=("bwd",))
    assert [p.workload.key() for p in tp.parts] == ["bwd-b16-h4-kv2-sq1024-sk1024-d64-causal-fp16"]


@pytest.mark.parametrize("kind", sorted(PROBLEMS))
def test_every_kind_plans_for_a_model(kind: str) -> None:
    """Each registered kind names the calls a model makes of it, each a workload its
    problem builds again from its own record (what the store keeps)."""
    tp = tune.plan(TINY, SM90, name="tiny", kinds=(kind,))
    assert tp.parts and {p.kind for p in tp.parts} == {kind}
    solver = problem(kind)
    for part in tp.parts:
        w = part.workload
        assert solver.workload_from_dict(w.to_dict()) == w
        assert (w.heads, w.kv_heads, w.head_dim, w.dtype) == (
            TINY.heads, TINY.kv_heads, TINY.head_dim, TINY.dtype)
    if kind == "varlen":  # ragged: lengths differ within a call, up to the rung's length
        rungs = [p.workload for p in tp.parts]
        assert all(len({q for q, _ in w.seqlens}) > 1 for w in rungs)
        assert all(w.max_seqlen_q <= s for w, s in zip(rungs, TINY.prefill_lengths(), strict=True))


def test_the_budget_splits_equally_or_by_flops() -> None:
    equal = tune.plan(TINY, SM90, name="t", kinds=("fwd",), timeout_s=600, cross=False)
    assert equal.shares() == [300.0, 300.0]
    crossed = tune.plan(TINY, SM90, name="t", kinds=("fwd",), timeout_s=600)
    assert crossed.crossed == ("fwd",)  # the cross re-time keeps its share
    assert crossed.shares() == pytest.approx([300.0 * (1 - tune.CROSS_SHARE)] * 2)
    g = replace(TINY, max_seq=4096, causal=False)
    flops = tune.plan(g, SM90, name="t", kinds=("fwd",), split="flops", timeout_s=700,
                      cross=False)
    shares = flops.shares()
    assert sum(shares) == pytest.approx(700)
    assert shares == pytest.approx([700 * p.workload.flops() / sum(
        q.workload.flops() for q in flops.parts) for p in flops.parts])
    tiny = tune.plan(TINY, SM90, name="t", kinds=("fwd",), timeout_s=1)
    assert tiny.shares() == [tune.MIN_SHARE_S] * 2


def test_the_cross_retime_keeps_its_estimate_within_bounds() -> None:
    """Kept for the cross re-time: CROSS_S_PER_RUNG a rung, at least CROSS_SHARE and at most
    CROSS_MAX_SHARE of the timeout; the plan prints the estimate."""
    def kept(tp: tune.TunePlan) -> float:
        return tp.timeout_s - tp.search_seconds()

    g = replace(TINY, max_seq=16384)  # a rung per octave from 512: 6 rungs
    assert len(tune.plan(g, SM90, name="t", kinds=("fwd",), timeout_s=600, cross=False)
               .parts) >= 6
    many = tune.plan(g, SM90, name="t", kinds=("fwd",), timeout_s=600)
    rungs = len(many.parts)
    assert many.cross_seconds() == pytest.approx(tune.CROSS_S_PER_RUNG * rungs)
    assert kept(many) == pytest.approx(min(max(60.0, many.cross_seconds()), 180.0))
    assert kept(many) > 60.0  # more than a tenth: the estimate
    assert f"~{many.cross_seconds():.0f} s)" in many.describe()
    short = tune.plan(g, SM90, name="t", kinds=("fwd",), timeout_s=100)
    assert kept(short) == pytest.approx(100 * tune.CROSS_MAX_SHARE)  # capped
    few = tune.plan(TINY, SM90, name="t", kinds=("fwd",), timeout_s=3600)
    assert kept(few) == pytest.approx(360.0)  # at least a tenth
    assert tune.plan(g, SM90, name="t", kinds=("fwd",), timeout_s=600,
                     cross=False).search_seconds() == 600


def test_the_plan_says_what_it_will_do() -> None:
    text = tune.plan(TINY, SM90, name="tiny", kinds=("fwd", "bwd"), timeout_s=600).describe()
    assert "tune tiny on sm_90a: 4 query heads, 2 key/value heads, head dim 64" in text
    assert "4 workloads (fwd, bwd), 600 s split equal" in text
    assert text.count("135s") == 4 and "tiny/sm_90a-b16-h4-kv2-sq1024" in text
    assert "then the cross re-time of fwd, bwd" in text and "~48 s" in text  # 4 rungs
    assert "cross" not in tune.plan(TINY, SM90, name="tiny", kinds=("fwd", "bwd"),
                                    timeout_s=600, cross=False).describe()


@pytest.mark.parametrize("kw, says", [
    ({"kinds": ("fwd", "nope")}, "unknown problem kind 'nope'"),
    ({"kinds": ()}, "at least one kind"),
    ({"split": "fair"}, "split must be one of"),
    ({"name": ""}, "tune name"),
])
def test_bad_plans_are_refused_in_one_line(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        tune.plan(TINY, SM90, **{"name": "t", **kw})


def test_by_default_every_call_the_model_makes_is_tuned() -> None:
    """No --kinds: every registered kind with calls and a space; an encoder has no decode,
    and a kind no given space serves is left out, each named in the plan."""
    tp = tune.plan(TINY, SM90, name="t")
    assert tp.kinds == ("fwd", "bwd", "varlen", "varlen_bwd", "decode") and not tp.notes
    encoder = tune.plan(replace(TINY, causal=False), SM90, name="t")
    assert encoder.kinds == ("fwd", "bwd", "varlen", "varlen_bwd")
    assert encoder.notes == ("decode: the model makes no such calls",)
    only = tune.plan(TINY, SM90, name="t", spaces=MMA)  # mma serves fwd and varlen
    assert only.kinds == ("fwd", "varlen")
    assert [n.split(":")[0] for n in only.notes] == ["bwd left out", "varlen_bwd left out",
                                                     "decode left out"]
    assert "note: bwd left out: no bwd search space targets sm_90a" in only.describe()
    with pytest.raises(ValueError, match="makes no decode calls"):
        tune.plan(replace(TINY, causal=False), SM90, name="t", kinds=("decode",))


def test_a_head_dim_no_space_admits_is_refused() -> None:
    with pytest.raises(ValueError, match="no fwd search space admits"):
        tune.plan(replace(TINY, head_dim=24), SM90, name="t")


def test_a_kind_whose_spaces_admit_no_point_is_left_out_before_the_tune_starts() -> None:
    """d256's backward passes every constraint on the problem alone, yet no tile of either
    family fits (registers, shared memory): left out with the first point's reason, not a
    search that stops the tune midway; asked for, refused in one line."""
    d256 = replace(TINY, head_dim=256)
    tp = tune.plan(d256, SM90, name="t")
    assert tp.kinds == ("fwd", "varlen", "decode")
    note, ragged = tp.notes
    assert note.startswith("bwd left out: no bwd search space admits")
    assert "mma_bwd: no point admitted (its first: " in note and "wgmma_bwd: no point" in note
    assert ragged.startswith("varlen_bwd left out: no varlen_bwd search space admits")
    with pytest.raises(ValueError, match="wgmma_bwd: no point admitted"):
        tune.plan(d256, SM90, name="t", kinds=("bwd",))


# ---- the loop -----------------------------------------------------------------------------

class Clock:
    """A fake time.monotonic that searches advance by what they "spent"."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_module_path_that_cannot_be_written_is_refused_before_searching(
        tmp_path: Path) -> None:
    tp = tune.plan(TINY, SM90, name="nowhere", timeout_s=300)

    def searcher(config: SearchConfig, progress: Progress) -> SearchResult:
        raise AssertionError("searched before refusing the output")

    for output in (tmp_path, tmp_path / "file.txt" / "module.py"):
        (tmp_path / "file.txt").write_text("")
        with pytest.raises(ValueError, match="is a folder|is not a folder"):
            tune.tune(tp, store=store_url(tmp_path), output=output, searcher=searcher,
                      stream=io.StringIO())


@pytest.mark.parametrize(("spend", "expected"), [
    # each search runs 20 s past its budget (its final re-time): the first one's overrun is
    # kept back from the two after it, and the tune ends at its deadline
    (lambda budget: budget + 20, [100.0, 70.0, 70.0]),
    # each runs twice its budget: no share goes below the floor; the last takes what is left
    # less the mean overrun so far ((100 + 10) / 2)
    (lambda budget: 2 * budget, [100.0, tune.MIN_SHARE_S, 25.0]),
    # on time: equal shares of what is left
    (lambda budget: budget, [100.0, 100.0, 100.0]),
])
def test_each_workload_gets_its_share_of_what_is_left(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      spend: Any, expected: list[float]) -> None:
    clock = Clock()
    monkeypatch.setattr(tune.time, "monotonic", clock)
    g = replace(TINY, max_seq=2048)  # three rungs
    tp = tune.plan(g, SM90, name="clock", kinds=("fwd",), timeout_s=300, cross=False)
    budgets: list[float | None] = []

    def searcher(config: SearchConfig, progress: Progress) -> SearchResult:
        budgets.append(config.timeout_s)
        clock.now += spend(config.timeout_s or 0)
        store = Store(config.store)
        run = store.start_run(arch=SM90.name, workload=config.workload.to_dict(),
                              workload_key=config.workload.key(), device="fake",
                              commit=None, study=config.study)
        store.finish_run(run, "done")
        store.close()
        return SearchResult(run, config.study or "", SM90.name, config.workload,
                            DeviceInfo("fake", (9, 0), "0", {}), Tally(), "done")

    start = clock.now
    result = tune.tune(tp, store=store_url(tmp_path), searcher=searcher, stream=io.StringIO())
    assert result.status == "done"
    assert budgets == pytest.approx(expected)
    if expected[0] == 100.0 and expected[1] == 70.0:
        assert clock.now - start == pytest.approx(300.0)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tune of TINY (fwd and bwd, 5 trials per workload) through the real search loop,
    exported with its coverage."""
    root = tmp_path_factory.mktemp("tune")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVOENGINE_CACHE", str(root / "cache"))
        tp = tune.plan(TINY, SM90, name="tiny", kinds=("fwd", "bwd"), trials=5,
                       spaces=[*MMA, str(paths.SPACES / "mma_bwd.toml")])
        stream = io.StringIO()
        result = tune.tune(tp, store=store_url(root), output=root / "tiny_attention.py",
                           searcher=fake_search(), stream=stream,
                           spaces=[*MMA, str(paths.SPACES / "mma_bwd.toml")],
                           cross_evaluator=lambda w: AnyFamily())
    return {"root": root, "plan": tp, "result": result, "log": stream.getvalue()}



def test_a_tune_searches_every_workload_under_its_study(tuned: dict[str, Any]) -> None:
    result, tp = tuned["result"], tuned["plan"]
    assert result.status == "done"
    assert [p.status for p in result.parts] == ["searched"] * 4
    finished = set(tune.finished_studies(store_url(tuned["root"])))
    assert {s for s in finished if "/cross/" not in s} == {p.study for p in tp.parts}
    assert {c.status for c in result.cells} == {"chosen"} and len(result.cells) == 4
    for p in tp.parts:  # the rung and its cell's two workloads, each a run of its own
        cell = problem(p.kind).cell_workloads(p.workload)
        assert {f"tiny/cross/sm_90a-{w.key()}" for w in (p.workload, *cell)} <= finished
    log = tuned["log"]
    assert "[1/4 fwd b32-h4-kv2-sq512-sk512-d64-causal-fp16] study tiny/sm_90a-" in log
    assert "[4/4 bwd " in log and "5 trials" in log
    assert "4 workloads searched now, 0 finished before, of 4" in result.summary()


def test_the_next_rung_is_seeded_by_the_one_before(tuned: dict[str, Any]) -> None:
    """The second forward workload's first trial is the first one's winner."""
    url = store_url(tuned["root"])
    first, second = tuned["plan"].parts[:2]
    with Store(url) as store:  # its search's best (the cross re-time may since prefer another)
        run = next(r for r in store.runs() if r.study == first.study)
        best = min((m for m in store.measurements(run_id=run.id)
                    if (m.extra or {}).get("phase") == "final"), key=lambda m: m.median_us or 0)
    trials = optuna.load_study(study_name=second.study, storage=url).get_trials()
    opening = min(trials, key=lambda t: t.number)
    assert opening.user_attrs["identity"] == best.identity  # same problem: same identity


def test_a_rerun_skips_finished_workloads_and_exports_again(tuned: dict[str, Any],
                                                            tmp_path: Path) -> None:
    out = tmp_path / "again.py"
    stream = io.StringIO()
    result = tune.tune(tuned["plan"], store=store_url(tuned["root"]), output=out,
                       searcher=fake_search(), stream=stream,
                       spaces=[*MMA, str(paths.SPACES / "mma_bwd.toml")])
    assert [p.status for p in result.parts] == ["skipped"] * 4
    assert [c.status for c in result.cells] == ["skipped"] * 4
    assert stream.getvalue().count("finished before") == 8 and out.is_file()


def test_an_interrupted_tune_resumes_the_interrupted_workload(tmp_path: Path) -> None:
    tp = tune.plan(TINY, SM90, name="cut", kinds=("fwd",), trials=5, spaces=MMA)
    second = tp.parts[1].study
    first = tune.tune(tp, store=store_url(tmp_path), searcher=fake_search({second}),
                      stream=io.StringIO(), spaces=MMA)
    assert first.status == "interrupted" and first.exported is None
    assert [p.status for p in first.parts] == ["searched", "interrupted"]
    before = len(optuna.load_study(study_name=second, storage=store_url(tmp_path)).trials)
    again = tune.tune(tp, store=store_url(tmp_path), searcher=fake_search(),
                      stream=io.StringIO(), spaces=MMA)
    assert [p.status for p in again.parts] == ["skipped", "searched"]
    after = optuna.load_study(study_name=second, storage=store_url(tmp_path)).trials
    assert len(after) > before  # the same study, resumed


def test_the_cross_retime_chooses_each_entry_over_its_cell(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The middle rung's search winner is 3x slower off the ladder: the cross re-time gives
    the rung another of the candidates, the module exports that one, every time is stored
    as a run of the workload it was taken on, and a rerun finds the rungs finished."""
    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    url = store_url(tmp_path)
    tp = tune.plan(replace(TINY, max_seq=2048), SM90, name="x", kinds=("fwd",), trials=4,
                   spaces=MMA)
    middle = tp.parts[1].workload
    made: list[OffLadder] = []

    def evaluator(w: Any) -> OffLadder:
        with Store(url) as store:  # the middle rung's winner, as its search left it
            made.append(OffLadder({store.elites(arch="sm_90a",
                                                workload_key=middle.key())[0].identity}))
        return made[-1]

    stream = io.StringIO()
    result = tune.tune(tp, store=url, output=tmp_path / "x.py", searcher=fake_search(),
                       stream=stream, spaces=MMA, cross_evaluator=evaluator)
    assert result.status == "done" and len(made) == 1
    cells = {c.rung.key(): c for c in result.cells}
    cell = cells[middle.key()]
    (slow,) = made[0].slow
    assert cell.status == "chosen" and cell.own == slow and cell.order[0] != slow
    assert cell.scores[slow] > 2.0 and cell.scores[cell.order[0]] < 1.5
    assert f"[cross 2/3 {middle.key()}]" in stream.getvalue() and "chose " in stream.getvalue()
    odd = [k for k in made[0].timed_on if "sq" in k and int(k.split("-sq")[1].split("-")[0]) % 2]
    assert len(odd) == 12 and len(made[0].timed_on) == 15  # 3 rungs x (4 off-ladder + itself)
    with Store(url) as store:
        assert store.elites(arch="sm_90a", workload_key=middle.key())[0].identity == cell.order[0]
        from evoengine.export import winners

        won = {w.workload.key(): w.elite.identity for w in winners(store, SM90, tune="x")}
        assert won[middle.key()] == cell.order[0]
        crossed = [r for r in store.runs() if "/cross/" in (r.study or "")]
        assert len(crossed) == 15 and {r.status for r in crossed} == {"done"}
        m = store.measurements(run_id=crossed[0].id)[0]
        assert m.extra["phase"] == "final" and m.extra["sdpa_cudnn_us"] == 80.0
    assert cell.order[0] in (tmp_path / "x.py").read_text()
    again = tune.tune(tp, store=url, searcher=fake_search(), stream=io.StringIO(), spaces=MMA,
                      cross_evaluator=evaluator)
    assert [c.status for c in again.cells] == ["skipped"] * 3 and len(made) == 1
    assert main(["report", "--store", url, "--tune", "x", "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "cross re-time: it times other searches" in page and "no Optuna study" not in page
    assert page.count("No search evaluated points on this workload") == 12  # the off-ladder ones


# ---- the module it exports ------------------------------------------------------------------

@pytest.fixture(scope="module")
def module(tuned: dict[str, Any]) -> ModuleType:
    return import_path(tuned["root"] / "tiny_attention.py", "tiny_attention_under_test")


def test_the_module_covers_every_dtype_and_mask_of_the_head_dim(module: ModuleType,
                                                                tuned: dict[str, Any]) -> None:
    attention = module.attention
    for kind in ("fwd", "bwd"):
        table = attention._tables[kind]
        assert set(table) == {(d, 64, c) for d in ("fp16", "bf16") for c in (False, True)}
        assert all(e.tuned for e in table[("fp16", 64, True)])
        tuned_keys = {e.workload for e in table[("fp16", 64, True)]}
        for key in (("fp16", 64, False), ("bf16", 64, False), ("bf16", 64, True)):
            derived = table[key]
            assert len(derived) == 2 and not any(e.tuned for e in derived)
            assert {e.derived_from for e in derived} == tuned_keys
            assert all(e.median_us is None for e in derived)
    # the derived kernels are compiled for their own problem
    for e in attention.entries:
        k = attention.kernels[e.kernel]
        assert (k.dtype, k.head_dim, k.causal) == e.key
    assert "from tiny/" not in tuned["result"].exported.summary()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_every_call_of_the_geometry_finds_a_kernel(module: ModuleType, dtype: torch.dtype,
                                                   causal: bool) -> None:
    """Any length, any batch, both dtypes and masks: explain names a kernel, never none."""
    attention = module.attention
    for batch, sq, sk in ((1, 1, 1), (3, 77, 77), (64, 512, 512), (1, 1, 30000),
                          (2, 5000, 7000), (1000, 16, 16)):
        q = torch.empty(batch, 4, sq, 64, dtype=dtype, device="meta")
        kv = torch.empty(batch, 2, sk, 64, dtype=dtype, device="meta")
        for kind in ("fwd", "bwd"):
            why = attention.explain(q, kv, kv, causal=causal, kind=kind)
            assert why.entry is not None and why.kernel is not None, str(why)
            assert why.tuned == (dtype == torch.float16 and causal)


def test_explain_says_which_entry_serves_a_call(module: ModuleType) -> None:
    attention = module.attention
    q = torch.empty(2, 4, 900, 64, dtype=torch.float16)
    kv = torch.empty(2, 2, 900, 64, dtype=torch.float16)
    tuned = attention.explain(q, kv, kv, causal=True)
    assert tuned.entry.workload == "b16-h4-kv2-sq1024-sk1024-d64-causal-fp16"
    assert tuned.measured_us == tuned.entry.median_us is not None
    assert str(tuned).startswith("fwd fp16 head_dim 64 causal b2 h4 sq900 sk900: tuned at "
                                 "b16-h4-kv2-sq1024-sk1024-d64-causal-fp16")
    derived = attention.explain(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), causal=False)
    assert derived.entry.workload == "b16-h4-kv2-sq1024-sk1024-d64-full-bf16"
    assert derived.source is not None and derived.source.workload == derived.entry.derived_from
    assert derived.measured_us == derived.source.median_us
    assert "derived (not tuned for bf16 non-causal) from the kernel tuned at " \
           "b16-h4-kv2-sq1024-sk1024-d64-causal-fp16" in str(derived)
    other = attention.explain(torch.empty(1, 4, 8, 128, dtype=torch.float16),
                              torch.empty(1, 4, 8, 128, dtype=torch.float16),
                              torch.empty(1, 4, 8, 128, dtype=torch.float16))
    assert other.entry is None and "no kernel (no tuned kernel for" in str(other)
    with pytest.raises(ValueError, match="4-D"):
        attention.explain(q[0], kv, kv)


def test_the_header_marks_derived_entries(tuned: dict[str, Any]) -> None:
    text = (tuned["root"] / "tiny_attention.py").read_text()
    assert "bf16 head_dim 64 causal  (not tuned: kernels tuned for another dtype" in text
    assert "from b32-h4-kv2-sq512-sk512-d64-causal-fp16" in text
    assert "study     tiny/*" in text


# ---- the command --------------------------------------------------------------------------

def test_dry_run_prints_the_plan_from_a_config(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "Tiny-LM"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 8,
        "num_key_value_heads": 2, "hidden_size": 512, "max_position_embeddings": 2048,
        "torch_dtype": "float32"}))
    assert main(["tune", str(folder / "config.json"), "--dry-run", "--arch", "sm_90a",
                 "--kinds", "fwd,bwd", "--timeout", "12m"]) == 0
    out = capsys.readouterr().out
    assert "tune Tiny-LM on sm_90a: 8 query heads, 2 key/value heads, head dim 64, bf16, " \
           "causal, up to 2048 tokens" in out
    assert "note: torch_dtype float32 -> bf16" in out
    # the forward's ladder 256..2048 and its latency calls (one sequence, 256..1024); bwd's ladder
    assert "11 workloads (fwd, bwd), 720 s split equal" in out
    assert "Tiny-LM/sm_90a-b64-h8-kv2-sq256-sk256-d64-causal-bf16" in out
    assert "Tiny-LM/sm_90a-b1-h8-kv2-sq1024-sk1024-d64-causal-bf16" in out
    assert "Tiny-LM/sm_90a-bwd-b8-h8-kv2-sq2048-sk2048-d64-causal-bf16" in out
    assert "sm_90a-bwd-b1-" not in out
    assert main(["tune", str(folder / "config.json"), "--dry-run", "--arch", "sm_90a",
                 "--kinds", "fwd", "--latency-seq", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 workloads (fwd)" in out and "-b1-" not in out
    assert main(["tune", str(folder / "config.json"), "--dry-run", "--arch", "sm_90a",
                 "--kinds", "fwd", "--latency-seq", "512"]) == 0
    assert "6 workloads (fwd)" in capsys.readouterr().out


def test_a_model_folder_names_its_config_and_the_tune(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "Tiny-Model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 8,
                                                    "hidden_size": 512}))
    assert main(["tune", str(folder), "--dry-run", "--arch", "sm_90a"]) == 0
    assert capsys.readouterr().out.startswith("tune Tiny-Model on sm_90a: 8 query heads")


def test_flags_name_a_geometry_without_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--q-heads", "8", "--head-dim", "128", "--max-seq", "1024",
                 "--no-causal", "--dtype", "fp16", "--dry-run", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "tune h8-kv8-d128 on sm_80: 8 query heads, 8 key/value heads, head dim 128, fp16, " \
           "non-causal, up to 1024 tokens" in out


def test_the_command_tunes_resumes_and_exports(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The whole command on CPU: the GPU check, the device probe and the search's evaluator
    and compiler are replaced; the plan, the loop, the store, the resume and the export with
    its coverage are real."""
    import evoengine.cli as cli

    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "_cuda_or_fail", lambda command: None)
    monkeypatch.setattr(tune, "device_arch", lambda device=0: SM90)
    monkeypatch.setattr(tune, "search", lambda config, progress: fake_search()(config, progress))
    folder = tmp_path / "Tiny-LM"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 1024,
        "torch_dtype": "float16"}))
    argv = ["tune", str(folder / "config.json"), "--kinds", "fwd", "--trials", "4",
            "--space", MMA[0], "--min-seq", "512",
            "--store", str(tmp_path / "evo.db"), "-o", str(tmp_path / "tiny.py")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    # the ladder (512 x 32, 1024 x 16), then its latency calls (one sequence of each)
    assert "tune Tiny-LM (done): 4 workloads searched now, 0 finished before, of 4" in out
    assert re.search(r"wrote \S+tiny.py: \d+ kernels for sm_90a, 16 dispatch entries", out), out
    assert "[2/4 fwd b16-h4-kv2-sq1024-sk1024-d64-causal-fp16] study Tiny-LM/sm_90a-" in err
    assert "[4/4 fwd b1-h4-kv2-sq1024-sk1024-d64-causal-fp16] study Tiny-LM/sm_90a-" in err
    assert err.count("[cross ") == 4, err
    module = import_path(tmp_path / "tiny.py", "tiny_cli_under_test")
    assert set(module.attention.table) == {(d, 64, c) for d in ("fp16", "bf16")
                                           for c in (False, True)}
    group = module.attention.table[("fp16", 64, True)]
    # a call of one or two sequences gets the latency entry at its length, of 16 the ladder's
    assert [(nearest(group, 700, 700, b * 4).batch) for b in (1, 2, 16)] == [1, 1, 32]
    assert main(argv) == 0
    assert "0 workloads searched now, 4 finished before, of 4" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["tune", "--dry-run"], "tune needs a config.json, or --q-heads and --head-dim"),
    (["tune", "missing.json", "--dry-run"], "no config file missing.json"),
    (["tune", "--q-heads", "8", "--head-dim", "64", "--kinds", "fwd,zzz", "--dry-run",
      "--arch", "sm_90a"], "unknown problem kind 'zzz'"),
    (["tune", "--q-heads", "8", "--head-dim", "64", "--arch", "sm_90a"], "needs a CUDA GPU"),
    (["tune", str(Path(__file__).parent), "--dry-run"],
     "tests is a folder without a config.json"),  # was a traceback
])
def test_mistakes_are_one_line(argv: list[str], says: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") <= 2


def test_a_tune_of_the_serving_kinds_exports_them(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """varlen (served by the forward's mma space) and decode tune and export like fwd."""
    monkeypatch.setenv("EVOENGINE_CACHE", str(tmp_path / "cache"))
    spaces = [*MMA, str(paths.SPACES / "decode.toml")]
    tp = tune.plan(replace(TINY, max_seq=512), SM90, name="serve", kinds=("varlen", "decode"),
                   trials=3, spaces=spaces)
    assert {p.kind for p in tp.parts} == {"varlen", "decode"}
    result = tune.tune(tp, store=store_url(tmp_path), output=tmp_path / "serve.py",
                       searcher=fake_search(), stream=io.StringIO(), spaces=spaces)
    assert result.status == "done" and result.exported is not None
    text = (tmp_path / "serve.py").read_text()
    for part in tp.parts:
        assert part.workload.key() in text
    module = import_path(tmp_path / "serve.py", "serve_attention_under_test")
    decode = module.attention_decode
    assert set(decode.table) == {(d, 64, p) for d in ("fp16", "bf16") for p in (False, True)}
    assert all(e.tuned for e in decode.table[("fp16", 64, True)])
    assert not any(e.tuned for e in decode.table[("fp16", 64, False)])  # derived: contiguous
    varlen = module.attention._tables["varlen"]
    assert set(varlen) == {(d, 64, c) for d in ("fp16", "bf16") for c in (False, True)}
    # The report reads decode's times as K/V bytes per second, varlen's as TFLOPS.
    assert main(["report", "--store", store_url(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert page.count("<th>GB/s</th>") == 2 and page.count("<th>TFLOPS</th>") == 1


def test_the_ladder_and_the_latency_calls_are_two_series_for_the_cross_retime() -> None:
    """A rung's neighbours are the nearest rungs either side of its own series, then the
    other series' rung at its lengths and that rung's either side: the latency call's entry
    and the ladder's at one length share its calls by batch x heads, so each is chosen among
    the other's candidates too."""
    assert cross.neighbours([0, 0, 0], 1) == [1, 0, 2]
    series = [False, False, False, True, True]  # ladder 256, 512, 1024; latency 256, 512
    assert [cross.neighbours(series, i) for i in range(5)] == [
        [0, 1], [1, 0, 2], [2, 1], [3, 4], [4, 3]]
    lengths = [256, 512, 1024, 256, 512]
    assert [cross.neighbours(series, i, lengths) for i in range(5)] == [
        [0, 1, 3, 4], [1, 0, 2, 4, 3], [2, 1], [3, 4, 0, 1], [4, 3, 1, 0, 2]]
    assert cross.neighbours(series, 3, [None] * 5) == [3, 4]  # no lengths: no twins

    g = replace(TINY, min_seq=256, max_seq=2048, latency_max_seq=1024)
    tp = tune.plan(g, SM90, name="t", kinds=("fwd",), timeout_s=600)
    shapes = [(p.workload.batch, p.workload.seq_q) for p in tp.parts]
    assert shapes == [(64, 256), (32, 512), (16, 1024), (8, 2048), (1, 256), (1, 512), (1, 1024)]
    assert [g.is_latency_call(b, s) for b, s in shapes] == [False] * 4 + [True] * 3

    class Elites:  # each rung's three best, named after it
        def elites(self, *, arch: str, workload_key: str) -> list[Any]:
            return [SimpleNamespace(identity=f"{workload_key}#{n}") for n in range(3)]

    rungs = [p.workload for p in tp.parts]
    twins = [g.is_latency_call(b, s) for b, s in shapes]
    got = cross.candidates_for(Elites(), SM90, rungs, 5, twins)  # type: ignore[arg-type]
    # the 1 x 512 latency call: its own two best, its series' either side, then the ladder's
    # 512 and the ladder's either side of it
    assert [k.split("-sk")[0] for k in got[::2]] == [
        "b1-h4-kv2-sq512", "b1-h4-kv2-sq256", "b1-h4-kv2-sq1024",
        "b32-h4-kv2-sq512", "b64-h4-kv2-sq256", "b16-h4-kv2-sq1024"]
    assert [k[-2:] for k in got] == ["#0", "#1"] * 6 and got[1].startswith("b1-h4-kv2-sq512-")
    def cell(i: int) -> list[str]:
        return [w.key().removesuffix("-d64-causal-fp16")
                for w in problem("fwd").cell_workloads(tp.parts[i].workload)]
    assert cell(5) == ["b1-h4-kv2-sq431-sk431", "b4-h4-kv2-sq431-sk431",
                       "b1-h4-kv2-sq609-sk609", "b4-h4-kv2-sq609-sk609"]
    assert cell(1) == ["b38-h4-kv2-sq431-sk431", "b10-h4-kv2-sq431-sk431",
                       "b27-h4-kv2-sq609-sk609", "b7-h4-kv2-sq609-sk609"]


@pytest.mark.parametrize("cross", [True, False])
def test_crossed_searches_re_time_their_elites_in_fewer_rounds(tmp_path: Path,
                                                               cross: bool) -> None:
    """Where the cross re-time follows (it times each rung's best again, on its cell), each
    search's own re-time only orders its elites: 2 rounds; without it, the search's 5. An
    option the caller gives wins."""
    from evoengine.search.loop import FINAL_ROUNDS

    seen: list[int] = []

    def searcher(config: SearchConfig, progress: Progress) -> SearchResult:
        seen.append(config.final_rounds)
        return fake_search()(config, progress)

    tp = tune.plan(TINY, SM90, name="rounds", kinds=("fwd",), trials=2, spaces=MMA,
                   cross=cross)
    tune.tune(tp, store=store_url(tmp_path), searcher=searcher, stream=io.StringIO(),
              spaces=MMA)
    assert seen == [tune.CROSSED_FINAL_ROUNDS if cross else FINAL_ROUNDS] * 2
    tp = tune.plan(TINY, SM90, name="asked", kinds=("fwd",), trials=2, spaces=MMA)
    seen.clear()
    tune.tune(tp, store=store_url(tmp_path), searcher=searcher, stream=io.StringIO(),
              spaces=MMA, options={"final_rounds": 7})
    assert seen == [7, 7]
