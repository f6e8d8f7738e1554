"""benchmarks/results/: every JSON carries the one header, every file is cited by README.md or
docs/NOTES.md, every results path they cite exists, and INDEX.md is what
``benchmarks/results_index.py`` writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from evoengine import paths
from evoengine.provenance import HEADER_KEYS, header


def load_tool() -> ModuleType:
    path = paths.ROOT / "benchmarks" / "results_index.py"
    spec = importlib.util.spec_from_file_location("results_index", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


index = load_tool()
RESULTS = paths.ROOT / "benchmarks" / "results"


def results_json() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


@pytest.mark.parametrize("path", results_json(), ids=lambda p: p.name)
def test_every_results_json_has_the_header(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert list(doc)[:len(HEADER_KEYS)] == list(HEADER_KEYS), "the header comes first"
    assert isinstance(doc.get("summary"), str) and doc["summary"]
    nulls = [k for k in HEADER_KEYS if doc[k] is None]
    assert not nulls or doc.get("header_note"), f"{nulls} null with no header_note saying why"


def test_every_results_file_is_cited_and_every_citation_exists() -> None:
    cited, missing = index.citations()
    assert missing == []
    assert [name for name, where in cited.items() if not where] == []


def test_the_index_is_up_to_date() -> None:
    text = (RESULTS / "INDEX.md").read_text()
    assert text == index.render(), "run python benchmarks/results_index.py"
    assert all(f"[{name}]({name})" in text for name in index.results_files())


def test_the_checks_name_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file without a header or a citation, and a citation without a file, are reported."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "2026-01-01-good.json").write_text(json.dumps(header(
        device=None, driver=None, torch=None, method="m", header_note="offline", summary="s")))
    (results / "2026-01-01-bare.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Results\n`benchmarks/results/2026-01-01-good.json` and `2026-01-01-gone.json`\n")
    (tmp_path / "docs" / "NOTES.md").write_text("## Notes\n")
    (tmp_path / "docs" / "RESULTS.md").write_text("## Closed\n")
    monkeypatch.setattr(index, "ROOT", tmp_path)
    monkeypatch.setattr(index, "RESULTS", results)
    monkeypatch.setattr(index, "INDEX", results / "INDEX.md")
    found = index.problems()
    assert "README.md cites benchmarks/results/2026-01-01-gone.json, which does not exist" in found
    assert "2026-01-01-bare.json: no 'commit'" in found
    assert "2026-01-01-bare.json: no 'summary'" in found
    assert ("2026-01-01-bare.json: cited by none of README.md, docs/NOTES.md, docs/RESULTS.md"
            in found)
    assert not [line for line in found if "good.json" in line and "gone" not in line]
    assert "| README › Results |" in index.render()
