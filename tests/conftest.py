"""Tests under tests/gpu/ carry the ``gpu`` marker and skip where no CUDA GPU is usable."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).parent / "gpu"


@functools.cache
def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import cupy  # noqa: F401
        import torch
    except Exception as e:  # a broken CUDA install is a reason to skip, not to error
        return f"cupy/torch not importable: {e}"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            reason = gpu_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder of search priors in place of the shipped one (evoengine/search/priors.py),
    for a test to write a target's file into."""
    from evoengine.search import priors

    folder = tmp_path / "priors"
    folder.mkdir()
    monkeypatch.setattr(priors, "PRIORS", folder)
    priors.load.cache_clear()
    yield folder
    priors.load.cache_clear()
