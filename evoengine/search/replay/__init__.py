"""Replay: search on recorded measurements instead of a GPU, as Kernel Tuner's simulation
mode does, so strategies and scheduling can be tested (and compared) in CI.

One module per part, each stating its contract:

- ``record``: the format of a record (one sweep of one arch and workload) and its file;
- ``from_store``: a record made from the measurements of a store (``evoengine record``);
- ``domain``: the ``Domain`` of the recorded points only, so no sampler can propose a point
  the record lacks;
- ``evaluator``: ``ReplayEvaluator`` (recorded medians and failures) and ``replay_compile``
  (recorded compile outcomes, no NVRTC); ``evoengine search --replay FILE`` runs the normal
  loop on these three;
- ``synthetic``: a record from a cost model, for development only, never evidence.
"""

from __future__ import annotations

from evoengine.search.replay.domain import RecordedDomain, recorded_spaces, replay_domain
from evoengine.search.replay.evaluator import ReplayCompiler, ReplayEvaluator, replay_compile
from evoengine.search.replay.from_store import record_from_store
from evoengine.search.replay.record import (
    FORMAT,
    NOT_RECORDED,
    SYNTHETIC_DEVICE,
    Record,
    RecordedPoint,
    RecordError,
    load_record,
    point_key,
    save_record,
)
from evoengine.search.replay.synthetic import synthetic_record

__all__ = [
    "FORMAT", "NOT_RECORDED", "SYNTHETIC_DEVICE", "Record", "RecordError", "RecordedDomain",
    "RecordedPoint", "ReplayCompiler", "ReplayEvaluator", "load_record", "point_key",
    "record_from_store", "recorded_spaces", "replay_compile", "replay_domain", "save_record",
    "synthetic_record",
]
