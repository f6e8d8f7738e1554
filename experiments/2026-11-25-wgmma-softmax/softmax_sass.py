"""LAZY_RESCALE and PIN_PV_WAIT offline (NVRTC, sm_90a, no GPU): the winners of the FA4
re-time (benchmarks/results/2026-11-24-h100-wgmma-retime-fa4.json), each built with both
parameters off and on: registers, spills, the static opcode counts of the unmasked key loop
(the first loop that issues HGMMA), and where in that loop the wait for the previous block's
P.V sits (instruction index) against the first and last exponential. With --base (a checkout
of the commit before both) the builds with both off are compared with what that checkout
builds, instruction by instruction.

Both parameters were measured on the H100 and dropped (docs/NOTES.md, "Lazy rescale and the
P.V wait"), so the script builds from a checkout of 232e83c, the commit that has them:

    git worktree add /tmp/evo-232e83c 232e83c
    git worktree add /tmp/evo-68037a7 68037a7
    python experiments/2026-11-25-wgmma-softmax/softmax_sass.py --tree /tmp/evo-232e83c \
        [--base /tmp/evo-68037a7]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results/2026-11-24-h100-wgmma-retime-fa4.json"
KEYS = ["FMUL", "MUFU", "FADD", "BRA"]
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (lazy, pin)


def winners() -> list[tuple[dict, dict]]:
    rows = json.loads(RESULTS.read_text())["rows"]
    return [({"HEAD_DIM": r["shape"][3], "DTYPE": r["dtype"], "CAUSAL": r["causal"]}, r["params"])
            for r in rows]


def base_sass(base: Path, points: list) -> list[list[str]]:
    """Each (problem, point)'s SASS text as checkout ``base`` builds it (its own evoengine)."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "
        "'/benchmarks'); from sass_report import disassemble; from evoengine.arch import "
        "get_arch; from evoengine.compile import compile_many; from evoengine.render import "
        "make_candidate; from evoengine.space import SearchSpace; from pathlib import Path;"
        "a = get_arch('sm_90a'); s = SearchSpace.load(Path(sys.argv[1]) / "
        "'search_spaces/wgmma.toml'); pts = json.loads(sys.argv[2]);"
        "cs = [make_candidate(s, s.complete(p), pr, a) for pr, p in pts];"
        "print(json.dumps([[i[2] + ' ' + i[3] for i in disassemble(r.cubin)] "
        "for r in compile_many(cs, a)]))")
    out = subprocess.run([sys.executable, "-c", code, str(base), json.dumps(points)],
                         capture_output=True, text=True, check=True, cwd=base).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="a checkout of 232e83c")
    ap.add_argument("--base", type=Path, help="a checkout of the commit before both (68037a7)")
    args = ap.parse_args()
    sys.path[:0] = [str(args.tree), str(args.tree / "benchmarks")]
    from sass_report import disassemble, tensor_loops

    from evoengine.arch import get_arch
    from evoengine.compile import compile_many
    from evoengine.render import make_candidate
    from evoengine.space import SearchSpace

    arch = get_arch("sm_90a")
    space = SearchSpace.load(args.tree / "search_spaces/wgmma.toml")
    pts = winners()
    cands = [make_candidate(space, {**p, "LAZY_RESCALE": lazy, "PIN_PV_WAIT": pin}, pr, arch)
             for pr, p in pts for lazy, pin in VARIANTS]
    results = compile_many(cands, arch)
    old = base_sass(args.base, pts) if args.base else None
    print(f"{'workload':<20} {'rescale':<7} {'pin':<4} {'regs':>4} {'spill':>5} {'loop':>5} "
          + " ".join(f"{k:>5}" for k in KEYS) + "  P.V wait  exps     "
          + ("  same as base" if old else ""))
    for i, (c, r) in enumerate(zip(cands, results, strict=True)):
        assert r.ok, (c.identity, r.error)
        code = disassemble(r.cubin)
        loop = tensor_loops(code)
        body = [lp for lp in loop if lp.get("HGMMA")][0]
        lo, hi = int(str(body["from"]), 16), int(str(body["to"]), 16)
        ops = [x[2] for x in code if lo <= x[0] <= hi]
        wait = [k for k, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR")]
        exps = [k for k, op in enumerate(ops) if op.startswith("MUFU.EX2")]
        pr = pts[i // len(VARIANTS)][0]
        name = f"d{pr['HEAD_DIM']} {pr['DTYPE']} {'causal' if pr['CAUSAL'] else 'full'}"
        lazy, pin = c.params["LAZY_RESCALE"], c.params["PIN_PV_WAIT"]
        same = ""
        if old and not lazy and not pin:
            same = ("  yes" if [x[2] + " " + x[3] for x in code] == old[i // len(VARIANTS)]
                    else "  NO")
        print(f"{name:<20} {'lazy' if lazy else 'eager':<7} {'yes' if pin else 'no':<4} "
              f"{r.registers:>4} {r.spill_bytes:>5} {body['total']:>5} "
              + " ".join(f"{body.get(k, 0):>5}" for k in KEYS)
              + f"  {wait[-1] if wait else '-':>8}  {exps[0]}..{exps[-1]}" + same)


if __name__ == "__main__":
    main()
