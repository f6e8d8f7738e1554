"""An exported module at shapes its tune never saw: coverage, the criterion, and speed next to
SDPA cuDNN (issue #17's check).

    python benchmarks/model_check.py tuned_attention.py --config config.json \
        --shapes 20 --seed 0 --json out.json

Draws ``--shapes`` calls of the model's geometry (``random.Random(seed)``: batch 1-16, length
log-uniform in 300-16000 and no multiple of 8, batch cut so a call has at most
``--max-tokens`` query tokens), then for each: which entry serves it (``attention.explain``;
a refusal is counted, never skipped), the criterion on that very kernel (``validate.check`` at
the call's batch and heads, its length cut to at most 1531 so the float64 reference fits: the
kernel is the same for every length), and a timing of ``attention`` next to SDPA cuDNN,
``--rounds`` rounds interleaved in this process (``measure.time_calls``, inputs rotated past
L2). Rows: ``shape`` [B, H, S, D], ``causal``, ``dtype``, ``ours_us``, ``sdpa_cudnn_us``,
``vs_cudnn``, ``tuned`` (the serving entry was tuned at exactly this shape), ``entry``,
``criterion``. ``--causal`` and ``--dtype`` call the module with a mask or dtype other than the
config's (the variants its tune derived rather than searched), at the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import measure, validate  # noqa: E402
from evoengine.export import import_module_file  # noqa: E402
from evoengine.geometry import from_config  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

CHECK_LENGTH = 1531  # prime: the criterion's longest length, no multiple of any tile


def draw_shapes(n: int, seed: int, max_tokens: int) -> list[tuple[int, int]]:
    """(batch, length) pairs: batch 1-16, length log-uniform in 300-16000, not a multiple
    of 8, batch cut to keep batch x length <= max_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(300), math.log(16000))))
        length += 1 if length % 8 == 0 else 0
        batch = max(1, min(rng.randint(1, 16), max_tokens // length))
        out.append((batch, length))
    return out



def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", type=Path, help="an exported module (evoengine export / tune -o)")
    ap.add_argument("--config", type=Path, required=True, help="the model's config.json")
    ap.add_argument("--shapes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal", choices=["config", "yes", "no"], default="config",
                    help="the mask of every call (default: the config's)")
    ap.add_argument("--dtype", choices=["config", "fp16", "bf16"], default="config",
                    help="the dtype of every call (default: the config's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    geo = from_config(args.config)
    if args.causal != "config":
        geo = dataclasses.replace(geo, causal=args.causal == "yes")
    if args.dtype != "config":
        geo = dataclasses.replace(geo, dtype=args.dtype)
    attention = import_module_file(args.module).attention
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[geo.dtype]
    rows: list[dict[str, Any]] = []
    refused = failed = 0
    for batch, length in draw_shapes(args.shapes, args.seed, args.max_tokens):
        w = Workload(batch=batch, heads=geo.heads, kv_heads=geo.kv_heads, seq_q=length,
                     seq_k=length, head_dim=geo.head_dim, causal=geo.causal, dtype=geo.dtype)
        sets = measure.workload_inputs(w)
        q, k, v = sets[0][:3]
        why = attention.explain(q, k, v, causal=geo.causal)
        row: dict[str, Any] = {
            "shape": [batch, geo.heads, length, geo.head_dim], "kv_heads": geo.kv_heads,
            "causal": geo.causal, "dtype": geo.dtype, "explain": str(why)}
        if why.entry is None:
            refused += 1
            row.update(refused=why.why_none)
            rows.append(row)
            print(f"{w.key()}: REFUSED {why.why_none}", flush=True)
            continue
        kernel = attention.kernels[why.entry.kernel]
        cut = min(length, CHECK_LENGTH)
        verdict = validate.check(kernel, batch=min(batch, 4), heads=geo.heads,
                                 kv_heads=geo.kv_heads, seq_q=cut, seq_k=cut,
                                 head_dim=geo.head_dim, causal=geo.causal, dtype=dtype)
        failed += not verdict.ok
        tuned = (why.entry.tuned and why.entry.seq_q == length and why.entry.seq_k == length
                 and why.entry.batch == batch)

        def ours(i: int, sets: list = sets) -> None:
            attention(*sets[i][:3], causal=geo.causal)

        # One timing mode for both, from the workload (as the search does): left to each
        # contender's own eager time, a host-bound call of ours was once timed eagerly next to
        # cuDNN's graph replay (b1-h32-kv8-sq385 at 9bc97cf).
        graph = measure.graph_for(w)
        ours_s, cudnn_s = [], []
        for _ in range(args.rounds):
            ours_s.append(measure.time_calls(ours, len(sets), graph=graph).median_us)
            t = measure.time_sdpa(w, sets, "cudnn", graph=graph)
            if t is not None:
                cudnn_s.append(t.median_us)
        ours_us = statistics.median(ours_s)
        cudnn_us = statistics.median(cudnn_s) if cudnn_s else None
        row.update(ours_us=ours_us, sdpa_cudnn_us=cudnn_us,
                   vs_cudnn=cudnn_us / ours_us if cudnn_us else None, tuned=bool(tuned),
                   entry=why.entry.workload, entry_tuned=why.entry.tuned,
                   kernel=why.kernel, tflops=w.flops() / ours_us / 1e6,
                   criterion={"ok": verdict.ok, "max_err": verdict.max_err,
                              "tolerance": verdict.tolerance, "checked_at": [min(batch, 4), cut],
                              "reason": verdict.reason})
        rows.append(row)
        print(f"{w.key():44} ours {ours_us:9.1f} us  cudnn {cudnn_us or 0:9.1f}  "
              f"x{row['vs_cudnn'] or 0:.3f}  {'ok' if verdict.ok else 'FAIL'}  "
              f"from {why.entry.workload}", flush=True)
        sets.clear()
        torch.cuda.empty_cache()
    ratios = [r["vs_cudnn"] for r in rows if r.get("vs_cudnn")]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    summary = {"shapes": len(rows), "refused": refused, "criterion_failed": failed,
               "vs_cudnn_geomean": geomean, "vs_cudnn_min": min(ratios) if ratios else None,
               "vs_cudnn_max": max(ratios) if ratios else None}
    print(json.dumps(summary))
    if args.json:
        doc = header(**local_device(), method=f"{measure.METHOD}; ours (the exported module's "
                     f"attention, eager) and SDPA cuDNN interleaved, {args.rounds} rounds, "
                     "median of the rounds' medians; the criterion on the serving kernel at "
                     f"the call's heads, batch <= 4 and length <= {CHECK_LENGTH}",
                     summary="; ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in summary.items()),
                     summary_values=summary, module=str(args.module), config=str(args.config),
                     variant={"causal": args.causal, "dtype": args.dtype},
                     seed=args.seed, rows=rows)
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
