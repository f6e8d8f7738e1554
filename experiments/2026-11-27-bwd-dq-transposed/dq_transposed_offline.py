"""DQ_TRANSPOSED offline (NVRTC, sm_90a, no GPU): every admitted transposed point of a problem
compiles with no spill, stack or serialised wgmma (registers at most, and the HGMMA shapes of
one point); the staged-dQ^T map of the template and of attn_bwd_post agree and are bank-
conflict free (a model of both, in Python); with --base (a checkout of the commit before the
parameter), the untransposed points build the SASS of that commit.

    python experiments/2026-11-27-bwd-dq-transposed/dq_transposed_offline.py \
        [--problem 128,bf16,0] [--block-m 80] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import paths  # noqa: E402
from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many, cuobjdump_path  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

TARGET = get_arch("sm_90a")


def staged_map_agrees(head_dim: int, wgs: int, block_m: int) -> bool:
    """The template's stage_dqt addresses against attn_bwd_post's reads (DQACC_TRANSPOSED),
    for every value of a step's dQ^T (wgmma's m64nN accumulator: thread row 16 warp + lane / 4
    + 8 r, column 8 i + 2 (lane % 4) + e, register 4 i + 2 r + e); and each half-warp's
    8-byte stores (one phase of the store each) fall on distinct bank pairs (2 wavefronts for
    the warp's 256 bytes)."""
    rows = head_dim // wgs
    staged: dict[int, tuple[int, int]] = {}
    conflict_free = True
    for wg in range(wgs):
        for warp in range(4):
            for mt in range(rows // 64):
                for i in range(block_m // 8):
                    for e in range(2):
                        words = []
                        for lane in range(32):
                            c = lane & 3
                            at = ((2 * c + 8 * i + e) * head_dim
                                  + ((rows * wg + 64 * mt + 16 * warp) ^ (16 * (c & 1)))
                                  + ((2 * (lane >> 2)) ^ (8 * (c >> 1))))
                            words.append(at)
                            for r in range(2):
                                d = rows * wg + 64 * mt + 16 * warp + (lane >> 2) + 8 * r
                                assert at + r not in staged
                                staged[at + r] = (8 * i + 2 * c + e, d)
                        for half in (words[:16], words[16:]):
                            pairs = Counter((w % 32) // 2 for w in half)
                            conflict_free &= max(pairs.values()) == 1
    assert len(staged) == block_m * head_dim
    for pos, (q, d) in staged.items():
        read = (q * head_dim + 16 * ((d // 16) ^ ((q >> 1) & 1))
                + ((2 * (d % 8) + d // 8 % 2) ^ (8 * ((q >> 2) & 1))))
        assert read == pos, (pos, q, d, read)
    return conflict_free


def sass_of(cubin: bytes) -> str:
    tool = cuobjdump_path()
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout
    return re.sub(r"/\*[0-9a-f]+\*/", "", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problem", default="128,bf16,0", help="HEAD_DIM,DTYPE,CAUSAL")
    ap.add_argument("--block-m", type=int, default=80)
    ap.add_argument("--base", type=Path, help="checkout of the commit before DQ_TRANSPOSED")
    args = ap.parse_args()
    d, t, c = args.problem.split(",")
    problem = {"HEAD_DIM": int(d), "DTYPE": t, "CAUSAL": c == "1"}
    for shape in ((128, 2, 80), (128, 2, 64), (128, 1, 64), (64, 1, 80), (64, 1, 96)):
        print("map", shape, "agrees; conflict-free:", staged_map_agrees(*shape))

    space = SearchSpace.load(paths.SPACES / "wgmma_bwd.toml").with_untested()
    points = [p for p in space.admitted(problem, TARGET)
              if p["DQ_TRANSPOSED"] and p["BLOCK_M"] == args.block_m]
    cands = [make_candidate(space, p, problem, TARGET) for p in points]
    bad, regs = [], []
    for cand, r in zip(cands, compile_many(cands, TARGET), strict=True):
        if not r.ok or r.spill_bytes or r.stack_bytes or "serialized" in r.log:
            bad.append(cand.identity)
        regs.append(r.registers)
    print(json.dumps({"problem": problem, "block_m": args.block_m, "points": len(points),
                      "bad": bad, "registers_at_launch": sorted(set(regs))}))
    if cands:
        (r,) = compile_many(cands[:1], TARGET)
        print(cands[0].identity, Counter(re.findall(r"HGMMA\.\w+", sass_of(r.cubin or b""))))

    if args.base is not None:  # untransposed points: the SASS of the base commit
        shipped = SearchSpace.load(paths.SPACES / "wgmma_bwd.toml")
        sample = shipped.admitted(problem, TARGET)
        random.Random(0).shuffle(sample)
        sample = sample[:6]
        code = ("import json, sys; from evoengine import paths; from evoengine.arch import "
                "get_arch; from evoengine.compile import compile_many; from evoengine.render "
                "import make_candidate; from evoengine.space import SearchSpace; "
                "sp = SearchSpace.load(paths.SPACES / 'wgmma_bwd.toml'); t = get_arch('sm_90a');"
                " pr, pts = json.load(sys.stdin); cs = [make_candidate(sp, p, pr, t) for p in "
                "pts]; sys.stdout.buffer.write(b''.join(r.cubin.hex().encode() + b'\\n' for r "
                "in compile_many(cs, t)))")
        old = [p for p in ({k: v for k, v in p.items() if k != "DQ_TRANSPOSED"}
                           for p in sample)]
        env = {**os.environ, "PYTHONPATH": str(args.base),
               "EVOENGINE_CACHE": tempfile.mkdtemp()}
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps([problem, old]),
                              capture_output=True, text=True, check=True, cwd=args.base,
                              env=env)
        theirs = [bytes.fromhex(h) for h in done.stdout.split()]
        ours = compile_many([make_candidate(shipped, p, problem, TARGET) for p in sample],
                            TARGET)
        same = [sass_of(a) == sass_of(b.cubin or b"") for a, b in zip(theirs, ours, strict=True)]
        print("untransposed points with the base commit's SASS:", sum(same), "of", len(same))


if __name__ == "__main__":
    main()
