"""The decode criterion on the page-staging points over every page size the issue names.

    EVOENGINE_HOME=/tmp/alt python experiments/2026-11-28-decode-page-staging/check.py

Run in a copy of the tree with ``page-staging.patch`` applied (README.md says how). Each point
of ``points.json`` whose space admits it is built for a paged cache and passes
``Problem.check`` (``validate.decode_plan``: ragged lengths 0, fewer than q_len, odd and prime
ones, pages shuffled, NaN past every sequence) at page sizes 16 to 256, q_len 1 and 4, GQA
32/8, fp16 and bf16. Prints one line per case and exits 1 on the first refusal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    from evoengine import paths
    from evoengine.arch import arch_of_capability
    from evoengine.decode import DecodeKernel
    from evoengine.problems.decode import Decode, DecodeWorkload
    from evoengine.render import make_candidate
    from evoengine.space import SearchSpace

    arch = arch_of_capability(*torch.cuda.get_device_capability())
    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()
    problem = Decode()
    points = json.loads((Path(__file__).parent / "points.json").read_text())
    failed = 0
    for p in points:
        for dtype in ("fp16", "bf16"):
            for page in (16, 32, 64, 128, 256):
                for q_len in (1, 4):
                    w = DecodeWorkload(batch=3, q_len=q_len, q_heads=32, kv_heads=8,
                                       head_dim=128, cache_len=4096, layout="paged",
                                       page_size=page, dtype=dtype)
                    params = space.complete(p)
                    if space.violations(params, w.problem(), arch):
                        continue
                    kernel = DecodeKernel.build(
                        make_candidate(space, params, w.problem(), arch), arch)
                    verdict = problem.check(kernel, w)
                    print(f"{p['PAGE_STAGING']:4} n{p['BLOCK_N']} w{p['NUM_WARPS']} "
                          f"s{p['STAGES']} {dtype} page {page:3d} q_len {q_len}: "
                          f"{'ok' if verdict.ok else verdict.reason}", flush=True)
                    failed += not verdict.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
