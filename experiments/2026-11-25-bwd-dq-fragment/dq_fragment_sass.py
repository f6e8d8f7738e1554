"""DQ_LAYOUT offline (NVRTC, sm_90a, no GPU): per timed point, registers, spills and the
shuffles (SHFL) and selects (FSEL, SEL) of the main kernel with staged dQ in row order and in
fragment order; with --base (a checkout of the commit before DQ_LAYOUT), whether "rows" builds
the same SASS as that commit, main and last kernel; with --all, every admitted "fragment"
point compiles with no spill.

    python experiments/2026-11-25-bwd-dq-fragment/dq_fragment_sass.py [--base DIR] [--all]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The timed bulk points (TIMED), the SASS reader and the base checkout's build of the ROWS_EARLY
# experiment: the same five points of benchmarks/train_step_points.json, here with DQ_LAYOUT
# each way.
_spec = importlib.util.spec_from_file_location(
    "rows_early_sass", ROOT / "experiments/2026-11-25-bwd-rows-early/rows_early_sass.py")
_rows_early = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_rows_early)  # type: ignore[union-attr]
TIMED, sass, base_cubins = _rows_early.TIMED, _rows_early.sass, _rows_early.base_cubins


def count(lines: list[str], op: str) -> int:
    return sum(ln.split()[0].split(".")[0] == op or (ln.startswith("@") and
               ln.split()[1].split(".")[0] == op) for ln in lines if ln.split())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="a checkout whose SASS 'rows' must equal")
    ap.add_argument("--all", action="store_true", help="compile every admitted fragment point")
    args = ap.parse_args()
    arch = get_arch("sm_90a")
    space = SearchSpace.load(ROOT / "search_spaces/wgmma_bwd.toml").with_untested()
    cands = [make_candidate(space, space.complete({**point, "DQ_LAYOUT": layout}), prob, arch)
             for prob, point in TIMED for layout in ("rows", "fragment")]
    results = list(compile_many(cands, arch))
    for cand, res in zip(cands, results, strict=True):
        main_sass = sass(res.cubin, "attn_bwd") if res.ok else []
        print(json.dumps({"identity": cand.identity, "ok": res.ok, "registers": res.registers,
                          "spill_stores": res.spill_stores, "spill_loads": res.spill_loads,
                          "SHFL": count(main_sass, "SHFL"), "FSEL": count(main_sass, "FSEL"),
                          "SEL": count(main_sass, "SEL"), "STS": count(main_sass, "STS"),
                          "sass_lines": len(main_sass), "error": res.error}))
    if args.base:
        olds = base_cubins(args.base, TIMED)
        rows = [r for c, r in zip(cands, results, strict=True)
                if c.params["DQ_LAYOUT"] == "rows"]
        for (prob, _), res, old in zip(TIMED, rows, olds, strict=True):
            same = {k: sass(res.cubin, k) == sass(old, k) for k in ("attn_bwd", "attn_bwd_post")}
            print(prob, "rows SASS identical to base:", same)
    if args.all:
        n = bad = 0
        for hd in (64, 128):
            for dtype in ("fp16", "bf16"):
                for causal in (False, True):
                    prob = {"HEAD_DIM": hd, "DTYPE": dtype, "CAUSAL": causal}
                    pts = [p for p in space.admitted(prob, arch) if p["DQ_LAYOUT"] == "fragment"]
                    cs = [make_candidate(space, p, prob, arch) for p in pts]
                    for c, r in zip(cs, compile_many(cs, arch), strict=True):
                        n += 1
                        if not r.ok or r.spill_bytes:
                            bad += 1
                            print("FAIL", c.identity, r.error, r.spill_bytes)
                    print(prob, len(pts), "fragment points compiled", flush=True)
        print(f"{n} admitted fragment points, {bad} failed or spilled")


if __name__ == "__main__":
    main()
