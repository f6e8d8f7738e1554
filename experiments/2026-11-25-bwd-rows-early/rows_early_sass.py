"""ROWS_EARLY offline (NVRTC, sm_90a, no GPU): every admitted wgmma_bwd point with ROWS_EARLY
true compiles with no spill; per timed point, registers and where the lse/delta LDS sit
relative to the first WARPGROUP.DEPBAR of the step; with ROWS_EARLY false the SASS is the
same as the commit given (--base, a git worktree of it) builds.

    python experiments/2026-11-25-bwd-rows-early/rows_early_sass.py [--base /path/to/main]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many, cuobjdump_path  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMED = [  # (problem, point): the timed tma points of benchmarks/train_step_points.json
    ({"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": False},
     dict(BLOCK_N=128, BLOCK_M=64, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic", DQ_REDUCE="bulk",
          REFILL="top", LOADER="tma")),
    ({"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True},
     dict(BLOCK_N=128, BLOCK_M=64, STAGES=3, SWIZZLE=128, DQ_ACCUM="atomic", DQ_REDUCE="bulk",
          REFILL="top", LOADER="tma", DQ_WRITER="warp")),
    ({"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_N=128, BLOCK_M=64, STAGES=1, SWIZZLE=128, DQ_ACCUM="atomic", DQ_REDUCE="bulk",
          REFILL="dq", LOADER="cp_async")),
    ({"HEAD_DIM": 64, "DTYPE": "bf16", "CAUSAL": False},
     dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=64, DQ_ACCUM="atomic", DQ_REDUCE="bulk",
          REFILL="top", LOADER="tma")),
    ({"HEAD_DIM": 64, "DTYPE": "bf16", "CAUSAL": True},
     dict(BLOCK_N=128, BLOCK_M=128, STAGES=2, SWIZZLE=128, DQ_ACCUM="atomic", DQ_REDUCE="bulk",
          REFILL="dq", LOADER="cp_async")),
]


def sass(cubin: bytes, fun: str | None = None) -> list[str]:
    """The SASS lines of a cubin, or of its kernel ``fun``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "-sass", *(("-fun", fun) if fun else ()), f.name],
                             capture_output=True, text=True, check=True).stdout
    return [ln.split("*/")[1].strip() if "*/" in ln else ln.strip()
            for ln in out.splitlines() if "/*" in ln and ";" in ln]


def base_cubins(base: Path, points: list) -> list[bytes]:
    """The cubins the checkout ``base`` builds for (problem, point) ``points`` of wgmma_bwd,
    compiled by that checkout's own evoengine in a child process."""
    out = subprocess.run(
        [sys.executable, "-c", (
            "import sys, json; sys.path.insert(0, sys.argv[1]);"
            "from evoengine.arch import get_arch; from evoengine.compile import compile_many;"
            "from evoengine.render import make_candidate; from evoengine.space import "
            "SearchSpace; from pathlib import Path;"
            "a = get_arch('sm_90a'); s = SearchSpace.load(Path(sys.argv[1]) / "
            "'search_spaces/wgmma_bwd.toml').with_untested();"
            "pts = json.loads(sys.argv[2]);"
            "cs = [make_candidate(s, s.complete(p), pr, a) for pr, p in pts];"
            "sys.stdout.buffer.write(b''.join(len(r.cubin).to_bytes(8, 'little') + r.cubin"
            " for r in compile_many(cs, a)))"), str(base), json.dumps(points)],
        capture_output=True, check=True, cwd=base).stdout
    cubins, i = [], 0
    while i < len(out):
        n = int.from_bytes(out[i:i + 8], "little")
        cubins.append(out[i + 8:i + 8 + n])
        i += 8 + n
    return cubins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="a checkout whose legacy SASS to compare")
    args = ap.parse_args()
    arch = get_arch("sm_90a")
    space = SearchSpace.load(ROOT / "search_spaces/wgmma_bwd.toml").with_untested()
    report = []
    cands = []
    for prob, point in TIMED:
        for early in (False, True)[:2 if point["BLOCK_M"] == 64 else 1]:
            cands.append(make_candidate(space, space.complete({**point, "ROWS_EARLY": early}),
                                        prob, arch))
    for cand, res in zip(cands, compile_many(cands, arch), strict=True):
        lines = sass(res.cubin) if res.ok else []
        first_wait = next((i for i, ln in enumerate(lines) if "WARPGROUP.DEPBAR" in ln), -1)
        lds_before = sum("LDS" in ln for ln in lines[:first_wait]) if first_wait > 0 else None
        report.append({"identity": cand.identity, "ok": res.ok, "registers": res.registers,
                       "spill_stores": res.spill_stores, "spill_loads": res.spill_loads,
                       "stack": res.stack_bytes, "sass_lines": len(lines),
                       "lds_before_first_wgmma_wait": lds_before, "error": res.error})
        print(json.dumps(report[-1]))
    if args.base:
        cubins = base_cubins(args.base, TIMED)
        olds = [c for c in cands if not c.params["ROWS_EARLY"]]
        legacy = list(zip(olds, compile_many(olds, arch), strict=True))
        for (cand, res), old in zip(legacy, cubins, strict=True):
            print(cand.identity, "legacy SASS identical:", sass(res.cubin) == sass(old))

if __name__ == "__main__":
    main()
