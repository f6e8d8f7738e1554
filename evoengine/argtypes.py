"""Values typed on the command line: counts, durations, device lists.

Every number an option takes goes through one of these (the CLI's and the problems'
workload flags alike): a count, size or duration of zero or less is refused when parsed
(``--limit -3`` once meant "all but the last 3"), as one ``argparse`` error line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)



def _checked(parse: Callable[[str], T], ok: Callable[[T], bool],
             what: str) -> Callable[[str], T]:
    """An argparse type: ``parse`` the text, then refuse a value ``ok`` rejects."""

    def check(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):  # type: ignore[arg-type]
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return check


def _seconds(text: str) -> float:
    """Seconds from '90', '90s', '10m' or '2h'."""
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


positive_int = _checked(int, lambda n: n >= 1, "a positive integer")
non_negative_int = _checked(int, lambda n: n >= 0, "an integer >= 0")
positive_duration = _checked(_seconds, lambda t: t > 0, "a duration > 0 (90s, 10m, 2h)")
non_negative_duration = _checked(_seconds, lambda t: t >= 0, "a duration >= 0 (0.5s, 90s)")


def gpu_list(text: str) -> list[int]:
    """Device indices from '0,1,3': distinct, non-negative."""
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of GPU indices: {text!r} "
                                         "(try 0,1)") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"GPU indices must be distinct and >= 0: {text!r}")
    return devices
