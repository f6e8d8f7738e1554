"""Fill the compile cache with tests/gpu/test_decode.py's hand-picked kernels in one parallel
batch (the tests build them group by group, 4 at a time):
    python experiments/2026-11-27-decode-timeline/precompile.py"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine.compile import compile_many  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import gpu_arch  # noqa: E402
from tests.gpu.test_decode import POINTS, space  # noqa: E402

# (MERGE, COMBINE, COMBINE_ITEMS, CLUSTER, one wave) of the file's kernels() calls
VARIANTS = [("slices", "kernel", 1, 1, False), ("atomic", "kernel", 1, 1, False),
            ("slices", "fused", 1, 1, False), ("slices", "fused", 2, 1, False),
            ("slices", "fused", 4, 1, False)]
VARIANTS += [("slices", c, i, cl, False) for cl in (2, 8)
             for c, i in (("kernel", 1), ("fused", 4))]
VARIANTS += [("slices", c, 1, 1, True) for c in ("kernel", "cooperative")]


def main() -> None:  # guarded: compile_many's workers are spawned and import this file
    arch = gpu_arch()
    cands = []
    for head_dim, dtype, paged, (merge, combine, items, cluster, wave) in itertools.product(
            (128, 64), ("fp16", "bf16"), (True, False), VARIANTS):
        if cluster > 1 and arch.sm < 90:
            continue
        problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, PAGED=paged)
        for p in POINTS:
            p = dict(p, MERGE=merge, COMBINE=combine, COMBINE_ITEMS=items, CLUSTER=cluster)
            if wave:
                p = dict(p, SPLIT_POLICY="waves", SPLITS=1)
            if not space().violations(p, problem, arch):
                cands.append(make_candidate(space(), p, problem, arch))
    bad = [c.identity for c, r in zip(cands, compile_many(cands, arch), strict=True) if not r.ok]
    print(f"{len(cands)} compiled, {len(bad)} failed", *bad, sep="\n")


if __name__ == "__main__":
    main()
