"""The backward and the training step (forward + backward), ours next to SDPA and FA4.

    python benchmarks/train_step.py --points benchmarks/train_step_points.json \
        --dtypes fp16,bf16 --rounds 3 --json out.json

For each workload and dtype: every forward point and every backward point the points file
lists for it (a list per kind, or one list for all workloads under ``"*"``) goes through the
search's own GPU worker (``evoengine.search.worker.GpuWorker``): the criterion on the plan of
its problem, then a timing; the fastest valid forward and backward are kept. Then ``--rounds``
rounds, each timing in turn, interleaved, in this process:

- the backward alone: ours (pre, main, post kernels) next to SDPA's flash and cuDNN backward
  and FlashAttention-4's (``torch.autograd.grad`` of the output, the forward's graph kept);
- the training step: our forward (writing the log-sum-exp) then our backward, next to each
  anchor's forward then ``torch.autograd.grad`` (a fresh graph per call).

Rows carry ``direction`` (``bwd`` or ``step``), ``ours_us``, ``sdpa_flash_us``,
``sdpa_cudnn_us``, ``fa4_us`` (null where FA4 does not import) and same-run ratios; backward
TFLOPS count 10*B*H*Sq*Sk*D (halved for causal), the step's 14*B*H*Sq*Sk*D.

``--every-bwd`` times every valid backward point in each round (interleaved with the
anchors), not only the fastest: the bwd row's ``bwd_points`` lists each point's median and
its ratio to cuDNN, so twins that differ in one parameter compare in one run. ``--bwd-only``
skips the forward points and the step rows. A quick A/B of two backward variants, e.g.:

    python benchmarks/train_step.py --points benchmarks/train_step_points.json \
        --workloads 8,16,4096,128 8,16,4096,128,causal 16,16,2048,64,causal --dtypes bf16 \
        --rounds 1 --bwd-only --every-bwd --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import measure  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.problems import problem  # noqa: E402
from evoengine.problems.backward import BackwardWorkload  # noqa: E402
from evoengine.provenance import header  # noqa: E402
from evoengine.search.domain import Domain  # noqa: E402
from evoengine.space import default_spaces  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

WORKLOADS = ["16,16,2048,64", "16,16,2048,64,causal", "8,16,4096,128",
             "8,16,4096,128,causal", "2,32,8192,128", "2,32,8192,128,causal"]
ANCHORS = ("flash", "cudnn", "fa4")


def points_for(points: dict[str, Any], kind: str, text: str) -> list[tuple[str, dict]]:
    table = points.get(kind, {})
    entries = table.get(text, []) + table.get("*", [])
    return [(e["family"], e["params"]) for e in entries]


def best_valid(worker: Any, domain: Domain, pts: list[tuple[str, dict]], arch: Any,
               invalid: list[dict], valid: list[tuple] | None = None
               ) -> tuple[Any, Any, float] | None:
    """The fastest point that passes the criterion: (candidate, compiled, median us); each
    point that passes is appended to ``valid`` where given."""
    cands = []
    for family, params in pts:
        space = domain.spaces.get(family)
        if space is None:
            continue
        params = space.complete(params)
        if domain.violations(family, params):
            invalid.append({"family": family, "params": params, "reason": "not admitted"})
            continue
        cands.append(domain.candidate(family, params))
    best = None
    for cand, compiled in zip(cands, compile_many(cands, arch), strict=True):
        if not compiled.ok:
            invalid.append({"params": cand.params, "reason": compiled.error})
            continue
        r = worker.evaluate(cand, compiled)
        if not r["ok"]:
            invalid.append({"params": cand.params, "reason": r["reason"]})
        else:
            if valid is not None:
                valid.append((cand, compiled, r["median_us"]))
            if best is None or r["median_us"] < best[2]:
                best = (cand, compiled, r["median_us"])
    return best


def step_anchor(anchor: str, w: Workload, sets: list[tuple], graph_cache: dict) -> float | None:
    """An anchor's forward then ``torch.autograd.grad``, a fresh graph per call."""
    import torch

    if anchor == "fa4":
        fn = measure.fa4_attention()
        if fn is None:
            return None

        def forward(q: Any, k: Any, v: Any) -> Any:
            out = fn(*(x.transpose(1, 2) for x in (q, k, v)), causal=w.causal)
            return measure.fa4_output(out).transpose(1, 2)
        context: Any = contextlib.nullcontext()
    else:
        gqa = w.kv_heads != w.heads

        def forward(q: Any, k: Any, v: Any) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=w.causal, enable_gqa=gqa)
        context = measure.sdpa_backend(anchor)
    leaves = graph_cache.setdefault("leaves", [
        [x.detach().requires_grad_() for x in s[:3]] for s in sets])

    def call(i: int) -> None:
        q, k, v = leaves[i]
        torch.autograd.grad(forward(q, k, v), (q, k, v), sets[i][5])
    try:
        with context:
            return measure.time_calls(call, len(sets), graph=False).median_us
    except (RuntimeError, ValueError, TypeError, AssertionError):
        return None


