"""Clock and power of ours and FlashAttention-4 on a row without the mask (issue #19), side by
side: the d64 row by default.

Under ncu the d64 winner takes as many cycles as FA4 (docs/NOTES.md, 2026-11-27), yet times
about 1% slower. If it draws more power, the GPU clocks it lower: this measures that. For each
dtype, ours (the row's 2-stage and 3-stage TMA-store points) and FA4 run back to back for
SECONDS each, twice, over input sets rotated past L2, while `nvidia-smi -lms 50` samples the SM
clock and the board power; each window's median clock and power, its time per call (events),
and cycles per call (time x clock) are printed and written to JSON. On the device, with FA4
installed:
    python experiments/2026-11-28-wgmma-clocks/clocks.py --json $OUT/clocks.json
(--shape 2,32,8192,128: the d128 row's winner instead, --block-m 128,192 that point at two
tile heights; --dtypes bf16 one dtype; FA4 is left out where it does not import.)
--kv-reads 1,2,3 prices the bytes from L2 instead: the point's 2-stage build with every K and V
tile loaded that many times by its producer (the same box into the same slot, the full barrier
expecting all of it), written into the rendered source, not the template. The extra loads
cross L2 and the crossbar and are written to shared memory again; nothing else changes, and the
output must stay bit-identical to one read's, which is checked first.
--multicast times the 2-stage point dealt statically with and without KV_MULTICAST (blocks in
pairs sharing each K/V block's loads), and the dynamic point the d64 row ships; --stages 2,3,4
at those stage counts, with --coupled also the pair loading its own halves (no multicast: the
pair's coupling alone, written into the rendered source). These three need the tree of d4415d8,
where the wgmma space had KV_MULTICAST (dropped after it was measured; docs/NOTES.md).)"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from evoengine import measure, paths  # noqa: E402
from evoengine.compile import compile_source  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.render import make_candidate, render  # noqa: E402
from evoengine.runtime import Kernel, gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

SECONDS = 4.0
POINT = dict(BLOCK_M=192, BLOCK_N=128, SWIZZLE=128, P_FROM="regs", INTRA_WG_OVERLAP=True,
             PINGPONG=True, PERSISTENT=True, TILE_ORDER="head", SCHEDULER="dynamic",
             PACK_GQA=False, P_BARRIER="warpgroup", O_STAGE="own_or_q", O_STORE="tma")
# d128 (--shape 2,32,8192,128): the bf16 row's winner, P and O through the P tile, static.
POINT_D128 = dict(POINT, P_FROM="smem", P_BARRIER="turn", O_STAGE="p", SCHEDULER="static")


# The producer's K and V loads as the template renders them (--kv-reads rewrites them).
KV_LOADS = ("        mbar::arrive_expect_tx(bars.{x}_full(ring.slot), KVTile::BYTES);\n"
            "#pragma unroll\n"
            "        for (int p = 0; p < KVTile::PANELS; ++p)\n")
KV_LOADS_REPEATED = (
    "        mbar::arrive_expect_tx(bars.{x}_full(ring.slot), KVTile::BYTES * {n});\n"
    "#pragma unroll\n"
    "        for (int r_ = 0; r_ < {n}; ++r_)\n"
    "#pragma unroll\n"
    "        for (int p = 0; p < KVTile::PANELS; ++p)\n")


def patched_kernel(candidate, arch, edits: list[tuple[str, str]], tag: str) -> Kernel:
    """The candidate built from its rendered source with each (old, new) edit made once."""
    source = render(candidate)
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"clocks: {tag}: {old.strip()[:60]!r} is not once in the source")
        source = source.replace(old, new)
    compiled = compile_source(source, arch, candidate.defines(arch),
                              identity=f"{candidate.identity}@{tag}",
                              smem_bytes=candidate.smem_bytes)
    if not compiled.ok:
        raise SystemExit(f"clocks: {candidate.identity}@{tag}: {compiled.error}")
    return Kernel(candidate, compiled)


def kv_read_kernel(candidate, arch, reads: int) -> Kernel:
    """The candidate with each K and V tile loaded `reads` times (see the docstring)."""
    return patched_kernel(candidate, arch, [(KV_LOADS.format(x=x),
                                             KV_LOADS_REPEATED.format(x=x, n=reads))
                                            for x in "kv"], f"kv{reads}")


# KV_MULTICAST's shared loads, which --coupled turns off (each block loads both halves itself,
# the pair still releasing every slot to both producers).
SHARED_LOADS = "    if (shared) {\n      const int r = cluster::rank();"


def coupled_kernel(candidate, arch) -> Kernel:
    """The KV_MULTICAST candidate without its multicast: the pair's coupling alone."""
    return patched_kernel(candidate, arch,
                          [(SHARED_LOADS, SHARED_LOADS.replace("(shared)", "(false)"))], "coupled")


