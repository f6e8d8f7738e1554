"""``evoengine report`` (``evoengine.report``) without a GPU: a store built by replaying the
recorded H100 sweeps, the page checked with the standard library's HTML parser."""

from __future__ import annotations

import html.parser
import sys
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest

from evoengine.cli import main
from evoengine.report import Selection, write_report
from evoengine.report.importance import MIN_TRIALS, study_importances
from evoengine.store import Store

DATA = Path(__file__).resolve().parent / "data"
D64 = "b16-h16-kv16-sq2048-sk2048-d64-full-fp16"
D128 = "b8-h16-kv16-sq4096-sk4096-d128-causal-fp16"
SWEEP = {key: DATA / f"sweep-sm_90a-{key}.json.gz" for key in (D64, D128)}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two workloads: the default study of each (40 trials), and a tune ``t1`` whose study of
    the d64 workload searches it again (a second study of one workload). One compiler
    process: a replay's compiles are lookups, and a pool of them only costs start-up."""
    db = str(tmp_path_factory.mktemp("report") / "replay.db")
    for key, trials, extra in ((D64, 40, []), (D128, 40, []),
                               (D64, 24, ["--study", f"t1/sm_90a-{D64}"])):
        assert main(["search", "--replay", str(SWEEP[key]), "--trials", str(trials), "--store",
                     db, "--seed", "1", "--workers", "1", *extra]) == 0
    return db


@dataclass
class Page(html.parser.HTMLParser):
    """The page's structure: tags must balance; sections are read by id and class."""

    open: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)
    sections: dict[str, dict[str, int]] = field(default_factory=dict)  # workload: tag counts
    elite_rows: dict[str, list[str]] = field(default_factory=dict)
    run_rows: list[int] = field(default_factory=list)
    classes: dict[str, list[str]] = field(default_factory=dict)  # workload: section classes
    text: list[str] = field(default_factory=list)

    VOID = frozenset({"meta", "br", "img", "hr", "input", "link", "col", "wbr", "source"})

    def __post_init__(self) -> None:
        super().__init__()

    def workload(self) -> str | None:
        for tag, attrs in reversed(self.open):
            if tag == "section" and "workload" in (attrs.get("class") or ""):
                return attrs.get("id")
        return None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        w = self.workload()
        if w is not None:
            counts = self.sections.setdefault(w, {})
            counts[tag] = counts.get(tag, 0) + 1
            if tag == "section":
                self.classes.setdefault(w, []).append(a.get("class") or "")
            if tag == "tr" and a.get("data-identity"):
                self.elite_rows.setdefault(w, []).append(str(a["data-identity"]))
        if tag == "tr" and a.get("data-run"):
            self.run_rows.append(int(str(a["data-run"])))
        if tag not in self.VOID:
            self.open.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        assert self.open, f"</{tag}> closes nothing"
        assert self.open[-1][0] == tag, f"</{tag}> closes <{self.open[-1][0]}>"
        self.open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    # Self-contained: nothing fetched, no script at all.
    for outside in ('src="http', "src='http", "<script", 'href="http', "@import", "url(http",
                    "url('http", 'url("http'):
        assert outside not in text, outside
    page = Page()
    page.feed(text)
    page.close()
    assert page.open == [], f"unclosed: {[t for t, _ in page.open]}"
    return page


