"""Smoke test of the wgmma family on a Hopper GPU: correctness, then timings against SDPA.

    python experiments/2026-11-22-wgmma-smoke/wgmma_smoke.py      # the default points, ~3 minutes
    python experiments/2026-11-22-wgmma-smoke/wgmma_smoke.py --points '[{"BLOCK_M": 128, ...}]' \
        --json out.json

The parent process never touches the GPU: it compiles every candidate offline (NVRTC, in
parallel, into the shared cache), then runs each parameter point in a child process with a
timeout, so a kernel that deadlocks (its mbarrier watchdog traps after 2 s) or faults costs
that point only. Each child checks the point on every problem it is admitted for (fp16 and
bf16, head dim 64 and 128, causal and not) over tails, GQA/MQA, strided views, Sq != Sk,
more tiles than SMs and a negative scale with the project's criterion
(evoengine.validate.check), then times it on the fp16 workloads of its head dims with
evoengine.measure. A last child times SDPA's flash and cuDNN backends on the same workloads.
The table goes to stdout; the JSON document to --json, or to $OUT/wgmma_smoke.json when $OUT
is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from evoengine import measure, paths  # noqa: E402
from evoengine.arch import get_arch  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

ARCH = get_arch("sm_90a")
# FlashAttention-3's shapes and some neighbours: (2 consumers, 128 x 128), (2 consumers,
# 128 x 176, ping-pong) for d128, (3 consumers, 192 x 128) for d64, and two covering the
# other options (P through shared memory, no overlap, 64/32-byte swizzle, persistent,
# three-way turns).
DEFAULT_POINTS = [
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs", INTRA_WG_OVERLAP=True,
         PINGPONG=False, PERSISTENT=False, TILE_ORDER="head", SCHEDULER="static"),
    dict(BLOCK_M=128, BLOCK_N=176, STAGES=2, SWIZZLE=128, P_FROM="regs", INTRA_WG_OVERLAP=True,
         PINGPONG=True, PERSISTENT=False, TILE_ORDER="head", SCHEDULER="static"),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs", INTRA_WG_OVERLAP=True,
         PINGPONG=True, PERSISTENT=True, TILE_ORDER="head", SCHEDULER="static"),
    dict(BLOCK_M=192, BLOCK_N=128, STAGES=2, SWIZZLE=128, P_FROM="regs", INTRA_WG_OVERLAP=True,
         PINGPONG=False, PERSISTENT=False, TILE_ORDER="head", SCHEDULER="static"),
    dict(BLOCK_M=128, BLOCK_N=64, STAGES=3, SWIZZLE=64, P_FROM="smem", INTRA_WG_OVERLAP=False,
         PINGPONG=True, PERSISTENT=True, TILE_ORDER="head", SCHEDULER="static"),
    dict(BLOCK_M=192, BLOCK_N=64, STAGES=4, SWIZZLE=32, P_FROM="regs", INTRA_WG_OVERLAP=True,
         PINGPONG=True, PERSISTENT=True, TILE_ORDER="head", SCHEDULER="static"),
]
PROBLEMS = [dict(HEAD_DIM=d, DTYPE=t, CAUSAL=c) for d in (64, 128) for t in ("fp16", "bf16")
            for c in (False, True)]
# (batch, heads, kv_heads, seq_q, seq_k, layout)
CHECK_SHAPES = [
    (2, 4, 4, 257, 257, "bhsd"),     # tails in every tile size
    (1, 3, 3, 7, 7, "bhsd"),         # shorter than one tile: whole warpgroups out of range
    (2, 8, 2, 200, 333, "bshd"),     # GQA, Sq < Sk, strided views of [B, S, H, D]
    (1, 6, 1, 300, 129, "bhsd"),     # MQA, Sq > Sk: causal rows with no key
    (3, 16, 4, 1111, 1000, "bshd"),  # more tiles than SMs: persistent blocks loop
]
# The targets: fp16, the shapes cuDNN was measured on.
WORKLOADS = {
    64: ["16,16,2048,64"],
    128: ["8,16,4096,128", "2,32,8192,128"],
}
CHILD_TIMEOUT_S = 90


def space() -> SearchSpace:
    return SearchSpace.load(paths.SPACES / "wgmma.toml")


def workloads(head_dims: list[int]) -> list[Workload]:
    return [Workload.parse(s, causal=c, dtype="fp16") for d in head_dims for s in WORKLOADS[d]
            for c in (False, True)]


# ---- children (on the GPU) --------------------------------------------------------------------


def _inputs(w: Workload, n_sets: int) -> list[tuple]:
    import torch

    sets = []
    for _ in range(n_sets):
        q = torch.randn(w.batch, w.heads, w.seq_q, w.head_dim, device="cuda", dtype=torch.half)
        k = torch.randn(w.batch, w.kv_heads, w.seq_k, w.head_dim, device="cuda",
                        dtype=torch.half)
        sets.append((q, k, torch.randn_like(k), torch.empty_like(q)))
    return sets


def _sets_for(w: Workload) -> list[tuple]:
    per_set = 2 * w.batch * w.head_dim * (2 * w.heads * w.seq_q + 2 * w.kv_heads * w.seq_k)
    return _inputs(w, measure.copies_needed(per_set))


def child_point(point: dict) -> dict:
    """Check one point on every admitted problem, then time it on its fp16 workloads."""
    import torch

    from evoengine import validate
    from evoengine.compile import compile_candidate
    from evoengine.runtime import Kernel

    sp = space()
    out: dict = {"params": point, "checks": [], "timings": []}
    kernels = {}
    for problem in PROBLEMS:
        if sp.violations(point, problem, ARCH):
            continue
        cand = make_candidate(sp, point, problem, ARCH)
        kernel = Kernel(cand, compile_candidate(cand, ARCH))
        kernels[(problem["HEAD_DIM"], problem["DTYPE"], problem["CAUSAL"])] = kernel
        dtype = torch.float16 if problem["DTYPE"] == "fp16" else torch.bfloat16
        for (b, h, hkv, sq, sk, layout), scale in [*((s, None) for s in CHECK_SHAPES),
                                                   (CHECK_SHAPES[0], -0.3)]:
            v = validate.check(kernel, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=sk,
                               head_dim=problem["HEAD_DIM"], causal=problem["CAUSAL"],
                               dtype=dtype, layout=layout, scale=scale)
            out["checks"].append({"problem": problem, "shape": [b, h, hkv, sq, sk, layout],
                                  "scale": scale, "ok": v.ok, "max_err": v.max_err,
                                  "tol": v.tolerance, "reason": v.reason})
    if not all(c["ok"] for c in out["checks"]):
        return out  # a wrong kernel's time means nothing
    for w in workloads(sorted({d for d, _, _ in kernels})):
        kernel = kernels.get((w.head_dim, "fp16", w.causal))
        if kernel is None:
            continue
        sets = _sets_for(w)
        t = measure.time_calls(measure.kernel_call(kernel, sets, w.head_dim ** -0.5), len(sets))
        out["timings"].append({"workload": w.to_dict(), "us": t.median_us,
                               "spread_us": t.spread_us, "tflops": w.flops() / t.median_us / 1e6})
        del sets
        torch.cuda.empty_cache()
    return out


def child_sdpa(head_dims: list[int]) -> dict:
    import torch

    rows = []
    for w in workloads(head_dims):
        sets = _sets_for(w)
        row = {"workload": w.to_dict()}
        for name in measure.SDPA_BACKENDS:
            try:
                with measure.sdpa_backend(name):
                    row[name] = measure.time_calls(measure.sdpa_call(w, sets),
                                                   len(sets)).median_us
            except RuntimeError as e:
                row[name] = None
                row[f"{name}_error"] = str(e).splitlines()[0]
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return {"rows": rows, **local_device(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def run_child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run this script as a child; its result is the last stdout line starting RESULT."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s (deadlock?)"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:]), f"{time.perf_counter() - start:.1f} s"
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"exit {done.returncode}: {tail}"


# ---- parent ---------------------------------------------------------------------------------


def compile_points(points: list[dict]) -> dict[str, dict]:
    """Compile every admitted (point, problem) offline; the children then load from the cache."""
    sp = space()
    cands = [make_candidate(sp, p, pr, ARCH) for p in points for pr in PROBLEMS
             if not sp.violations(p, pr, ARCH)]
    reports = {}
    for c, r in zip(cands, compile_many(cands, ARCH), strict=True):
        reports[c.identity] = {"ok": r.ok, "registers": r.registers,
                               "spill_bytes": r.spill_bytes, "error": r.error}
    return reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", help="JSON list of parameter dicts (default: the built-in six)")
    ap.add_argument("--json", type=Path, help="write the JSON document here")
    ap.add_argument("--child-point", help=argparse.SUPPRESS)
    ap.add_argument("--child-sdpa", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_point:
        print("RESULT " + json.dumps(child_point(json.loads(args.child_point))), flush=True)
        return
    if args.child_sdpa:
        print("RESULT " + json.dumps(child_sdpa(json.loads(args.child_sdpa))), flush=True)
        return

    start = time.perf_counter()
    points = json.loads(args.points) if args.points else DEFAULT_POINTS
    sp = space()
    for p in points:
        if all(sp.violations(p, pr, ARCH) for pr in PROBLEMS):
            raise SystemExit(f"point admitted for no problem: {p}: "
                             f"{sp.violations(p, PROBLEMS[0], ARCH)}")
    reports = compile_points(points)
    bad = {k: v for k, v in reports.items() if not v["ok"]}
    print(f"compiled {len(reports)} kernels in {time.perf_counter() - start:.0f} s, "
          f"{len(bad)} failed, {sum(1 for v in reports.values() if v['spill_bytes'])} spill")
    for k, v in bad.items():
        print(f"  compile error {k}: {v['error']}")

    results = []
    for i, p in enumerate(points):
        res, how = run_child(["--child-point", json.dumps(p)], CHILD_TIMEOUT_S)
        checks = res["checks"] if res else []
        n_ok = sum(c["ok"] for c in checks)
        first_bad = next((c for c in checks if not c["ok"]), None)
        print(f"[point {i}] {how}: {n_ok}/{len(checks)} checks pass  {p}")
        if res is None:
            print(f"  FAILED: {how}")
        elif first_bad:
            print(f"  first failure: {first_bad['problem']} {first_bad['shape']}: "
                  f"{first_bad['reason']}")
        results.append({"params": p, "child": how, **(res or {"checks": [], "timings": []})})

    head_dims = sorted({d for p in points for d in WORKLOADS
                        if not sp.violations(p, dict(HEAD_DIM=d, DTYPE="fp16", CAUSAL=False),
                                             ARCH)})
    base, how = run_child(["--child-sdpa", json.dumps(head_dims)], CHILD_TIMEOUT_S)
    print(f"[sdpa] {how}")
    sdpa = {json.dumps(r["workload"], sort_keys=True): r for r in (base or {}).get("rows", [])}

    print(f"\n{'workload':28} {'point':>5} {'ours us':>9} {'TFLOPS':>7} {'flash us':>9} "
          f"{'cudnn us':>9} {'vs flash':>8} {'vs cudnn':>8}")
    rows = []
    for i, r in enumerate(results):
        for t in r["timings"]:
            ref = sdpa.get(json.dumps(t["workload"], sort_keys=True), {})
            fl, cu = ref.get("flash"), ref.get("cudnn")
            w = t["workload"]
            name = (f"{w['batch']},{w['heads']},{w['seq_q']},{w['head_dim']}"
                    f"{' causal' if w['causal'] else ''}")
            rows.append({**t, "point": i, "params": r["params"], "sdpa_flash_us": fl,
                         "sdpa_cudnn_us": cu})
            print(f"{name:28} {i:5d} {t['us']:9.1f} {t['tflops']:7.1f} {fl or 0:9.1f} "
                  f"{cu or 0:9.1f} {(fl or 0) / t['us']:8.2f} {(cu or 0) / t['us']:8.2f}")
    base = base or {}
    method = (f"{measure.TIMING} (graph replay of {measure.GRAPH_CALLS} calls where one call "
              f"takes under {measure.GRAPH_BELOW_US:g} us), {measure.INPUTS}; correctness by "
              "evoengine.validate.check")
    doc = header(device=base.get("device"), driver=base.get("driver"), torch=base.get("torch"),
                 method=method, sms=base.get("sms"), compile=reports, points=results,
                 sdpa=list(sdpa.values()), rows=rows,
                 seconds=round(time.perf_counter() - start, 1))
    target = args.json or (Path(os.environ["OUT"]) / "wgmma_smoke.json"
                           if os.environ.get("OUT") else None)
    if target:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {target}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
