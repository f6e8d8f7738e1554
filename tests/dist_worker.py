"""One search worker as its own OS process, for the distributed tests: ``python -m
tests.dist_worker --store URL --space FILE [--trials N] [--gpus 0,1] ...``.

It takes the arguments of ``evoengine search`` that the tests use, and runs ``search()``
with fake GPUs (``DelayEvaluator``: ``--delay`` seconds per candidate, times from
``fake_time``) and the stub compiler, so several of these on one store behave like
search hosts sharing a study without any GPU. ``--heartbeat S`` sets Optuna's heartbeat to
S seconds and the grace period to 3 S, as ``evoengine search --heartbeat`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from evoengine.compile import CompileResult
from evoengine.render import Candidate
from evoengine.search import DeviceInfo, Evaluation, Evaluator, Progress, SearchConfig, search
from evoengine.space import SearchSpace
from tests.test_search import SM90, WORKLOAD, fake_time, stub_compile


class DelayEvaluator(Evaluator):
    """A fake GPU that takes ``delay`` seconds per candidate."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.evaluated: list[str] = []

    def start(self) -> DeviceInfo:
        return DeviceInfo("Fake H100", (9, 0), "0.0", {"torch": "fake"})

    def evaluate(self, candidate: Candidate, compiled: CompileResult) -> Evaluation:
        time.sleep(self.delay)
        self.evaluated.append(candidate.identity)
        return Evaluation(True, median_us=fake_time(candidate.params), spread_us=0.5, reps=50,
                          graph=False, seconds=self.delay)

    def baseline(self) -> dict[str, float | None]:
        return {"flash": 110.0, "cudnn": 80.0}

    def final(self, entries: Any, rounds: int) -> dict[str, Any]:
        return {"candidates": [{"median_us": fake_time(c.params), "spread_us": 0.1,
                                "rounds": rounds} for c, _ in entries],
                "flash": 110.0, "cudnn": 80.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.dist_worker")
    p.add_argument("--store", required=True)
    p.add_argument("--space", required=True)
    p.add_argument("--study")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gpus", default="0")
    p.add_argument("--heartbeat", type=int, default=60)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--json")
    args = p.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",")]
    config = SearchConfig(workload=WORKLOAD, spaces=[SearchSpace.load(args.space)], arch=SM90,
                          store=args.store, study=args.study, trials=args.trials,
                          seed=args.seed, compile_workers=args.workers, gpus=gpus,
                          heartbeat_s=args.heartbeat, grace_s=3 * args.heartbeat,
                          refresh_s=min(10.0, args.heartbeat))
    result = search(config, evaluator=[DelayEvaluator(args.delay) for _ in gpus],
                    progress=Progress(1.0, stream=sys.stderr, every_s=2.0),
                    compile_fn=stub_compile)
    if args.json:
        Path(args.json).write_text(json.dumps(result.evidence(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
