"""SCHEDULER dynamic against its static twin, and in deterministic mode (the same kernel dealing
every tile statically), timed interleaved in one process by CUDA-graph replay:

    python experiments/2026-11-27-decode-dynamic/modes.py --points points-modes.json \
        --out $OUT/modes.json decode-b1-q4-h64-kv8-d128-c32768-paged64-bf16 ...

Each point of the list (static) is built with SCHEDULER static and dynamic; rows print the
three medians (of the rounds' medians) and write them as JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch

    from evoengine import measure, paths
    from evoengine.compile import compile_many
    from evoengine.decode import DecodeKernel
    from evoengine.problems.decode import Decode, DecodeWorkload
    from evoengine.render import make_candidate
    from evoengine.runtime import gpu_arch
    from evoengine.space import SearchSpace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", metavar="KEY")
    ap.add_argument("--points", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()
    problem = Decode()
    rows = []
    for key in args.workloads:
        w = DecodeWorkload.from_key(key)
        cands = []
        for p in json.loads(Path(args.points).read_text()):
            for sched in ("static", "dynamic"):
                cands.append(make_candidate(space, space.complete(dict(p, SCHEDULER=sched)),
                                            w.problem(), arch))
        kernels = [DecodeKernel(c, r) for c, r in zip(cands, compile_many(cands, arch),
                                                       strict=True)]
        for k in kernels:
            v = problem.check(k, w)
            assert v.ok, (k.name, v.reason)
        sets = problem.inputs(w)
        calls = {}
        for static, dynamic in zip(kernels[::2], kernels[1::2], strict=True):
            calls[(static.name, "static")] = problem.timed_call(static, w, sets)
            calls[(static.name, "dynamic")] = problem.timed_call(dynamic, w, sets)
            free = problem.timed_call(dynamic, w, sets)

            def det(i: int, free=free) -> None:  # noqa: ANN001
                was = torch.are_deterministic_algorithms_enabled()
                torch.use_deterministic_algorithms(True)
                try:
                    free(i)
                finally:
                    torch.use_deterministic_algorithms(was)
            calls[(static.name, "deterministic")] = det
        times: dict = {c: [] for c in calls}
        for _ in range(args.rounds):
            for c, fn in calls.items():
                times[c].append(measure.time_calls(fn, len(sets), graph=True).median_us)
        for name in dict.fromkeys(n for n, _ in calls):
            med = {mode: statistics.median(times[(name, mode)])
                   for mode in ("static", "dynamic", "deterministic")}
            rows.append(dict(workload=key, point=name, us=med))
            print(f"{key[7:]} {name.split('block_n')[1][:60]} static {med['static']:.1f} "
                  f"dynamic {med['dynamic']:.1f} ({med['static'] / med['dynamic']:.3f}x) "
                  f"deterministic {med['deterministic']:.1f} "
                  f"({med['static'] / med['deterministic']:.3f}x)", flush=True)
        del sets
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
