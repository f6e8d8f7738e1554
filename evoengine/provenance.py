"""Where a result came from: the one header every results JSON carries.

Every file under ``benchmarks/results/`` starts with the same keys, written by ``header``:
``device``, ``driver``, ``torch``, ``date``, ``commit``, ``method``. A number in README or
docs points at one of those files, so a reader can tell which machine, which code and which
way of timing produced it.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any

from evoengine import paths

HEADER_KEYS = ("device", "driver", "torch", "date", "commit", "method")


def git_commit() -> str | None:
    """The checkout's short commit (``EVO_COMMIT`` wins: a copied tree has no .git), with
    ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    if os.environ.get("EVO_COMMIT"):
        return os.environ["EVO_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(paths.ROOT), "describe", "--always", "--dirty",
                              "--abbrev=7"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def header(*, device: str | None, driver: str | None, torch: str | None, method: str,
           **more: Any) -> dict[str, Any]:
    """The header of a results JSON, then ``more`` (what the file is about)."""
    return {"device": device, "driver": driver, "torch": torch, "date": utc_now(),
            "commit": git_commit(), "method": method, **more}


def local_device(index: int = 0) -> dict[str, str | None]:
    """``device``, ``driver`` and ``torch`` of this machine's GPU ``index`` (None where absent),
    for tools that time in their own process."""
    try:
        import torch
    except ImportError:
        return {"device": None, "driver": None, "torch": None}
    device = torch.cuda.get_device_name(index) if torch.cuda.is_available() else None
    driver = None
    if device is not None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,"
                                  "noheader", "-i", str(index)], capture_output=True, text=True,
                                 timeout=10)
            driver = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"device": device, "driver": driver, "torch": torch.__version__}
