"""The index of benchmarks/results/: each file's header and summary, and where README.md,
docs/NOTES.md and docs/RESULTS.md cite it.

    python benchmarks/results_index.py            # rewrite benchmarks/results/INDEX.md
    python benchmarks/results_index.py --check    # exit 1 if INDEX.md is stale or a file or
                                                  # citation is wrong, saying which

Every JSON file carries the header of ``evoengine.provenance.header`` (device, driver, torch,
date, commit, method; a null one explained by ``header_note``) and a one-line ``summary`` of
what it measured, added by hand when the file is committed. Every file, JSON or not, must be
cited by one of those docs (DOCS), and every results path they cite must exist. INDEX.md is
written from these alone, so it is never edited by hand; tests/test_results.py checks it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evoengine.provenance import HEADER_KEYS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
DOCS = ("README.md", "docs/NOTES.md", "docs/RESULTS.md")
# A results path as the docs write it, or a results file by its dated name alone.
_PATH = re.compile(r"benchmarks/results/[\w./-]*[\w/]")
_NAME = re.compile(r"(?<![\w/.-])\d{4}-\d\d-\d\d-[\w.-]*\.(?:json|txt)")
_HEADING = re.compile(r"^#+\s+(.*)")
_REMARKS = re.compile(r"\s*\([^()]*[,`][^()]*(?:\)|$)")


def results_files() -> list[str]:
    """Every file under benchmarks/results/ but the index, relative to it."""
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p != INDEX)


def citations() -> tuple[dict[str, list[str]], list[str]]:
    """For each results file, the doc sections that cite it (``README › Search``); and the
    cited paths that do not exist. A cited folder cites every file in it."""
    files = results_files()
    cited: dict[str, list[str]] = {f: [] for f in files}
    missing = []
    for doc in DOCS:
        label = section = doc.split("/")[-1].removesuffix(".md")
        for line in (ROOT / doc).read_text().splitlines():
            heading = _HEADING.match(line)
            if heading:  # named without its (date, device, commit, `file`) remarks
                section = f"{label} › {_REMARKS.sub('', heading.group(1))}"
            refs = [m.removeprefix("benchmarks/results/") for m in _PATH.findall(line)]
            refs += _NAME.findall(_PATH.sub("", line))
            for ref in refs:
                hits = [f for f in files if f == ref or ref.endswith("/") and f.startswith(ref)]
                if ref and not hits:
                    missing.append(f"{doc} cites benchmarks/results/{ref}, which does not exist")
                for f in hits:
                    if section not in cited[f]:
                        cited[f].append(section)
    return cited, missing


def header_problems(name: str, doc: dict) -> list[str]:
    """What a results JSON lacks: a header key, the note a null one needs, its summary."""
    out = [f"{name}: no {k!r}" for k in (*HEADER_KEYS, "summary") if k not in doc]
    nulls = [k for k in HEADER_KEYS if k in doc and doc[k] is None]
    if nulls and not doc.get("header_note"):
        out.append(f"{name}: {', '.join(nulls)} null without a header_note saying why")
    return out


def problems() -> list[str]:
    """Everything that keeps the results and the docs from agreeing; empty when they do."""
    cited, out = citations()
    for name in results_files():
        if name.endswith(".json"):
            out += header_problems(name, json.loads((RESULTS / name).read_text()))
        if not cited[name]:
            out.append(f"{name}: cited by none of {', '.join(DOCS)}")
    return out


def _cell(text: object) -> str:
    return "—" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """INDEX.md's text."""
    cited, _ = citations()
    lines = [
        "# Results index",
        "",
        "Written by `python benchmarks/results_index.py` from each file's header and summary",
        "and from where README.md, docs/NOTES.md and docs/RESULTS.md cite it; do not edit.",
        "— : not recorded, or no GPU took part (offline compiles, replays, the store",
        "benchmark); the file's `header_note` says which.",
        "",
        "| file | date | device | commit | what it measured | cited in |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    others = []
    for name in results_files():
        if not name.endswith(".json"):
            others.append(name)
            continue
        doc = json.loads((RESULTS / name).read_text())
        date = doc.get("date")
        lines.append(
            f"| [{name}]({name}) | {_cell(date and date[:16].replace('T', ' '))} "
            f"| {_cell(doc.get('device'))} | {_cell(doc.get('commit'))} "
            f"| {_cell(doc.get('summary'))} | {_cell('; '.join(cited[name]) or None)} |")
    if others:
        lines += ["", "Other files (no header): where they are cited.", ""]
        lines += [f"- [{name}]({name}): {'; '.join(cited[name]) or '—'}" for name in others]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on a problem")
    args = ap.parse_args()
    found = problems()
    stale = not INDEX.is_file() or INDEX.read_text() != render()
    if args.check:
        found += [f"{INDEX.relative_to(ROOT)} is stale: run benchmarks/results_index.py"] * stale
    elif stale:
        INDEX.write_text(render())
        print(f"wrote {INDEX.relative_to(ROOT)}")
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
