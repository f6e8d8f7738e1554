"""Run one point (or an SDPA backend) on one workload, for a profiler to attach to.

    ncu --clock-control none -k regex:attn_fwd -s 20 -c 1 --section ... \
        python benchmarks/profile_point.py 8,16,4096,128 --family wgmma --params '{...}'
    python benchmarks/profile_point.py 8,16,4096,128 --sdpa cudnn
    python benchmarks/profile_point.py 16,16,2048,64 --fa4     # FlashAttention-4's forward
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import measure  # noqa: E402
from evoengine.workload import Workload  # noqa: E402


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", metavar="B,H,S,D[,causal]")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--family", default="wgmma")
    ap.add_argument("--params", type=json.loads, help="the point, as JSON")
    ap.add_argument("--sdpa", choices=measure.SDPA_BACKENDS)
    ap.add_argument("--fa4", action="store_true", help="FlashAttention-4's forward (where it "
                    "imports; its first call compiles, so skip that launch in the profiler)")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    w = Workload.parse_spec(args.workload, dtype=args.dtype)
    sets = measure.workload_inputs(w)
    if args.sdpa:
        call, scope = measure.sdpa_call(w, sets), measure.sdpa_backend(args.sdpa)
    elif args.fa4:
        fn = measure.fa4_attention()
        if fn is None:
            raise SystemExit("profile_point: flash_attn.cute does not import")

        def call(i: int) -> None:
            q, k, v = (x.transpose(1, 2) for x in sets[i][:3])
            fn(q, k, v, causal=w.causal)
        scope = contextlib.nullcontext()
    else:
        from evoengine.arch import arch_of_capability
        from evoengine.runtime import Kernel
        from evoengine.search.domain import Domain
        from evoengine.space import default_spaces

        arch = arch_of_capability(*torch.cuda.get_device_capability())
        cand = Domain(default_spaces(), w, arch).candidate(args.family, args.params)
        call = measure.kernel_call(Kernel.build(cand, arch), sets, 1.0 / math.sqrt(w.head_dim))
        scope = contextlib.nullcontext()
    with scope:
        for i in range(args.calls):
            call(i % len(sets))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
