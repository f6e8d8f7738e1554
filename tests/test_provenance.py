"""Tests of evoengine.provenance: the one header of a results JSON, and that no tool writes its
fields another way."""

from __future__ import annotations

import datetime
import re

import pytest

from evoengine import paths
from evoengine.provenance import HEADER_KEYS, header


def test_header_leads_with_its_keys_then_what_the_file_is_about(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVO_COMMIT", "abc1234")
    doc = header(device="GPU", driver="1.0", torch="2.0", method="how", rows=[1])
    assert tuple(doc)[:len(HEADER_KEYS)] == HEADER_KEYS
    assert doc["commit"] == "abc1234" and doc["rows"] == [1]
    assert datetime.datetime.fromisoformat(doc["date"]).tzinfo is not None


def tool_sources() -> dict[str, str]:
    """Every Python file that could write a results JSON, by path from the project root."""
    files = [*(paths.ROOT / "evoengine").rglob("*.py"), *(paths.ROOT / "benchmarks").rglob("*.py"),
             *(paths.ROOT / "experiments").rglob("*.py")]
    return {f.relative_to(paths.ROOT).as_posix(): f.read_text() for f in files}


def test_the_commit_is_looked_up_only_by_provenance() -> None:
    """One git lookup, ``git_commit`` (which honours EVO_COMMIT, for a copied tree): the copies
    it replaced disagreed (``unknown``, 12 digits, no ``-dirty``, EVO_COMMIT or not)."""
    copies = re.compile(r"\[\s*\"git\"|EVO_COMMIT")
    found = [name for name, text in tool_sources().items()
             if name not in {"evoengine/provenance.py"} and copies.search(text)]
    assert found == []