def test_the_page_of_every_run(store: str, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "report.html"
    assert main(["report", "--store", store, "-o", str(out)]) == 0
    page = parse(out)
    with Store(store, create=False) as s:
        runs = s.runs()
        elites = {f"w-sm_90a-{key}": [e.identity for e in s.elites(arch="sm_90a",
                                                                     workload_key=key)]
                  for key in (D64, D128)}
    assert set(page.sections) == set(elites)
    for w, counts in page.sections.items():
        assert counts["svg"] == 2, w  # the progression and the anchors, one <svg> each
        assert counts["table"] >= 2, w  # the elites, and importances of at least one family
        assert page.classes[w][:4] == ["progress", "anchors", "elites", "importance"]
        assert page.elite_rows[w] == elites[w] and len(elites[w]) == 5
    assert page.run_rows == sorted(r.id for r in runs)
    text = " ".join(page.text)
    assert "SDPA cuDNN" in text and ("fANOVA" in text or "PED-ANOVA" in text)
    assert text.count("Family ") >= 3  # importances per family, each with its table
    assert f"t1/sm_90a-{D64}" in text and "Runs" in text
    assert "NVIDIA H100" in text  # the device the record was measured on


def test_a_tune_and_a_study_prefix_select_their_runs(store: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with Store(store, create=False) as s:
        tune_runs = [r.id for r in s.runs() if (r.study or "").startswith("t1/")]
        d128_runs = [r.id for r in s.runs() if r.workload_key == D128]
    out = tmp_path / "tune.html"
    assert main(["report", "--store", store, "--tune", "t1", "-o", str(out)]) == 0
    assert "report of 1 runs on 1 workloads" in capsys.readouterr().out
    page = parse(out)
    assert list(page.sections) == [f"w-sm_90a-{D64}"] and page.run_rows == tune_runs
    out = tmp_path / "prefix.html"
    assert main(["report", "--store", store, "--study", "sm_90a-b8*", "--arch", "sm_90a",
                 "--kind", "fwd", "-o", str(out)]) == 0
    page = parse(out)
    assert list(page.sections) == [f"w-sm_90a-{D128}"] and page.run_rows == d128_runs


@pytest.mark.parametrize("args,says", [
    (["--study", "nope"], "no run in "),
    (["--tune", "t2"], "its studies: "),
    (["--kind", "bwd"], "--kind bwd"),
    (["--arch", "sm_89"], "--arch sm_89"),
    (["--arch", "sm_99"], "unknown arch"),
])
def test_a_selection_that_matches_nothing_is_one_line(store: str, tmp_path: Path, args: list[str],
                                                      says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert main(["report", "--store", store, "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evoengine: ") and says in err and err.count("\n") == 1
    assert not out.exists()


def test_a_missing_store_is_one_line_and_not_created(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.db"
    assert main(["report", "--store", str(missing), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evoengine: no store at ") and err.count("\n") == 1
    assert not missing.exists() and not (tmp_path / "r.html").exists()


def test_a_run_without_a_final_retime_or_study_says_so(tmp_path: Path) -> None:
    """A run stopped before its re-time, with no Optuna study: the page says what is missing
    instead of failing, and still draws the progression."""
    db = tmp_path / "hand.db"
    with Store(db) as s:
        run = s.start_run(arch="sm_90a", workload={"kind": "fwd", "batch": 1, "heads": 8,
                                                   "seq_q": 512, "head_dim": 64},
                          workload_key="b1-h8-kv8-sq512-sk512-d64-full-fp16", device="GPU X")
        s.add_candidate(identity="a", family="mma", template_hash="h", params={"X": 1},
                        problem={}, source="")
        s.add_measurement(run, "a", ok=False, reason="compile error: x",
                          extra={"phase": "search", "trial": 0})
        s.add_measurement(run, "a", ok=True, median_us=12.5, extra={"phase": "search"})
        s.finish_run(run, "interrupted")
    report = write_report(db, Selection(), tmp_path / "r.html")
    assert (report.runs, report.workloads) == (1, 1)
    page = parse(report.path)
    (counts,) = page.sections.values()
    assert counts["svg"] == 1  # the progression; no anchors to draw
    text = " ".join(page.text)
    assert "No final re-time" in text and "no elites" in text
    assert "no Optuna study" in text or "no Optuna studies" in text


def test_importances_say_why_a_study_cannot_be_judged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'o.db'}"
    dist = optuna.distributions.CategoricalDistribution
    study = optuna.create_study(study_name="s", storage=url)
    fam = {"family": dist(["mma"]), "mma.A": dist([1, 2]), "mma.B": dist([1, 2, 3])}

    def add(n: int) -> None:
        study.add_trials([optuna.trial.create_trial(
            params={"family": "mma", "mma.A": 1 + i % 2, "mma.B": 1 + i % 3},
            distributions=fam, value=10.0 + i % 2 + 0.1 * (i % 3)) for i in range(n)])

    add(3)
    small = study_importances(url, "s")
    assert small.families == () and "too small" in small.notes[0]
    add(MIN_TRIALS)
    one = study_importances(url, "s")
    assert "one family (mma)" in one.notes[0]
    (mma,) = one.families
    assert set(mma.importances) == {"A", "B"} and mma.importances["A"] > mma.importances["B"]
    assert "no Optuna study named" in study_importances(url, "other").notes[0]


def test_the_bars_are_the_final_retimes_anchors(tmp_path: Path) -> None:
    """FA4 is drawn where the re-time timed it; an anchor that could not run is named; the
    run whose re-time found the fastest point gives the bars, with its own anchors."""
    db = tmp_path / "hand.db"
    key = "b1-h8-kv8-sq512-sk512-d64-full-fp16"
    with Store(db) as s:
        s.add_candidate(identity="a", family="mma", template_hash="h", params={"X": 1},
                        problem={}, source="")
        for ours, cudnn in ((9.0, 8.0), (7.5, 7.0)):
            run = s.start_run(arch="sm_90a", workload={"kind": "fwd", "batch": 1, "heads": 8,
                                                       "seq_q": 512, "head_dim": 64},
                              workload_key=key, device="GPU X")
            s.add_measurement(run, "a", ok=True, median_us=ours, extra={"phase": "search"})
            s.add_measurement(run, "a", ok=True, median_us=ours, extra={
                "phase": "final", "rounds": 3, "sdpa_flash_us": None, "sdpa_cudnn_us": cudnn,
                "fa4_us": 7.25})
            s.finish_run(run)
    report = write_report(db, Selection(arch="sm_90a"), tmp_path / "r.html")
    page = parse(report.path)
    (counts,) = page.sections.values()
    assert counts["svg"] == 2
    text = " ".join(page.text)
    assert "final re-time of run 2" in text and "Not timed: SDPA flash" in text
    assert "FlashAttention-4" in text and "7.0 µs" in text and "8.0 µs" not in text


def test_importances_without_scikit_learn_are_ped_anova(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'o.db'}"
    dist = optuna.distributions.CategoricalDistribution
    study = optuna.create_study(study_name="s", storage=url)
    study.add_trials([optuna.trial.create_trial(
        params={"family": "mma", "mma.A": 1 + i % 2, "mma.B": 1 + i % 3},
        distributions={"family": dist(["mma"]), "mma.A": dist([1, 2]), "mma.B": dist([1, 2, 3])},
        value=10.0 + i % 2 + 0.01 * i) for i in range(30)])
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn raises ImportError
    found = study_importances(url, "s")
    assert found.evaluator == "PED-ANOVA" and set(found.families[0].importances) <= {"A", "B"}
