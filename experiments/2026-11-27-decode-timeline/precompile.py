"""Fill the compile cache with the cluster GPU tests' kernels in one parallel batch (the tests
build them group by group): python experiments/2026-11-27-decode-timeline/precompile.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine.compile import compile_many  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import gpu_arch  # noqa: E402
from tests.gpu.test_decode import POINTS, space  # noqa: E402

arch = gpu_arch()
cands = []
for head_dim in (128, 64):
    for dtype in ("fp16", "bf16"):
        for paged in (True, False):
            for cluster in (2, 8):
                for combine, items in (("kernel", 1), ("fused", 4)):
                    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, PAGED=paged)
                    for p in POINTS:
                        p = dict(p, MERGE="slices", COMBINE=combine, COMBINE_ITEMS=items,
                                 CLUSTER=cluster)
                        if not space().violations(p, problem, arch):
                            cands.append(make_candidate(space(), p, problem, arch))
bad = [c.identity for c, r in zip(cands, compile_many(cands, arch), strict=True) if not r.ok]
print(f"{len(cands)} compiled, {len(bad)} failed", *bad, sep="\n")
