"""Count the SASS instructions of one pass through an mma candidate's first key-block loop.

    python benchmarks/sass_counts.py --head-dim 64 --params '{"BLOCK_M": 128, ...}'

Compiles offline (NVRTC, no GPU), disassembles with cuobjdump and walks one path through
the first loop (the unmasked one when the problem has full blocks): a branch over a block
with no else arm is not taken (loads are issued), an if/else takes its shorter arm (no
key-tail row checks), the branch after the lazy rescale vote is taken (no rescale). Counts
are per thread, by opcode class, as in docs/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import paths  # noqa: E402
from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_candidate  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

CLASSES = ["HMMA", "LDSM", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP"]
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def disassemble(cubin: bytes) -> list[tuple[int, str, str, str]]:
    """(address, predicate, opcode, operands) of every instruction."""
    tool = shutil.which("cuobjdump") or str(next(Path(sys.prefix).glob(
        "lib/python*/site-packages/nvidia/cu*/bin/cuobjdump")))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m[1], 16), (m[2] or "").strip(), m[3], m[4].strip())
            for m in LINE.finditer(text)]


def loop_path(code: list[tuple[int, str, str, str]]) -> list[str]:
    """Opcodes along one pass of the first loop that contains a tensor-core instruction."""
    at = {addr: i for i, (addr, *_) in enumerate(code)}
    first_mma = next(i for i, c in enumerate(code) if c[2].startswith("HMMA"))
    end = next(i for i, (_, _, op, arg) in enumerate(code) if i > first_mma and
               op == "BRA" and int(arg.split()[0], 16) < code[first_mma][0])
    i, path, voted = at[int(code[end][3].split()[0], 16)], [], False
    while i < end:
        _, pred, op, arg = code[i]
        path.append(op)
        if op.startswith("VOTE"):
            voted = True
        if op == "BRA" and pred:
            target = at[int(arg.split()[0], 16)]
            before = code[target - 1]
            if voted:  # the rescale branch: skip the rescale
                i, voted = target, False
                continue
            if before[2] == "BRA" and not before[1]:  # if/else: take the shorter arm
                merge = at[int(before[3].split()[0], 16)]
                i = target if merge - target < target - i else i + 1
                continue
        elif op == "BRA":
            i = at[int(arg.split()[0], 16)]
            continue
        i += 1
    return path


def counts(path: list[str]) -> dict[str, int]:
    c = Counter(next((k for k in CLASSES if op.startswith(k)), "other") for op in path)
    return {"total": len(path), **{k: c[k] for k in CLASSES}, "other": c["other"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", required=True, help="JSON of the search parameters")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    space = SearchSpace.load(paths.SPACES / "mma.toml")
    problem = {"HEAD_DIM": args.head_dim, "DTYPE": args.dtype, "CAUSAL": args.causal}
    cand = make_candidate(space, json.loads(args.params), problem, get_arch(args.arch))
    result = compile_candidate(cand, args.arch)
    if not result.ok or result.cubin is None:
        sys.exit(f"compile failed: {result.error}")
    row = {"regs": result.registers, "spill": result.spill_bytes,
           **counts(loop_path(disassemble(result.cubin)))}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
