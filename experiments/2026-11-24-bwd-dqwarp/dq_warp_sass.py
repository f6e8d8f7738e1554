"""Compile every admitted DQ_WRITER = "warp" point of wgmma_bwd for sm_90a (NVRTC, no GPU) and
read its SASS: spills, stack, local memory, serialised wgmma, where the bulk dQ reduction
(UBLKRED) sits (the producer's code, after USETMAXREG.DEALLOC, or the consumers') and the
highest register each side uses.

    PYTHONPATH=$PWD python experiments/2026-11-24-bwd-dqwarp/dq_warp_sass.py --json out.json

A point passes with no spill, stack, LDL/STL or serialised wgmma, one UBLKRED in the producer's
code and none in the consumers', and producer registers within what setmaxnreg.dec leaves it
(24 with two consumer warpgroups, 56 with one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import paths  # noqa: E402
from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many, cuobjdump_path  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")
_REG = re.compile(r"\bR(\d+)\b")


def warp_points(space: SearchSpace) -> list[tuple[dict, dict]]:
    """Every (parameters, problem) the space admits on sm_90a with DQ_WRITER = "warp"."""
    target = get_arch("sm_90a")
    names = list(space.parameters)
    found = []
    for problem in space.problems():
        for values in itertools.product(*(space.parameters[n] for n in names)):
            params = dict(zip(names, values, strict=True))
            if params["DQ_WRITER"] == "warp" and not space.violations(params, problem, target):
                found.append((params, problem))
    return found


def read_sass(cubin: bytes) -> dict:
    """Counts and register high-water marks of attn_bwd's consumer and producer code."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(cuobjdump_path()), "-sass", "-fun", "attn_bwd", f.name],
                              capture_output=True, text=True, check=True).stdout
    instrs = _INSTR.findall(sass)
    cut = next(i for i, x in enumerate(instrs) if "USETMAXREG.DEALLOC" in x)
    consumers, producer = instrs[:cut], instrs[cut:]

    def regs(code: list[str]) -> int:
        return 1 + max((int(r) for x in code for r in _REG.findall(x)), default=-1)

    return {"consumer_regs": regs(consumers), "producer_regs": regs(producer),
            "consumer_ublkred": sum("UBLKRED" in x for x in consumers),
            "producer_ublkred": sum("UBLKRED" in x for x in producer),
            "local": sum(bool(re.match(r"(@!?P\w+\s+)?(LDL|STL)\b", x)) for x in instrs),
            "hgmma": sum("HGMMA" in x for x in instrs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="where to write the rows")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    space = SearchSpace.load(paths.SPACES / "wgmma_bwd.toml").with_untested()
    target = get_arch("sm_90a")
    points = warp_points(space)
    cands = [make_candidate(space, p, pr, target) for p, pr in points]
    rows, failed = [], 0
    for (params, problem), result in zip(points, compile_many(cands, target, args.workers),
                                         strict=True):
        row = {"problem": problem, "params": params, "ok": result.ok,
               "spill_bytes": result.spill_bytes, "stack_bytes": result.stack_bytes,
               "serialized": "serialized" in (result.log or ""), "error": result.error}
        if result.ok:
            row.update(read_sass(result.cubin or b""))
        kept = 24 if params["BLOCK_N"] == 128 else 56
        row["pass"] = bool(result.ok and not row["spill_bytes"] and not row["stack_bytes"]
                           and not row["serialized"] and not row["local"]
                           and row["producer_ublkred"] == 1 and row["consumer_ublkred"] == 0
                           and row["producer_regs"] <= kept)
        failed += not row["pass"]
        rows.append(row)
    args.json.write_text(json.dumps({"points": len(rows), "failed": failed, "rows": rows},
                                    indent=1) + "\n")
    print(f"{len(rows)} warp points, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