def interleaved(worker: Any, w: Workload, bw: BackwardWorkload, fwd: tuple | None, bwd: tuple,
                rounds: int, dtype: str, text: str, invalid: list[dict],
                others: Sequence[tuple] = ()) -> list[dict[str, Any]]:
    """The backward and the step rows of one workload: ``rounds`` interleaved rounds; no step
    row without a forward point. ``others``: more valid backward points, each timed in every
    round too."""
    import torch

    fkernel = problem("fwd").load(fwd[0], fwd[1]) if fwd is not None else None
    bkernel = worker.problem.load(bwd[0], bwd[1])
    sets = worker.sets
    bwd_call = worker.problem.timed_call(bkernel, bw, sets)
    other_calls = [(o, worker.problem.timed_call(worker.problem.load(o[0], o[1]), bw, sets))
                   for o in others]

    def step_call(i: int) -> None:
        q, k, v, out, lse, dout, dq, dk, dv = sets[i]
        fkernel(q, k, v, out=out, lse=lse)
        bkernel(q, k, v, out, lse, dout, causal=w.causal, dq=dq, dk=dk, dv=dv)

    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[str, list[float]]] = {
        d: {c: [] for c in ("ours", *ANCHORS)} for d in (("bwd", "step") if fkernel else ("bwd",))}
    other_us: list[list[float]] = [[] for _ in other_calls]
    cache: dict[str, Any] = {}
    for _ in range(rounds):
        samples["bwd"]["ours"].append(
            measure.time_calls(bwd_call, len(sets), graph=False).median_us)
        for (_, call), got in zip(other_calls, other_us, strict=True):
            got.append(measure.time_calls(call, len(sets), graph=False).median_us)
        for a in ANCHORS:
            t = worker.problem.time_anchor(a, bw, sets, graph=False)
            if t is not None:
                samples["bwd"][a].append(t.median_us)
        if fkernel is None:
            continue
        samples["step"]["ours"].append(
            measure.time_calls(step_call, len(sets), graph=False).median_us)
        for a in ANCHORS:
            us = step_anchor(a, w, sets, cache)
            if us is not None:
                samples["step"][a].append(us)
    torch.cuda.synchronize()
    for direction, got in samples.items():
        med = {c: (statistics.median(v) if v else None) for c, v in got.items()}
        flops = (1.4 if direction == "step" else 1.0) * bw.flops()
        ours = med["ours"]
        row = {
            "kind": "bwd", "direction": direction, "shape": [w.batch, w.heads, w.seq_q,
                                                             w.head_dim],
            "kv_heads": w.kv_heads, "seq_k": w.seq_k, "causal": w.causal,
            "dtype": dtype, "ours_us": ours, "sdpa_flash_us": med["flash"],
            "sdpa_cudnn_us": med["cudnn"], "fa4_us": med["fa4"],
            **{f"vs_{a}": (med[k] / ours if med[k] else None)
               for a, k in (("flash", "flash"), ("cudnn", "cudnn"), ("fa4", "fa4"))},
            "tflops": flops / ours / 1e6,
            "forward": ({"family": fwd[0].family, "params": fwd[0].params,
                         "identity": fwd[0].identity} if fwd is not None else None),
            "backward": {"family": bwd[0].family, "params": bwd[0].params,
                         "identity": bwd[0].identity},
            "refused": invalid,
        }
        if direction == "bwd" and other_calls:
            timed = [(bwd, samples["bwd"]["ours"])] + [
                (o, got) for (o, _), got in zip(other_calls, other_us, strict=True)]
            row["bwd_points"] = [
                {"family": c.family, "params": c.params, "identity": c.identity,
                 "median_us": statistics.median(got),
                 "vs_cudnn": (med["cudnn"] / statistics.median(got) if med["cudnn"] else None)}
                for (c, _, _), got in timed]
            for p in row["bwd_points"]:
                print(f"{dtype} {text:22} bwd point {p['median_us']:8.1f} us  "
                      f"x{p['vs_cudnn'] or 0:.3f} cudnn  {p['params']}", flush=True)
        rows.append(row)
        print(f"{dtype} {text:22} {direction:4} ours {ours:8.1f} us  "
              f"cudnn {med['cudnn'] or 0:8.1f} x{row['vs_cudnn'] or 0:.3f}  "
              f"flash {med['flash'] or 0:8.1f} x{row['vs_flash'] or 0:.3f}  "
              f"fa4 {med['fa4'] or 0:8.1f} x{row['vs_fa4'] or 0:.3f}  "
              f"{row['tflops']:.0f} TF", flush=True)
    return rows


