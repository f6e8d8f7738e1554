"""Where the project's data lives: templates, search spaces, the compile cache."""

from __future__ import annotations

import os
from pathlib import Path

# The package runs from a source tree (pip install -e ., or PYTHONPATH on a GPU box);
# EVOENGINE_HOME points elsewhere when the templates and spaces live apart from the code.
ROOT = Path(os.environ.get("EVOENGINE_HOME", Path(__file__).resolve().parent.parent))
TEMPLATES = ROOT / "templates"
SPACES = ROOT / "search_spaces"


def cache_dir() -> Path:
    """The on-disk compile cache, shared by every process of this user."""
    base = os.environ.get("EVOENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "evoengine"
    )
    return Path(base)
