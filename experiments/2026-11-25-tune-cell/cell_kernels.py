"""Which of our forward kernels serve the Llama-3-8B tune's 256 rung's cell well (issue #17).

Times 9 wgmma points (the entries the tunes exported for 256..1024, and ping-pong/persistent
neighbours) next to SDPA cuDNN at b16 x 257..361 (where the check's 16 x 353 sits), 14 x 305,
64 x 256 (the rung itself) and smaller batches at 353, each shape as a search's final re-time
does (``GpuWorker.final``: inputs rotated past L2, graph replay under 15 GFLOP), 3 rounds.
Run on the GPU machine with the project on PYTHONPATH; writes ``$OUT/cell_kernels.json``.
Result: benchmarks/results/2026-11-25-h100-cell-kernels.json.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from evoengine.arch import get_arch
from evoengine.compile import compile_candidate
from evoengine.search.domain import Domain
from evoengine.search.worker import GpuWorker
from evoengine.space import default_spaces
from evoengine.workload import Workload

IDS = [  # identities without family, problem and hash
    "block_m128-block_n64-stages3-swizzle128-p_fromregs-intra_wg_overlap1-pingpong1-persistent1-"
    "tile_orderhead-schedulerdynamic",
    "block_m192-block_n64-stages4-swizzle128-p_fromregs-intra_wg_overlap1-pingpong0-persistent1-"
    "tile_orderhead-schedulerdynamic",
    "block_m192-block_n64-stages3-swizzle128-p_fromregs-intra_wg_overlap1-pingpong0-persistent1-"
    "tile_orderl2-schedulerdynamic",
    "block_m192-block_n64-stages3-swizzle128-p_fromregs-intra_wg_overlap1-pingpong0-persistent1-"
    "tile_orderhead-schedulerdynamic",
    "block_m128-block_n128-stages2-swizzle128-p_fromregs-intra_wg_overlap1-pingpong1-persistent1-"
    "tile_orderhead-schedulerdynamic",
    "block_m128-block_n128-stages2-swizzle128-p_fromregs-intra_wg_overlap1-pingpong1-persistent0-"
    "tile_orderhead-schedulerstatic",
    "block_m128-block_n64-stages3-swizzle128-p_fromregs-intra_wg_overlap1-pingpong1-persistent0-"
    "tile_orderhead-schedulerstatic",
    "block_m128-block_n128-stages2-swizzle128-p_fromsmem-intra_wg_overlap1-pingpong1-persistent1-"
    "tile_orderhead-schedulerdynamic",
    "block_m192-block_n128-stages2-swizzle128-p_fromsmem-intra_wg_overlap1-pingpong1-persistent1-"
    "tile_orderl2-schedulerdynamic",
]
SHAPES = [(16, 305), (16, 329), (16, 345), (16, 353), (16, 361), (14, 305), (64, 256), (8, 353),
          (4, 353), (16, 257)]
FLAGS = ("INTRA_WG_OVERLAP", "PINGPONG", "PERSISTENT")
WORDS = ("P_FROM", "TILE_ORDER", "SCHEDULER")


def params(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in re.findall(r"([a-z_]+?)(\d+|regs|smem|head|l2|dynamic|static)(?:-|$)",
                                  text):
        key = name.upper()
        out[key] = bool(int(value)) if key in FLAGS else value if key in WORDS else int(value)
    return out


def main() -> None:
    arch = get_arch("sm_90a")
    rows, entries = [], None
    for b, length in SHAPES:
        w = Workload(b, 32, length, 128, kv_heads=8, causal=True, dtype="bf16")
        if entries is None:
            domain = Domain(default_spaces("fwd"), w, arch)
            candidates = [domain.candidate("wgmma", params(i)) for i in IDS]
            with ProcessPoolExecutor(12) as pool:
                built = list(pool.map(compile_candidate, candidates, [arch] * len(candidates)))
            entries = list(zip(candidates, built, strict=True))
        timed = GpuWorker(w).final(entries, 3)
        cudnn = timed["cudnn"]
        ratios = [round(cudnn / t["median_us"], 3) if "median_us" in t else None
                  for t in timed["candidates"]]
        rows.append({"b": b, "L": length, "cudnn_us": cudnn, "vs_cudnn": ratios,
                     "ours_us": [t.get("median_us") for t in timed["candidates"]]})
        print(f"b{b:3d} L{length:5d} cudnn {cudnn:7.1f}  "
              + " ".join(f"{r:.3f}" if r else "  -  " for r in ratios), flush=True)
    with open(os.path.join(os.environ["OUT"], "cell_kernels.json"), "w") as f:
        json.dump({"ids": IDS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
