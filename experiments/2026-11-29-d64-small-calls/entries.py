"""Every causal kernel of an exported module at calls of a few sequences, next to SDPA cuDNN.

    python experiments/2026-11-29-d64-small-calls/entries.py runs/llama3.2-1b_attention.py \
        --config benchmarks/configs/llama3.2-1b.json --batches 2,3,4,6 --lengths 1029,1400 \
        --json $OUT/entries.json

For each (batch, length): which entry the module's dispatch picks, then every distinct kernel
of the module's (dtype, head dim, causal) group served as if it were that entry, and cuDNN,
timed interleaved (`measure.time_calls`, graph replay where the workload says so), --rounds
rounds, median of the rounds' medians. The dispatch's own choice is one of the kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import measure  # noqa: E402
from evoengine.export import import_module_file  # noqa: E402
from evoengine.geometry import from_config  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.workload import Workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", type=Path)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--batches", default="2,3,4,6")
    ap.add_argument("--lengths", default="1029")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    geo = from_config(args.config)
    attention = import_module_file(args.module).attention
    group = attention.table[(geo.dtype, geo.head_dim, geo.causal)]
    by_kernel = {}  # kernel index -> the first entry naming it
    for e in group:
        by_kernel.setdefault(e.kernel, e)
    select = attention.select

    def serve(entry) -> None:
        attention.select = (lambda *a, **k: entry) if entry is not None else select
        attention._choices.clear()
        attention._plans.clear()

    rows = []
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            w = Workload(batch=batch, heads=geo.heads, kv_heads=geo.kv_heads, seq_q=length,
                         seq_k=length, head_dim=geo.head_dim, causal=geo.causal,
                         dtype=geo.dtype)
            sets = measure.workload_inputs(w)
            serve(None)
            chosen = attention.explain(*sets[0][:3], causal=geo.causal).entry
            graph = measure.graph_for(w)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for entry in by_kernel.values():
                    serve(entry)

                    def call(i: int, sets: list = sets) -> None:
                        attention(*sets[i][:3], causal=geo.causal)
                    times.setdefault(entry.workload, []).append(
                        measure.time_calls(call, len(sets), graph=graph).median_us)
                t = measure.time_sdpa(w, sets, "cudnn", graph=graph)
                times.setdefault("cudnn", []).append(t.median_us if t else float("nan"))
            serve(None)
            med = {k: statistics.median(v) for k, v in times.items()}
            cudnn = med.pop("cudnn")
            best = min(med, key=med.get)
            row = {"shape": [batch, geo.heads, length, geo.head_dim], "kv_heads": geo.kv_heads,
                   "causal": geo.causal, "dtype": geo.dtype, "sdpa_cudnn_us": cudnn,
                   "dispatch_entry": chosen.workload, "dispatch_us": med[chosen.workload]
                   if chosen.workload in med else med[by_kernel[chosen.kernel].workload],
                   "best_entry": best, "best_us": med[best],
                   "entries_us": med}
            rows.append(row)
            print(f"b{batch} s{length}: cudnn {cudnn:7.1f}  dispatch {row['dispatch_us']:7.1f} "
                  f"({chosen.workload})  best {med[best]:7.1f} ({best})", flush=True)
            sets.clear()
    if args.json:
        doc = header(**local_device(), method=f"{measure.METHOD}; every distinct kernel of "
                     "the module's group served through its attention (dispatch overridden) "
                     f"and SDPA cuDNN interleaved, {args.rounds} rounds, median of the rounds' "
                     "medians", module=str(args.module), config=str(args.config), rows=rows)
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