def run_window(fn, sets, seconds):
    """Calls fn over the sets for `seconds`; (start, end) wall times and us per call."""
    torch.cuda.synchronize()
    start, calls = time.time(), 0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.time() - start < seconds:
        for _ in range(20):
            fn(*sets[calls % len(sets)])
            calls += 1
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start, time.time(), begin.elapsed_time(end) * 1000 / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape", default="16,16,2048,64", help="B,H,S,D (D 64 or 128)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--block-m", default="",
                    help="d128: time these tile heights instead (e.g. 128,192: the same point, O "
                         "staged where it fits, so that only the L2 bytes a call differ much)")
    ap.add_argument("--kv-reads", default="",
                    help="time the 2-stage point with each K/V tile loaded this many times "
                         "(e.g. 1,2,3), after checking the outputs match one read's")
    ap.add_argument("--multicast", action="store_true",
                    help="time the 2-stage static point with and without KV_MULTICAST")
    ap.add_argument("--stages", default="2", help="--multicast: these stage counts")
    ap.add_argument("--coupled", action="store_true",
                    help="--multicast: also each pair with its multicast turned off")
    args = ap.parse_args()
    b, h, seq, d = map(int, args.shape.split(","))
    point = POINT if d == 64 else POINT_D128
    fa4 = measure.fa4_attention()  # timed where it imports
    arch, sp = gpu_arch(), SearchSpace.load(paths.SPACES / "wgmma.toml").with_untested()
    log = Path("/tmp/smi.csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=log.open("w"), text=True)
    windows = []
    try:
        for dtype in args.dtypes.split(","):
            w = Workload.parse_spec(args.shape, dtype=dtype)
            t = torch.bfloat16 if dtype == "bf16" else torch.float16
            coupled = {}
            if args.multicast:
                points = {}
                for st in map(int, args.stages.split(",")):
                    static = dict(point, STAGES=st, SCHEDULER="static")
                    points[f"static-{st}st"] = static
                    points[f"pair-{st}st"] = dict(static, KV_MULTICAST=True)
                    if args.coupled:
                        coupled[f"coupled-{st}st"] = dict(static, KV_MULTICAST=True)
                    if d == 64:
                        points[f"dynamic-{st}st"] = dict(point, STAGES=st)
            elif args.block_m:
                points = {f"ours-m{m}": dict(point, STAGES=2, BLOCK_M=int(m), O_STAGE="own_or_q")
                          for m in args.block_m.split(",")}
            else:
                points = {f"ours-{s}st": dict(point, STAGES=s)
                          for s in ((2, 3) if d == 64 else (2,))}
            sets = []
            for _ in range(3):  # 3 x 256 MB at d64, past the 50 MB L2
                q, k, v = (torch.randn(b, seq, h, d, device="cuda").to(t) for _ in range(3))
                sets.append((q, k, v))
            if args.kv_reads:
                cand = make_candidate(sp, dict(point, STAGES=2), w.problem(), arch)
                ours = {f"ours-kv{n}": kv_read_kernel(cand, arch, int(n))
                        for n in args.kv_reads.split(",")}
                q, k, v = (x.transpose(1, 2) for x in sets[0])
                outs = {name: kern(q, k, v) for name, kern in ours.items()}
                first = next(iter(outs.values()))
                for name, out in outs.items():
                    if out.isnan().any() or not torch.equal(out, first):
                        raise SystemExit(f"clocks: {name}'s output differs from one read's")
                print(f"{dtype}: {len(outs)} builds, outputs bit-identical", flush=True)
            else:
                ours = {name: Kernel.build(make_candidate(sp, p, w.problem(), arch), arch)
                        for name, p in points.items()}
                ours.update({name: coupled_kernel(make_candidate(sp, p, w.problem(), arch), arch)
                             for name, p in coupled.items()})
            calls = {name: (lambda q, k, v, kern=kern: kern(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2)))
                     for name, kern in ours.items()}
            if fa4 is not None:
                calls["fa4"] = lambda q, k, v: fa4(q, k, v, causal=False)
            for fn in calls.values():  # warm-up, compile FA4
                for s in sets:
                    fn(*s)
            for rnd in range(2):
                for name, fn in calls.items():
                    t0, t1, us = run_window(fn, sets, SECONDS)
                    windows.append({"dtype": dtype, "round": rnd, "contender": name,
                                    "start": t0, "end": t1, "us_per_call": us})
                    time.sleep(1.0)
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for line in log.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            samples.append((stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    rows = []
    for wdw in windows:
        # the window's middle 80%: the clock settles after a switch of kernel
        lo = wdw["start"] + 0.1 * (wdw["end"] - wdw["start"])
        hi = wdw["end"] - 0.1 * (wdw["end"] - wdw["start"])
        inside = [s for s in samples if lo <= s[0] <= hi]
        mhz = statistics.median(s[1] for s in inside) if inside else None
        watts = statistics.median(s[2] for s in inside) if inside else None
        row = {**{k: wdw[k] for k in ("dtype", "round", "contender")},
               "us_per_call": round(wdw["us_per_call"], 2), "samples": len(inside),
               "sm_mhz": mhz, "power_w": watts,
               "mcycles_per_call": round(wdw["us_per_call"] * mhz / 1e6, 4) if mhz else None}
        rows.append(row)
        print(f"{row['dtype']} r{row['round']} {row['contender']:9} {row['us_per_call']:8.1f} us"
              f"  {mhz} MHz  {watts} W  {row['mcycles_per_call']} Mcycles  ({len(inside)})",
              flush=True)
    if args.json:
        doc = {**header(**local_device(), shape=args.shape, method=(
            f"each contender called back to back for {SECONDS} s over 3 input sets past L2, "
            "two rounds in turn; nvidia-smi clocks.sm and power.draw every 50 ms, the median "
            "over each window's middle 80%; time per call from CUDA events over the window")),
               "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
