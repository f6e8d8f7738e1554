"""SASS report of compiled candidates: what the tensor cores, softmax and barriers cost.

    python benchmarks/sass_report.py --family wgmma --head-dim 128 --causal \
        --params '{"BLOCK_M": 128, "BLOCK_N": 128, ...}'
    python benchmarks/sass_report.py --results benchmarks/results/2026-11-22-h100-wgmma-smoke.json
    python benchmarks/sass_report.py --points benchmarks/wgmma_retime_points.json --json
    python benchmarks/sass_report.py --store sqlite:///runs/evoengine.db --elites
    python benchmarks/sass_report.py --family mma --params '{...}' --loop-path
    python benchmarks/sass_report.py --family decode --head-dim 128 --paged --params '{...}'

Compiles offline for sm_90a (NVRTC, no GPU), writes each cubin to a temporary file and
disassembles it with cuobjdump (from PATH, CUDA_HOME or the nvidia-cuda-cuobjdump wheel).
Per kernel: registers, spill bytes, dynamic shared memory, total instructions, HGMMA (the
wgmma tensor-core op; HMMA for mma.sync), LDL/STL (local memory, must be 0), MUFU.EX2,
BAR (named barriers) and SYNCS (mbarrier ops), and a histogram by opcode class. Loops that
hold a tensor-core instruction are reported on their own (static counts of the loop body,
every arm), which is where the per-key-block cost shows. --loop-path walks one pass of the
first such loop for the mma family instead (the counts quoted in docs/NOTES.md).
Points missing a parameter take the first value of its domain (its default).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import paths  # noqa: E402
from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many, cuobjdump_path, nvrtc_version  # noqa: E402
from evoengine.provenance import header  # noqa: E402
from evoengine.render import Candidate, make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

# Opcode classes of the histogram, matched by prefix in this order; the rest is "other".
CLASSES = ["HGMMA", "HMMA", "WARPGROUP", "LDSM", "STSM", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX",
           "FSEL", "F2FP", "SHFL", "BAR", "SYNCS", "UTMALDG", "LDL", "STL", "LDS", "STS", "STG",
           "R2UR", "BRA"]
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def find_cuobjdump() -> str:
    found = cuobjdump_path()
    if found is None:
        raise SystemExit("cuobjdump not found (PATH, CUDA_HOME or the nvidia-cuda-cuobjdump wheel)")
    return found


Instr = tuple[int, str, str, str]  # address, predicate, opcode with modifiers, operands


def disassemble(cubin: bytes) -> list[Instr]:
    """(address, predicate, opcode, operands) of every instruction of the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([find_cuobjdump(), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    return [(int(m[1], 16), (m[2] or "").strip(), m[3], m[4].strip())
            for m in LINE.finditer(text)]


def _class(op: str) -> str:
    return next((k for k in CLASSES if op.startswith(k)), "other")


def histogram(code: list[Instr]) -> dict[str, int]:
    c = Counter(_class(op) for _, _, op, _ in code if op != "NOP")
    return {"total": sum(c.values()), **{k: c[k] for k in CLASSES if c[k]}, "other": c["other"],
            "MUFU.EX2": sum(op == "MUFU.EX2" for _, _, op, _ in code)}


def _target(arg: str) -> int | None:
    m = re.match(r"`?\(?\.?L?_?x?_?(0x[0-9a-f]+)", arg)
    return int(m[1], 16) if m else None


def tensor_loops(code: list[Instr]) -> list[dict[str, object]]:
    """Every loop (backward branch) whose body holds a tensor-core op, innermost first:
    address range and the static counts of its body."""
    loops = []
    for addr, _, op, arg in code:
        if op != "BRA":
            continue
        target = _target(arg)
        if target is None or target >= addr:
            continue
        body = [c for c in code if target <= c[0] <= addr]
        if any(c[2].startswith(("HGMMA", "HMMA")) for c in body):
            loops.append({"from": hex(target), "to": hex(addr), **histogram(body)})
    return sorted(loops, key=lambda lp: lp["total"])  # type: ignore[arg-type, return-value]


def loop_path(code: list[Instr]) -> list[str]:
    """Opcodes along one pass of the first loop that holds an HMMA (mma family): a branch
    over a block with no else arm is not taken, an if/else takes its shorter arm, the branch
    after the lazy rescale vote is taken (no rescale)."""
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
            if voted:
                i, voted = target, False
                continue
            if before[2] == "BRA" and not before[1]:
                merge = at[int(before[3].split()[0], 16)]
                i = target if merge - target < target - i else i + 1
                continue
        elif op == "BRA":
            i = at[int(arg.split()[0], 16)]
            continue
        i += 1
    return path


# ---- which points -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    family: str
    params: dict
    problem: dict
    label: str = ""


def _space(family: str) -> SearchSpace:
    return SearchSpace.load(paths.SPACES / f"{family}.toml")


def complete(sp: SearchSpace, params: dict) -> dict:
    """A point from before a parameter existed gets the first value of its domain."""
    return {k: params.get(k, domain[0]) for k, domain in sp.parameters.items()}


def points_from_results(doc: dict, dtype: str | None) -> list[Point]:
    """Rows of a results JSON (compare.py's or wgmma_smoke.py's), one per distinct kernel."""
    out = []
    for row in doc.get("rows", []):
        if "workload" in row:  # wgmma_smoke.py
            w = row["workload"]
            family, head_dim, causal, dt = "wgmma", w["head_dim"], w["causal"], w["dtype"]
        else:  # compare.py
            family, head_dim, causal, dt = (row["family"], row["shape"][3], row["causal"],
                                            row["dtype"])
        problem = {"HEAD_DIM": head_dim, "DTYPE": dtype or dt, "CAUSAL": causal}
        out.append(Point(family, row["params"], problem, f"point {row.get('point', '')}"))
    return out


def points_from_points_file(doc: dict, family: str, dtype: str) -> list[Point]:
    """compare.py --points format: {"workloads": {"B,H,S,D[,causal]": [params, ...]}}."""
    out = []
    for key, plist in doc["workloads"].items():
        parts = key.split(",")
        problem = {"HEAD_DIM": int(parts[3]), "DTYPE": dtype, "CAUSAL": parts[-1] == "causal"}
        for i, p in enumerate(plist):
            out.append(Point(doc.get("family", family), p, problem, f"{key} #{i}"))
    return out


def points_from_store(url: str, identities: list[str], elites: bool) -> list[Point]:
    from evoengine.store import Store

    out = []
    with Store(url) as store:
        for ident in identities:
            rec = store.candidate(ident)
            if rec is None:
                raise SystemExit(f"no candidate {ident!r} in {url}")
            out.append(Point(rec.family, rec.params, rec.problem, ident))
        if elites:
            for e in store.elites(arch="sm_90a"):
                out.append(Point(e.family, e.params, e.problem, f"{e.workload_key} rank {e.rank}"))
    return out


def unique(points: list[Point]) -> list[Point]:
    seen, out = set(), []
    for p in points:
        key = json.dumps([p.family, p.params, p.problem], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# ---- the report -------------------------------------------------------------------------------


def report(points: list[Point], arch_name: str, with_path: bool, workers: int | None
           ) -> list[dict]:
    arch = get_arch(arch_name)
    cands: list[Candidate] = []
    rows: list[dict] = []
    admitted = []
    for p in points:
        sp = _space(p.family)
        params = complete(sp, p.params)
        bad = sp.violations(params, p.problem, arch)
        if bad:  # a point the space rejects (e.g. an option only causal problems take)
            rows.append({"label": p.label, "family": p.family, "problem": p.problem,
                         "params": params, "ok": False, "error": "rejected: " + "; ".join(bad)})
            continue
        admitted.append(p)
        cands.append(make_candidate(sp, params, p.problem, arch))
    for p, cand, r in zip(admitted, cands, compile_many(cands, arch, workers), strict=True):
        row: dict = {"label": p.label, "identity": cand.identity, "family": cand.family,
                     "problem": cand.problem, "params": cand.params, "ok": r.ok}
        if not r.ok or r.cubin is None:
            rows.append({**row, "error": r.error})
            continue
        code = disassemble(r.cubin)
        h = histogram(code)
        row.update({
            "registers": r.registers, "spill_bytes": r.spill_bytes, "stack_bytes": r.stack_bytes,
            "smem_bytes": r.smem_bytes, "instructions": h["total"],
            "HGMMA": h.get("HGMMA", 0), "HMMA": h.get("HMMA", 0),
            "LDL": h.get("LDL", 0), "STL": h.get("STL", 0), "MUFU.EX2": h["MUFU.EX2"],
            "BAR": h.get("BAR", 0), "SYNCS": h.get("SYNCS", 0), "histogram": h,
            "tensor_loops": tensor_loops(code),
        })
        if with_path:
            path = loop_path(code)
            row["loop_path"] = {"total": len(path), **Counter(_class(op) for op in path)}
        rows.append(row)
    return rows


def _short(params: dict) -> str:
    abbrev = {"BLOCK_M": "BM", "BLOCK_N": "BN", "STAGES": "S", "SWIZZLE": "SW"}
    return " ".join(f"{abbrev.get(k, k)}{'' if k in abbrev else '='}{v}"
                    for k, v in params.items())


def print_table(rows: list[dict]) -> None:
    print(f"{'problem':16} {'regs':>4} {'spill':>5} {'smem':>6} {'instr':>5} {'HGMMA':>5} "
          f"{'LDL/STL':>7} {'EX2':>4} {'BAR':>4} {'SYNCS':>5} {'hot loop':>8}  params")
    for r in rows:
        pr = r["problem"]
        flag = (("causal" if pr["CAUSAL"] else "full") if "CAUSAL" in pr
                else ("paged" if pr.get("PAGED") else "contig"))
        name = f"d{pr['HEAD_DIM']} {pr['DTYPE']} {flag}"
        if not r["ok"]:
            print(f"{name:16} ERROR {r['error']}  {_short(r['params'])}")
            continue
        loops = r["tensor_loops"]
        hot = "/".join(str(lp["total"]) for lp in loops) or "-"
        print(f"{name:16} {r['registers']:4d} {r['spill_bytes']:5d} {r['smem_bytes']:6d} "
              f"{r['instructions']:5d} {r['HGMMA'] or r['HMMA']:5d} "
              f"{r['LDL']:3d}/{r['STL']:<3d} {r['MUFU.EX2']:4d} {r['BAR']:4d} {r['SYNCS']:5d} "
              f"{hot:>8}  {_short(r['params'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="wgmma")
    ap.add_argument("--params", action="append", default=[], help="JSON of one parameter set")
    ap.add_argument("--head-dim", type=int, action="append", help="default: 64 and 128")
    ap.add_argument("--dtype", help="fp16 or bf16 (default fp16, or the results' own)")
    ap.add_argument("--causal", action="store_true", help="only causal (default: both)")
    ap.add_argument("--full", action="store_true", help="only non-causal (default: both)")
    ap.add_argument("--paged", action="store_true", help="decode: only a paged cache")
    ap.add_argument("--contiguous", action="store_true", help="decode: only a contiguous cache")
    ap.add_argument("--results", type=Path, action="append", default=[],
                    help="results JSON (rows of compare.py, retime.py or wgmma_smoke.py)")
    ap.add_argument("--points", type=Path, action="append", default=[],
                    help="compare.py --points file")
    ap.add_argument("--store", help="store URL, with --identity and/or --elites")
    ap.add_argument("--identity", action="append", default=[])
    ap.add_argument("--elites", action="store_true")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--loop-path", action="store_true",
                    help="also walk one pass of the first HMMA loop (mma family)")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = ap.parse_args()

    points: list[Point] = []
    # The family's boolean problem dimension: CAUSAL (the forward's kinds) or PAGED (decode).
    flag = "PAGED" if "PAGED" in _space(args.family).problem else "CAUSAL"
    if flag == "PAGED":
        values = [True] if args.paged else [False] if args.contiguous else [False, True]
    else:
        values = [True] if args.causal else [False] if args.full else [False, True]
    for text in args.params:
        for d in args.head_dim or [64, 128]:
            for v in values:
                points.append(Point(args.family, json.loads(text),
                                    {"HEAD_DIM": d, "DTYPE": args.dtype or "fp16", flag: v}))
    for f in args.results:
        points += points_from_results(json.loads(f.read_text()), args.dtype)
    for f in args.points:
        points += points_from_points_file(json.loads(f.read_text()), args.family,
                                          args.dtype or "fp16")
    if args.store:
        points += points_from_store(args.store, args.identity, args.elites)
    points = unique(points)
    if not points:
        ap.error("no points: give --params, --results, --points or --store")
    rows = report(points, args.arch, args.loop_path, args.workers)
    if args.json:
        method = (f"compiled offline with {nvrtc_version()} for {args.arch} (no GPU), "
                  "disassembled with cuobjdump; static instruction counts per kernel and per "
                  "loop that holds a tensor-core instruction")
        json.dump(header(device=None, driver=None, torch=None, method=method, arch=args.arch,
                         rows=rows), sys.stdout, indent=1)
        print()
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
