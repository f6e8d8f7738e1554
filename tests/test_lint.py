"""The code is ruff-clean (the configuration is in pyproject.toml), and the shell scripts parse."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_clean() -> None:
    done = subprocess.run(["ruff", "check", "--no-cache", "evoengine", "tests", "benchmarks",
                           "experiments"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shell_scripts_parse() -> None:
    """Every tracked shell script parses (``bash -n``): the device runs them, nothing here."""
    found = (*ROOT.glob("benchmarks/**/*.sh"), *ROOT.glob("experiments/**/*.sh"),
             *ROOT.glob(".ci/*"))
    scripts = sorted(p for p in found if p.is_file())
    assert scripts, "no shell scripts found"
    for script in scripts:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.relative_to(ROOT)}: {done.stderr}"
