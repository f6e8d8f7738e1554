"""How long must a contender run before its timed calls read the GPU's sustained speed?

    python experiments/2026-11-22-settling-the-clocks/settle.py --json out.json \
        [--clock-log clocks.csv]

For each (workload, contender) pair -- a wgmma point and SDPA's cuDNN backend -- and each
settling time, the GPU first idles for ``--gap`` seconds (as between two candidates of a
search, which load and validate on small shapes), then ``measure.time_calls`` times it with
that settling. The sustained reference is the median of five timings taken after
``--sustain`` seconds of uninterrupted calls. Reported: each settling's median over
``--repeats`` as a ratio to the sustained time (below 1: optimistic).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import measure  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

POINTS = {  # the re-time winners of 2026-11-22 (benchmarks/results/*-h100-wgmma-retime.json)
    "16,16,2048,64": dict(BLOCK_M=192, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs",
                          INTRA_WG_OVERLAP=True, PINGPONG=True, PERSISTENT=True,
                          TILE_ORDER="head", SCHEDULER="static"),
    "8,16,4096,128,causal": dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs",
                                 INTRA_WG_OVERLAP=True, PINGPONG=True, PERSISTENT=True,
                                 TILE_ORDER="head", SCHEDULER="static"),
}


def contenders(spec: str, w: Workload, sets: list) -> dict[str, Any]:
    import torch

    from evoengine.arch import arch_of_capability
    from evoengine.runtime import Kernel
    from evoengine.search.domain import Domain
    from evoengine.space import default_spaces

    arch = arch_of_capability(*torch.cuda.get_device_capability())
    kernel = Kernel.build(Domain(default_spaces(), w, arch).candidate("wgmma", POINTS[spec]), arch)
    sdpa = measure.sdpa_call(w, sets)

    def cudnn(i: int) -> None:
        with measure.sdpa_backend("cudnn"):
            sdpa(i)
    return {"wgmma": measure.kernel_call(kernel, sets, 1.0 / math.sqrt(w.head_dim)),
            "cudnn": cudnn}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settle", default="0,0.025,0.05,0.1,0.2,0.5")
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--sustain", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--clock-log", type=Path, help="sample nvidia-smi clocks/power to this CSV")
    args = ap.parse_args()
    settles = [float(s) for s in args.settle.split(",")]
    logger = None
    if args.clock_log:
        logger = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader", "-lms", "50"], stdout=args.clock_log.open("w"))
    rows = []
    try:
        for spec in POINTS:
            w = Workload.parse_spec(spec, dtype=args.dtype)
            sets = measure.workload_inputs(w)
            for name, fn in contenders(spec, w, sets).items():
                measure.settle(fn, len(sets), 10, args.sustain)
                sustained = statistics.median(
                    measure.time_calls(fn, len(sets), settle_s=0).median_us for _ in range(5))
                row: dict[str, Any] = {"workload": spec, "dtype": args.dtype,
                                       "contender": name, "sustained_us": sustained}
                for s in settles:
                    samples = []
                    for _ in range(args.repeats):
                        torch.cuda.synchronize()
                        time.sleep(args.gap)
                        samples.append(measure.time_calls(fn, len(sets), settle_s=s).median_us)
                    row[f"settle_{s:g}"] = {"median_us": statistics.median(samples),
                                            "ratio": statistics.median(samples) / sustained,
                                            "samples_us": samples}
                rows.append(row)
                print(f"{spec:22} {name:6} sustained {sustained:8.1f} us  " + "  ".join(
                    f"{s:g}s {row[f'settle_{s:g}']['ratio']:.3f}" for s in settles), flush=True)
    finally:
        if logger:
            logger.terminate()
    if args.json:
        method = (f"an idle gap of {args.gap:g} s, then measure.time_calls with the settling under "
                  f"test in place of SETTLE_S ({measure.WARMUP_CALLS} warm-up calls and that "
                  f"many seconds of calls untimed, median of {measure.REPS} CUDA-event timings, "
                  f"{measure.INPUTS}); the median of {args.repeats} such timings as a ratio to the "
                  f"sustained time: the median of five timings after {args.sustain:g} s of "
                  "continuous calls")
        args.json.write_text(json.dumps(header(
            **local_device(), method=method, gap_s=args.gap, sustain_s=args.sustain,
            repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()
