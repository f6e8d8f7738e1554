"""Where a backward call's time goes, ours next to FlashAttention-4's and cuDNN's: every CUDA
kernel of a call (ours: pre, main, post and, with a group split, the dK/dV sum), its mean
duration, and the call's span (first kernel's start to last kernel's end) with the idle time
between its kernels.

    python experiments/2026-11-29-bwd-kernel-split/split.py \
        --points experiments/2026-11-29-bwd-dq-drain/points.json \
        --workloads 8,16,2048,64,kv1,causal 16,16,2048,64,causal 4,32,4096,128,kv8,causal \
        --dtypes bf16 --json $OUT/split.json

Ours is the first point the points file lists for the workload that the space admits (the
format of benchmarks/train_step.py). torch.profiler's CUDA activity, 20 calls after 5
untimed ones, input sets rotated past L2 as the search's timing does. With ``--only NAME``
one contender's calls run ``--calls`` times without the profiler, for ncu to attach to:

    ncu --clock-control none -k regex:'attn_bwd$' -s 2 -c 1 --set full -o $OUT/ours \
        python experiments/2026-11-29-bwd-kernel-split/split.py --points ... \
        --workloads 16,16,2048,64,causal --only ours --calls 4 Anchors through
torch.autograd.grad with the forward's graph kept (as train_step.py's backward rows). A
diagnostic: the profiler adds host time between launches, so spans are not the benchmark's
times and only kernel durations compare across contenders."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import measure  # noqa: E402
from evoengine.arch import arch_of_capability  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.problems.backward import BackwardWorkload  # noqa: E402
from evoengine.provenance import header  # noqa: E402
from evoengine.search.domain import Domain  # noqa: E402
from evoengine.space import default_spaces  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

CALLS, WARM = 20, 5


def profile(call: Any, n_sets: int) -> dict[str, Any]:
    """Kernels of CALLS calls of ``call(i)`` (set i % n_sets): mean us a call per kernel
    name, and the mean span and idle time of a call."""
    import torch

    for i in range(WARM):
        call(i % n_sets)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            torch.cuda.synchronize()
            call(i % n_sets)
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for e in kernels:
        total[e.name] += e.time_range.end - e.time_range.start
        count[e.name] += 1
    # Every call launches the same kernels, in order: chunks of len(kernels) / CALLS.
    per = len(kernels) // CALLS
    spans, idles = [], []
    for c in range(CALLS if per and per * CALLS == len(kernels) else 0):
        chunk = kernels[c * per:(c + 1) * per]
        span = max(e.time_range.end for e in chunk) - chunk[0].time_range.start
        spans.append(span)
        idles.append(span - sum(e.time_range.end - e.time_range.start for e in chunk))
    return {"kernels": {k: {"us_per_call": round(total[k] / CALLS, 2),
                            "launches_per_call": count[k] / CALLS} for k in total},
            "kernel_us_per_call": round(sum(total.values()) / CALLS, 2),
            "span_us": round(sum(spans) / len(spans), 2) if spans else None,
            "idle_us": round(sum(idles) / len(idles), 2) if idles else None,
            "calls_seen": len(spans)}


def anchor_call(anchor: str, w: Workload, sets: list[tuple]) -> Any:
    import torch

    if anchor == "fa4":
        fn = measure.fa4_attention()
        if fn is None:
            return None
        forward = lambda q, k, v: measure.fa4_output(  # noqa: E731
            fn(*(x.transpose(1, 2) for x in (q, k, v)), causal=w.causal)).transpose(1, 2)
        context: Any = contextlib.nullcontext
    else:
        gqa = w.kv_heads != w.heads
        forward = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=w.causal, enable_gqa=gqa)
        context = lambda: measure.sdpa_backend(anchor)  # noqa: E731
    graphs = []
    with context():
        for q, k, v, _out, _lse, dout, *_ in sets:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            graphs.append((forward(*leaves), leaves, dout))

    def call(i: int) -> None:
        out, leaves, dout = graphs[i]
        with context():
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return call


def main() -> None:
    import torch

    from evoengine.search.worker import GpuWorker

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=Path, required=True)
    ap.add_argument("--workloads", nargs="+", required=True, metavar="B,H,S,D[,kvN][,causal]")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--anchors", default="fa4,cudnn")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", help="run only this contender (ours or an anchor), no profiler")
    ap.add_argument("--calls", type=int, default=4, help="with --only: calls to run")
    args = ap.parse_args()
    points = json.loads(args.points.read_text())["bwd"]
    spaces = [s.with_untested() for s in default_spaces(None)]
    rows, info = [], None
    for dtype in args.dtypes.split(","):
        for text in args.workloads:
            bw = BackwardWorkload.of(Workload.parse_spec(text, dtype=dtype))
            worker = GpuWorker(bw, 0)
            info = worker.info
            arch = arch_of_capability(*info.capability)
            domain = Domain(spaces, bw, arch)
            entry = next((e for e in points.get(text, []) + points.get("*", [])
                          if e["family"] in domain.spaces
                          and not domain.violations(e["family"],
                                                    domain.spaces[e["family"]].complete(
                                                        e["params"]))), None)
            if entry is None:
                print(f"{dtype} {text}: no admitted point", flush=True)
                continue
            params = domain.spaces[entry["family"]].complete(entry["params"])
            cand = domain.candidate(entry["family"], params)
            compiled = next(iter(compile_many([cand], arch)))
            kernel = worker.problem.load(cand, compiled)
            contenders = {"ours": worker.problem.timed_call(kernel, bw, worker.sets)}
            for a in args.anchors.split(","):
                if args.only not in (None, a):
                    continue
                try:
                    c = anchor_call(a, bw, worker.sets)
                except (RuntimeError, ValueError, TypeError) as e:
                    print(f"  {a}: not run ({type(e).__name__}: {e})", flush=True)
                    c = None
                if c is not None:
                    contenders[a] = c
            if args.only is not None:
                for i in range(args.calls):
                    contenders[args.only](i % len(worker.sets))
                torch.cuda.synchronize()
                continue
            for name, call in contenders.items():
                got = profile(call, len(worker.sets))
                rows.append({"workload": text, "dtype": dtype, "contender": name,
                             "params": params if name == "ours" else None, **got})
                print(f"{dtype} {text:28s} {name:6s} kernels {got['kernel_us_per_call']:8.1f} us"
                      f"  span {got['span_us'] or 0:8.1f}  idle {got['idle_us'] or 0:6.1f}",
                      flush=True)
                for k, v in sorted(got["kernels"].items(), key=lambda kv: -kv[1]["us_per_call"]):
                    print(f"    {v['us_per_call']:8.1f} us  x{v['launches_per_call']:.0f}  "
                          f"{k[:110]}", flush=True)
            del worker, contenders
            torch.cuda.empty_cache()
            if args.json:
                args.json.write_text(json.dumps(header(
                    device=info.name, driver=info.driver, torch=info.versions.get("torch"),
                    method=f"torch.profiler CUDA activity, {CALLS} calls after {WARM}, each "
                           "call between synchronizes, input sets rotated past L2; anchors by "
                           "torch.autograd.grad with the forward's graph kept",
                    versions=info.versions, summary=f"{len(rows)} contender rows",
                    rows=rows), indent=1))


if __name__ == "__main__":
    main()
