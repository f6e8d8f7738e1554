"""PACK_GQA offline (NVRTC, sm_90a, no GPU): a seeded sample of admitted wgmma points (4 per
default problem, 4 per ragged d64 and d128 causal problem), each built unpacked and packed.
Reports the builds that spill (spill or stack bytes) and, with --base (a checkout of the commit
before PACK_GQA), whether every unpacked build's SASS is the base checkout's, instruction by
instruction.

    git worktree add /tmp/evo-85fb2a6 85fb2a6
    python experiments/2026-11-25-wgmma-pack-gqa/pack_sass.py --base /tmp/evo-85fb2a6
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"),
                str(ROOT / "experiments" / "2026-11-25-wgmma-softmax")]

from sass_report import disassemble  # noqa: E402
from softmax_sass import base_sass  # noqa: E402  (the base checkout's wgmma builds)

from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

RAGGED = [{"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": True, "VARLEN": True},
          {"HEAD_DIM": 64, "DTYPE": "bf16", "CAUSAL": True, "VARLEN": True}]


def sample(space: SearchSpace, arch) -> list[tuple[dict, dict]]:
    rng = random.Random(5)
    out = []
    for problem in [*space.problems(), *RAGGED]:
        admitted = space.admitted(problem, arch)
        for p in rng.sample(admitted, min(4, len(admitted))):
            out.append((problem, {k: v for k, v in p.items() if k != "PACK_GQA"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="a checkout of the commit before PACK_GQA")
    args = ap.parse_args()
    arch = get_arch("sm_90a")
    space = SearchSpace.load(ROOT / "search_spaces/wgmma.toml").with_untested()
    points = sample(space, arch)
    cands = [make_candidate(space, {**p, "PACK_GQA": pack}, problem, arch)
             for problem, p in points for pack in (False, True)]
    built = list(compile_many(cands, arch))
    old = base_sass(args.base, points) if args.base else None
    same = 0
    for i, (c, r) in enumerate(zip(cands, built, strict=True)):
        assert r.ok, (c.identity, r.error)
        if r.spill_bytes or r.stack_bytes:
            print(f"spills {r.spill_bytes} B, stack {r.stack_bytes} B: {c.identity}")
        if old is not None and not c.params["PACK_GQA"]:
            if [x[2] + " " + x[3] for x in disassemble(r.cubin)] == old[i // 2]:
                same += 1
            else:
                print(f"SASS differs from the base: {c.identity}")
    print(f"{len(points)} points, each unpacked and packed"
          + (f"; unpacked SASS identical to the base: {same} of {len(points)}" if old else ""))


if __name__ == "__main__":
    main()
