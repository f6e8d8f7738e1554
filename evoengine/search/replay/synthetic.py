"""A synthetic record, for development only: a cost model over a real domain, never
evidence.

Contract. ``synthetic_record`` is deterministic in its arguments; the record it makes says
so everywhere (``synthetic`` true, device ``SYNTHETIC_DEVICE``, a note). It raises
``ValueError`` when no space admits a point for the workload on the arch.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable

from evoengine.arch import get_arch
from evoengine.search.domain import Domain
from evoengine.search.replay.record import SYNTHETIC_DEVICE, Record, RecordedPoint
from evoengine.space import SearchSpace, default_spaces
from evoengine.workload import Workload


def synthetic_record(workload: Workload, arch: str = "sm_90a", *,
                     spaces: Iterable[SearchSpace] | None = None, seed: int = 0) -> Record:
    """A record made by a deterministic cost model over the real domain of ``workload``:
    for developing and testing the replay and the strategies benchmark, never evidence.

    The model is a product of per-parameter factors (each a bowl over an ordered domain or a
    fixed penalty per categorical value), a family factor, pairwise interactions and a few
    percent of hashed noise; about 4% of points fail to compile and 3% give wrong answers.
    """
    domain = Domain(default_spaces() if spaces is None else spaces, workload, get_arch(arch))

    def u(*parts: object) -> float:  # a deterministic uniform in [0, 1)
        h = hashlib.sha256(json.dumps([seed, *parts], default=str).encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    family_base = {f: 60.0 * (1.0 + 0.8 * u("family", f)) for f in domain.families}
    points = []
    for family, params in domain.all_points():
        names = list(domain.spaces[family].parameters)
        t = family_base[family]
        for name in names:
            values = list(domain.spaces[family].parameters[name])
            i = next(k for k, v in enumerate(values) if type(v) is type(params[name])
                     and v == params[name])
            if len(values) > 1 and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in values):
                best = u("best", family, name) * (len(values) - 1)
                t *= 1.0 + 0.25 * u("width", family, name) * ((i - best) / (len(values) - 1)) ** 2
            else:
                t *= 1.0 + 0.12 * u("value", family, name, i)
        for a, b in zip(names, names[1:], strict=False):
            t *= 1.0 + 0.04 * u("pair", family, a, b, params[a], params[b])
        t *= 1.0 + 0.03 * u("noise", family, params)
        r = u("fail", family, params)
        ok, compiled, reason = True, True, None
        if r < 0.04:
            ok, compiled, reason = False, False, "compile error: synthetic failure"
        elif r < 0.07:
            ok, reason = False, "wrong answer: synthetic failure"
        points.append(RecordedPoint(
            family=family, params=dict(params), ok=ok, median_us=round(t, 3) if ok else None,
            spread_us=round(0.01 * t, 3) if ok else None, reason=reason, compiled=compiled,
            registers=128 if compiled else None, spill_bytes=0 if compiled else None,
            smem_bytes=None, seconds=0.5))
    times = [p.median_us for p in points if p.ok]
    return Record(
        arch=domain.arch.name, workload=workload, device=SYNTHETIC_DEVICE,
        points=tuple(points),
        families={f: {"template_hash": None, "parameters": list(s.parameters)}
                  for f, s in domain.spaces.items()},
        driver=None, date=None, commit=None, versions={},
        note=f"SYNTHETIC: evoengine.search.replay.synthetic_record(seed={seed}); not measured",
        synthetic=True, sdpa={"flash": round(statistics.median(times), 3), "cudnn": None})
