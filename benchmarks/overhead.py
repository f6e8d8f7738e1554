"""Eager per-call host overhead of the exported module, side by side with torch SDPA.

    python benchmarks/overhead.py --module tuned_attention.py --json overhead.json
    python benchmarks/overhead.py --store runs/evoengine.db            # evoengine.load()
    python benchmarks/overhead.py --demo       # export one hand-picked kernel first, then time

``--demo`` needs no search: it stores the best random mma point of the 2026-11-22 probe for
1,8,512,64 (BM64 BN32 W4 S2 xor, Q in shared memory) as the only elite, exports it to a
temporary module, and times that module.

Method. Host time: the GPU is first kept busy by one long ``torch.cuda._sleep`` kernel, so
every call in the timed loop only queues its launch; the wall-clock time of N back-to-back
calls in Python, divided by N, is then what one call costs the host (checks, allocation,
argument packing, the driver's launch), with no wait for the GPU in it. The stream must
still be busy when the loop ends, or the sleep was too short and the run says so. Wall
time: N calls then a synchronize, without the sleep: the larger of host and GPU time per
call. Each number is the median over ``--reps`` loops (the spread is the interquartile
range). All rows run in one process on the same inputs, fp16, q/k/v [B, H, S, D]
contiguous.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than any timed loop here


def demo_module(folder: Path, head_dim: int, causal: bool) -> Path:
    """Export one mma point as a module, through a store of one elite (time not measured)."""
    sys.path.insert(0, str(ROOT))
    from evoengine import paths
    from evoengine.export import export_best
    from evoengine.render import make_candidate, render
    from evoengine.runtime import gpu_arch
    from evoengine.space import SearchSpace
    from evoengine.store import Store
    from evoengine.workload import Workload

    arch = gpu_arch()
    space = SearchSpace.load(paths.SPACES / "mma.toml")
    w = Workload(1, 8, 512, head_dim, causal=causal)
    want = dict(BLOCK_M=64, BLOCK_N=32, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=False)
    admitted = space.admitted(w.problem(), arch)
    cand = make_candidate(space, want if want in admitted else admitted[0], w.problem(), arch)
    with Store(f"sqlite:///{folder / 'demo.db'}") as store:
        run = store.start_run(arch=arch.name, workload=w.to_dict(), workload_key=w.key(),
                              device=torch.cuda.get_device_name(), study="overhead-demo")
        store.add_candidate(identity=cand.identity, family=cand.family,
                            template_hash=cand.template_hash, params=cand.params,
                            problem=cand.problem, source=render(cand))
        store.set_elites(arch=arch.name, workload_key=w.key(), entries=[(cand.identity, 0.0)],
                         run_id=run)
    return export_best(folder / "demo.db", arch, output=folder / "tuned_attention.py").path


def load_attention(args: argparse.Namespace) -> Any:
    if args.demo:
        args.module = str(demo_module(Path(tempfile.mkdtemp()), args.head_dim, args.causal))
    if args.module:
        sys.path.insert(0, str(ROOT))
        from evoengine.export import import_module_file

        return import_module_file(args.module, "tuned_attention_bench").attention
    sys.path.insert(0, str(ROOT))
    import evoengine

    return evoengine.load(args.store)


def host_us(call: Callable[[], object], n: int, reps: int) -> tuple[float, float, bool]:
    """Median and IQR of host microseconds per call, and whether the GPU stayed busy."""
    samples, busy = [], True
    stream = torch.cuda.current_stream()
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(n):
            call()
        elapsed = time.perf_counter() - start
        busy &= not stream.query()  # still sleeping: no call waited for the GPU
        torch.cuda.synchronize()
        samples.append(elapsed / n * 1e6)
    return statistics.median(samples), iqr(samples), busy


def wall_us(call: Callable[[], object], n: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def iqr(samples: list[float]) -> float:
    q = statistics.quantiles(samples, n=4)
    return q[2] - q[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--module", help="an exported tuned_attention.py")
    source.add_argument("--store", default="runs/evoengine.db",
                        help="build with evoengine.load from this store instead")
    source.add_argument("--demo", action="store_true",
                        help="export one hand-picked kernel and time that (no store needed)")
    p.add_argument("--shape", default="1,8,512,64", help="B,H,S,D (default 1,8,512,64)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("-n", type=int, default=200, help="calls per timed loop (default 200)")
    p.add_argument("--reps", type=int, default=30, help="timed loops per row (default 30)")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    args = p.parse_args()

    b, h, s, d = (int(x) for x in args.shape.split(","))
    args.head_dim = d
    attention = load_attention(args)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    causal = args.causal
    entry = attention.select("fp16", d, causal, s, s, b * h)
    if entry is None:
        sys.exit(f"the module has no kernel for fp16 head_dim {d} causal={causal}")
    kernel = attention.kernels[entry.kernel]
    out = torch.empty_like(q)
    problem = sys.modules[type(attention).__module__].check_inputs(q, k, v)
    scale = d ** -0.5
    op = getattr(torch.ops, attention.namespace).attention

    rows: list[tuple[str, Callable[[], object], object]] = [
        ("tuned attention(q, k, v)", lambda: attention(q, k, v, causal=causal), None),
        ("tuned, through the custom op", lambda: op(q, k, v, causal), None),
        ("tuned kernel.launch only", lambda: kernel.launch(q, k, v, out, None, problem, scale),
         None),
        ("SDPA default", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
         None),
        ("SDPA flash", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
         SDPBackend.FLASH_ATTENTION),
        ("SDPA cuDNN", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
         SDPBackend.CUDNN_ATTENTION),
    ]
    results = []
    for name, call, backend in rows:
        try:
            with sdpa_kernel([backend]) if backend is not None else nullcontext():
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
                host, spread, busy = host_us(call, args.n, args.reps)
                wall = wall_us(call, args.n, args.reps)
        except RuntimeError as e:
            print(f"{name}: unavailable ({str(e).splitlines()[0]})", file=sys.stderr)
            continue
        results.append({"name": name, "host_us": round(host, 2), "host_iqr_us": round(spread, 2),
                        "wall_us": round(wall, 2), "gpu_stayed_busy": busy})

    print(f"\n{torch.cuda.get_device_name()}, shape {args.shape} fp16 causal={causal}, "
          f"kernel {kernel.name}")
    print(f"{'call':32s} {'host us/call':>14s} {'IQR':>6s} {'wall us/call':>13s}")
    for r in results:
        flag = "" if r["gpu_stayed_busy"] else "  (GPU went idle: host time is an upper bound)"
        print(f"{r['name']:32s} {r['host_us']:14.2f} {r['host_iqr_us']:6.2f} "
              f"{r['wall_us']:13.2f}{flag}")
    if args.json:
        sys.path.insert(0, str(ROOT))
        from evoengine.provenance import header, local_device

        doc = header(
            **local_device(), method=__doc__.split("Method. ")[1].strip(),
            benchmark="eager per-call host overhead", cuda=torch.version.cuda,
            shape=args.shape, causal=causal, calls_per_loop=args.n, reps=args.reps,
            kernel=kernel.name, module=args.module or f"evoengine.load({args.store!r})",
            provenance=getattr(attention, "provenance", {}), results=results)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
