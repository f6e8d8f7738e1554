"""Host time of an eager call of two exported modules, before and after a launch-path change
(issue #17: the memoised checks and the memset tile counter of commit d470f69).

    python eager_host_ab.py BEFORE.py AFTER.py   # writes $OUT/hostab.json

For each shape (Llama-3-8B geometry, bf16, causal), 3 rounds interleaved with SDPA cuDNN:
``host_us``, the wall time of 400 back-to-back calls without synchronising, over 400 (after 30
warm-up calls); ``eager_us``, ``measure.time_calls(graph=False)`` (events around each call, no
synchronisation between calls, so a call whose host time exceeds the previous call's GPU time
is timed with the gap); ``graph_us``, ``measure.time_calls(graph=True)``. The two modules come
from separate tunes, so their kernels may differ: host time is the launch path's.
Result: benchmarks/results/2026-11-25-h100-eager-host-path.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from evoengine import measure
from evoengine.export import import_module_file

SHAPES = ((16, 353), (13, 434), (16, 305), (1, 385), (8, 1501))



def host(fn: Callable[[], object], n: int = 400) -> float:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    took = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return took


def time_shape(modules: dict[str, ModuleType], b: int, length: int) -> dict[str, object]:
    q = torch.randn(b, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def sdpa(i: int) -> object:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    calls = {name: (lambda i, m=m: m.attention(q, k, v, causal=True))
             for name, m in modules.items()}
    samples: dict[str, list[float]] = {}
    for _ in range(3):
        for name, call in calls.items():
            samples.setdefault(f"{name}_host_us", []).append(host(lambda c=call: c(0)))
            samples.setdefault(f"{name}_eager_us", []).append(
                measure.time_calls(call, 1, graph=False).median_us)
            samples.setdefault(f"{name}_graph_us", []).append(
                measure.time_calls(call, 1, graph=True).median_us)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            samples.setdefault("cudnn_host_us", []).append(host(lambda: sdpa(0)))
            samples.setdefault("cudnn_eager_us", []).append(
                measure.time_calls(sdpa, 1, graph=False).median_us)
    return {"shape": [b, 32, length, 128], "kv_heads": 8, "causal": True, "dtype": "bf16",
            **{key: round(statistics.median(vals), 2) for key, vals in samples.items()}}


def main() -> None:
    modules = {"before": import_module_file(sys.argv[1], "before_mod"),
               "after": import_module_file(sys.argv[2], "after_mod")}
    rows = []
    for b, length in SHAPES:
        rows.append(time_shape(modules, b, length))
        print(rows[-1], flush=True)
    with open(os.path.join(os.environ["OUT"], "hostab.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
