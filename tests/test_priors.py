"""The target's shipped priors (search_spaces/priors/, evoengine/search/priors.py): what they
hold, that they build, and where they come in a search's seeds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from evoengine import paths
from evoengine.arch import get_arch
from evoengine.cli import build_parser
from evoengine.search import priors
from evoengine.search.domain import Domain
from evoengine.space import SearchSpace
from evoengine.workload import Workload

SM90 = get_arch("sm_90a")


def generator():  # benchmarks/priors.py, which writes the shipped file
    spec = importlib.util.spec_from_file_location("priors_gen", paths.ROOT / "benchmarks/priors.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_priors_are_what_their_sources_give() -> None:
    """A fact written once: the file is rebuilt from the results files it names."""
    shipped = json.loads(priors.path("sm_90a").read_text())
    assert shipped == generator().build("sm_90a")
    kinds = {p["kind"] for p in shipped["points"]}
    assert kinds == {"fwd", "bwd", "varlen", "varlen_bwd", "decode"}
    for p in shipped["points"]:
        assert (paths.ROOT / p["source"]).is_file(), p["source"]


def test_every_shipped_prior_builds_for_its_own_problem() -> None:
    for p in priors.load("sm_90a"):
        space = SearchSpace.load(paths.SPACES / f"{p.family}.toml")
        params = space.complete(p.params)
        assert space.violations(params, dict(p.problem), SM90) == [], p


def mma() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "mma.toml")


def test_a_prior_the_domain_does_not_admit_is_no_seed(planted: Path) -> None:
    here = Workload(8, 8, 2048, 64, causal=True)
    (planted / "sm_90a.json").write_text(json.dumps({"points": [
        {"kind": "fwd", "family": "mma", "problem": here.problem(),
         "params": {"BLOCK_M": 4096}, "source": "x.json"},
        {"kind": "fwd", "family": "no-such-family", "problem": here.problem(), "params": {},
         "source": "x.json"}]}))
    assert priors.admitted(Domain([mma()], here, SM90)) == []
    assert priors.load("sm_89") == ()  # no file: no priors


def test_a_malformed_priors_file_names_itself(planted: Path) -> None:
    (planted / "sm_90a.json").write_text(json.dumps({"points": [{"kind": "fwd"}]}))
    with pytest.raises(ValueError, match=r"sm_90a\.json: points\[0\] lacks 'family'"):
        priors.load("sm_90a")


def test_search_and_tune_take_a_no_priors_flag() -> None:
    parser = build_parser()
    for command in (["search", "--shape", "1,2,64,64"], ["tune", "--q-heads", "8"]):
        assert parser.parse_args(command).priors is True
        assert parser.parse_args([*command, "--no-priors"]).priors is False


def test_a_search_tries_the_priors_first_and_says_how_many(planted: Path,
                                                           tmp_path: Path) -> None:
    """With ``priors``, a search with an empty store proposes the target's priors first (6
    trials of hundreds of points reach both) and counts them in its tally and results
    document; without, it does not start from them."""
    from tests.test_search import FakeEvaluator, config, run

    here = config(tmp_path).workload
    points = mma().admitted(here.problem(), SM90)
    chosen = [points[7], points[3]]
    (planted / "sm_90a.json").write_text(json.dumps({"points": [
        {"kind": "fwd", "family": "mma", "problem": here.problem(), "params": p,
         "source": "x.json"} for p in chosen]}))
    domain = Domain([mma()], here, SM90)
    first = [domain.identity("mma", p) for p in chosen]

    seeded = FakeEvaluator()
    result = run(config(tmp_path, trials=6, priors=True), seeded)
    # proposed first; compiled ahead in parallel, so evaluated among the first few, not in order
    assert set(first) <= set(seeded.evaluated)
    assert (result.tally.seeds, result.tally.seeds_from_priors) == (2, 2)
    assert result.evidence()["search"]["seeds_from_priors"] == 2

    blind = FakeEvaluator()
    result = run(config(tmp_path / "blind", trials=6), blind)
    assert result.tally.seeds == 0 and not set(first) <= set(blind.evaluated)