def main() -> None:
    import torch

    from evoengine.arch import arch_of_capability
    from evoengine.search.worker import GpuWorker

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=WORKLOADS,
                    metavar="B,H,S,D[,kvN][,causal]")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--points", type=Path, required=True,
                    help='JSON {"fwd"|"bwd": {"B,H,S,D[,causal]"|"*": [{family, params}]}}')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every-bwd", action="store_true",
                    help="time every valid backward point per round, not only the fastest")
    ap.add_argument("--bwd-only", action="store_true",
                    help="no forward point and no training-step rows: the backward alone")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    points = json.loads(args.points.read_text())
    # Forward and backward families, [untested] values admitted: the points file names what
    # to time, and each point passes the criterion before it is timed.
    spaces = [s.with_untested() for s in default_spaces(None)]
    rows: list[dict[str, Any]] = []
    info = None

    def write() -> None:  # after every workload: a run cut short keeps what it measured
        if not args.json:
            return
        ratios = [r["vs_cudnn"] for r in rows if r["vs_cudnn"]]
        doc = header(
            device=info.name if info else None, driver=info.driver if info else None,
            torch=info.versions.get("torch") if info else None,
            method=f"each point: the criterion, then {measure.METHOD}; the fastest valid "
                   f"forward and backward then timed {args.rounds} rounds interleaved with "
                   "SDPA flash, cuDNN and FlashAttention-4 (eager) in the same process, "
                   "median of the rounds' medians; bwd: torch.autograd.grad with the "
                   "forward's graph kept; step: forward then torch.autograd.grad",
            versions=info.versions if info else None,
            summary=(f"{len(rows)} rows; vs cuDNN {min(ratios):.3f}-{max(ratios):.3f}"
                     if ratios else f"{len(rows)} rows"),
            points=str(args.points), rows=rows)
        args.json.write_text(json.dumps(doc, indent=1))

    for dtype in args.dtypes.split(","):
        for text in args.workloads:
            w = Workload.parse_spec(text, dtype=dtype)
            bw = BackwardWorkload.of(w)
            fwd_worker = GpuWorker(w, 0)
            info = fwd_worker.info
            arch = arch_of_capability(*info.capability)
            invalid: list[dict] = []
            fwd = None if args.bwd_only else best_valid(
                fwd_worker, Domain(spaces, w, arch), points_for(points, "fwd", text), arch,
                invalid)
            del fwd_worker
            torch.cuda.empty_cache()
            worker = GpuWorker(bw, 0)
            valid: list[tuple] = []
            bwd = best_valid(worker, Domain(spaces, bw, arch), points_for(points, "bwd", text),
                             arch, invalid, valid)
            if (fwd is None and not args.bwd_only) or bwd is None:
                print(f"{dtype} {text}: no valid {'backward' if bwd is None else 'forward'} "
                      f"point ({len(invalid)} refused)", flush=True)
                continue
            others = [v for v in valid if v[0] is not bwd[0]] if args.every_bwd else []
            rows += interleaved(worker, w, bw, fwd, bwd, args.rounds, dtype, text, invalid,
                                others)
            write()
            del worker
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
