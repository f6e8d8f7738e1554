"""Where the project's data lives: templates, search spaces, the compile cache."""

from __future__ import annotations

import os
from pathlib import Path

# The package runs from a source tree (pip install -e ., or PYTHONPATH on a GPU box);
# EVOENGINE_HOME points elsewhere when the templates and spaces live apart from the code.
ROOT = Path(os.environ.get("EVOENGINE_HOME", Path(__file__).resolve().parent.parent))
TEMPLATES = ROOT / "templates"
SPACES = ROOT / "search_spaces"

# The stores a command uses when given none, relative to the working directory. A replay
# never writes into the measured store: its numbers are not this machine's.
DEFAULT_STORE = "runs/evoengine.db"
REPLAY_STORE = "runs/replay.db"


def template_dirs() -> list[Path]:
    """Where families are looked up: the project's templates, then any folders named in
    ``EVOENGINE_TEMPLATES`` (os.pathsep-separated), which is how the GPU tests add a family
    that plants a fault. The first folder holding ``<family>/kernel.cu.j2`` wins."""
    extra = os.environ.get("EVOENGINE_TEMPLATES", "")
    return [TEMPLATES, *(Path(p).resolve() for p in extra.split(os.pathsep) if p)]


def family_dir(family: str) -> Path | None:
    """The template folder of ``family``, or None when no template root has it."""
    for root in template_dirs():
        if (root / family / "kernel.cu.j2").is_file():
            return root / family
    return None


def output_file(path: str | os.PathLike[str], what: str = "output") -> Path:
    """``path`` as a file a command will write: refused (``ValueError``, one line) where it is
    a folder or under something that is not one, so that a long run does not end on it.
    Missing parent folders are fine: the writers create them."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"the {what} {p} is a folder: name a file (in it, or elsewhere)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"the {what} {p} cannot be written: {parent} is not a folder")
            break
    return p


def cache_dir() -> Path:
    """The on-disk compile cache, shared by every process of this user."""
    base = os.environ.get("EVOENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "evoengine"
    )
    return Path(base)
