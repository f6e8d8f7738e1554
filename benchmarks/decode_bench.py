"""Decode over a KV cache: our kernels next to the anchors and a device-to-device copy.

For each row of the grid (issue #18: q_len 1 and 4, GQA 32/8 and 64/8, head dim 128, batch
1/8/64, cache 4K/32K/128K, a paged cache of 64-key pages dealt in a shuffled order and a
contiguous one; rows whose K+V pass 16 GB are skipped) it times, in one process and
interleaved over ``--rounds`` rounds (median of the rounds' medians), by CUDA-graph replay:

- ours: each given point, after the decode criterion (``validate.check_decode_workload``);
  the fastest point that passed is the row's;
- the anchors: SDPA's cuDNN and flash backends with enable_gqa on a contiguous cache, and
  FlashAttention-4's paged/varlen call where it imports;
- copy: a device-to-device copy of the same K and V bytes, two ways: ``copy_`` (a memcpy node,
  ``copy_memcpy_us``) and an elementwise kernel (``copy_kernel_us``); ``copy_us`` is the faster.

Rows carry ``bandwidth_fraction`` = (K/V bytes read / ours_us) / (2 x copied bytes / copy_us):
against the faster copy, since on the H200 (2026-11-28) the memcpy node moved 2.7 TB/s at 1 GB
and more, where the kernel moved 4.1 TB/s and the decode kernels read 4.2-4.65 TB/s.

    python benchmarks/decode_bench.py --points points.json --out results.json
    python benchmarks/decode_bench.py --store runs/evoengine.db --batch 1 8 --cache 32768

``--points``: a JSON list of parameter dicts (each tried on every row), or a dict from a
decode workload key to a list of them (tried on that row only; rows it does not name get the
union); ``--store``: the decode elites of a store, by workload (rank 1 first), the same way.
``--base-templates DIR`` (another tree's ``templates/``): each point is also built from those
and timed beside, as ``<identity>@base`` in ``points_us`` (a template change's A/B, both through
the criterion); the row's own point is the fastest of the current templates' builds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evoengine.problems.decode import (  # noqa: E402
    Decode,
    DecodeWorkload,
    bandwidth_fraction,
    time_copy,
)

MAX_KV_BYTES = 16 << 30
GRID = dict(q_len=(1, 4), heads=((32, 8), (64, 8)), batch=(1, 8, 64),
            cache=(4096, 32768, 131072), layout=("paged", "contiguous"))


def grid(args: argparse.Namespace) -> list[DecodeWorkload]:
    """The issue's grid, cut to the values the flags name."""
    if args.workloads:
        return [DecodeWorkload.from_key(k) for k in args.workloads]
    rows = []
    for layout in args.layout:
        for q_len in args.q_len:
            for h, kv in GRID["heads"]:
                if args.heads and h not in args.heads:
                    continue
                for batch in args.batch:
                    for cache in args.cache:
                        w = DecodeWorkload(batch=batch, q_len=q_len, q_heads=h, kv_heads=kv,
                                           head_dim=128, cache_len=cache, layout=layout,
                                           page_size=64 if layout == "paged" else 0,
                                           dtype=args.dtype)
                        if w.kv_bytes() <= MAX_KV_BYTES:
                            rows.append(w)
    return rows


def points_for(args: argparse.Namespace, arch: str | None = None,
               ) -> dict[str, list[dict[str, Any]]]:
    """Workload key (or "*" for every row) -> the parameter dicts to try (a store's: its
    decode elites on ``arch``, rank 1 first)."""
    found: dict[str, list[dict[str, Any]]] = {}
    if args.points:
        data = json.loads(Path(args.points).read_text())
        if isinstance(data, list):
            found["*"] = data
        else:
            found.update({k: list(v) for k, v in data.items()})
    if args.store:
        from evoengine.store import Store

        store = Store(args.store, create=False)
        for elite in sorted(store.elites(arch=arch), key=lambda e: e.rank):
            if not elite.workload_key.startswith("decode-"):
                continue
            cand = store.candidate(elite.identity)
            if cand is not None:
                found.setdefault(elite.workload_key, []).append(dict(cand.params))
    if not found:
        raise SystemExit("give --points or --store")
    if "*" not in found:
        union: list[dict[str, Any]] = []
        for ps in found.values():
            union += [p for p in ps if p not in union]
        found["*"] = union
    return found


def run_row(w: DecodeWorkload, params: list[dict[str, Any]], args: argparse.Namespace,
            arch: Any) -> dict[str, Any]:
    import torch

    from evoengine import measure, paths
    from evoengine.compile import compile_many, compile_source
    from evoengine.decode import DecodeKernel
    from evoengine.render import make_candidate, render
    from evoengine.space import SearchSpace

    problem = Decode()
    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()  # points may name them
    kernels, rejected, cands = [], {}, []
    for p in params:
        p = space.complete(p)
        bad = space.violations(p, w.problem(), arch)
        if bad:
            rejected[str(p)] = bad[0]
            continue
        cands.append(make_candidate(space, p, w.problem(), arch))
    builds = [(cand, compiled, "") for cand, compiled in
              zip(cands, compile_many(cands, arch), strict=True)]  # in parallel
    if args.base_templates:
        builds += [(c, compile_source(render(c, args.base_templates), arch, c.defines(arch),
                                      identity=f"{c.identity}@base", smem_bytes=c.smem_bytes),
                    "@base") for c in cands]
    for cand, compiled, tag in builds:
        if not compiled.ok:
            rejected[cand.identity + tag] = compiled.error
            continue
        kernel = DecodeKernel(cand, compiled)
        kernel.name += tag
        if args.check:
            verdict = problem.check(kernel, w)
            if not verdict.ok:
                rejected[kernel.name] = verdict.reason
                continue
        kernels.append(kernel)
    sets = problem.inputs(w)
    timing = dict(graph=True, reps=args.reps)
    ours: dict[str, list[float]] = {k.name: [] for k in kernels}
    anchors: dict[str, list[float]] = {a: [] for a in problem.anchors}
    graphed: dict[str, bool] = {}
    copies: list[float] = []
    kernel_copies: list[float] = []  # the same bytes by an elementwise kernel
    for _ in range(args.rounds):
        copies.append(time_copy(w, sets, **timing).median_us)
        kernel_copies.append(time_copy(w, sets, kernel=True, **timing).median_us)
        for k in kernels:
            ours[k.name].append(measure.time_calls(problem.timed_call(k, w, sets), len(sets),
                                                   **timing).median_us)
        for a in problem.anchors:
            if a in anchors and (a not in graphed or anchors[a]):
                t = problem.time_anchor(a, w, sets, **timing)
                if t is None:
                    anchors[a] = []
                    graphed[a] = False
                    continue
                anchors[a].append(t.median_us)
                graphed[a] = t.graph
    del sets
    torch.cuda.empty_cache()
    med = {name: statistics.median(v) for name, v in ours.items() if v}
    own = {name: t for name, t in med.items() if not name.endswith("@base")}
    anchor_us = {a: statistics.median(v) for a, v in anchors.items() if v}
    memcpy_us, kernel_copy_us = statistics.median(copies), statistics.median(kernel_copies)
    copy_us = min(memcpy_us, kernel_copy_us)
    row: dict[str, Any] = dict(
        workload=w.key(), batch=w.batch, cache_len=w.cache_len, q_len=w.q_len,
        q_heads=w.q_heads, kv_heads=w.kv_heads, head_dim=w.head_dim, layout=w.layout,
        page_size=w.page_size, dtype=w.dtype, kv_bytes=w.kv_bytes(), copy_us=copy_us,
        copy_memcpy_us=memcpy_us, copy_kernel_us=kernel_copy_us,
        anchors_us=anchor_us, anchors_graph=graphed, points_us=med, rejected=rejected)
    if own:
        best = min(own, key=own.get)  # type: ignore[arg-type]
        row.update(ours_us=own[best], point=best,
                   bandwidth_fraction=bandwidth_fraction(w, own[best], copy_us),
                   ours_gbps=w.kv_bytes() / own[best] / 1e3)
    if anchor_us:
        a = min(anchor_us, key=anchor_us.get)  # type: ignore[arg-type]
        row.update(best_anchor=a, best_anchor_us=anchor_us[a])
        if own:
            row["vs_best_anchor"] = anchor_us[a] / row["ours_us"]
    return row


def summary(rows: list[dict[str, Any]]) -> str:
    timed = [r for r in rows if "ours_us" in r]
    big = [r["bandwidth_fraction"] for r in timed if r["batch"] * r["cache_len"] >= 256 * 1024]
    one = [r["bandwidth_fraction"] for r in timed if r["batch"] == 1 and r["cache_len"] == 32768]
    beat = [r for r in timed if "vs_best_anchor" in r]
    parts = [f"{len(timed)} rows timed"]
    if big:
        parts.append(f"bandwidth fraction {min(big):.3f}-{max(big):.3f} (median "
                     f"{statistics.median(big):.3f}) where batch x cache >= 256K")
    if one:
        parts.append(f"{min(one):.3f}-{max(one):.3f} at batch 1, cache 32K")
    if beat:
        wins = sum(r["vs_best_anchor"] >= 1.0 for r in beat)
        parts.append(f"at least as fast as the best anchor on {wins} of {len(beat)} rows "
                     f"(best anchor / ours {min(r['vs_best_anchor'] for r in beat):.2f}-"
                     f"{max(r['vs_best_anchor'] for r in beat):.2f})")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", help="JSON: a list of parameter dicts, or key -> list")
    p.add_argument("--store", help="a store whose decode elites are the points")
    p.add_argument("--out", help="write the rows here (JSON with the provenance header)")
    p.add_argument("--workloads", nargs="+", metavar="KEY",
                   help="decode workload keys to time instead of the grid")
    p.add_argument("--q-len", type=int, nargs="+", default=list(GRID["q_len"]))
    p.add_argument("--heads", type=int, nargs="+", help="query heads (32, 64) to keep")
    p.add_argument("--batch", type=int, nargs="+", default=list(GRID["batch"]))
    p.add_argument("--cache", type=int, nargs="+", default=list(GRID["cache"]))
    p.add_argument("--layout", nargs="+", choices=GRID["layout"], default=list(GRID["layout"]))
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--base-templates", type=Path, metavar="DIR",
                   help="also build each point from these templates and time it beside")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the criterion (points already validated on these rows)")
    args = p.parse_args(argv)

    from evoengine import measure, provenance
    from evoengine.runtime import gpu_arch

    arch = gpu_arch()
    points = points_for(args, arch.name)
    rows = []
    print(f"{'workload':<48} {'ours us':>9} {'copy us':>9} {'bw frac':>8} "
          f"{'anchor':>7} {'anchor us':>10} {'x':>6}")
    def write() -> str:
        text = summary(rows)
        if args.out:  # after every row: a run cut short keeps what it timed
            doc = provenance.header(**provenance.local_device(), method=(
                f"{Decode().method()}; {args.rounds} rounds interleaved, median of the rounds' "
                f"medians ({args.reps} reps each); copy: the faster of torch copy_ and an "
                "elementwise kernel (torch.neg) moving the K and V bytes into one buffer; "
                f"{measure.INPUTS}"
                + (f"; each point also built from {args.base_templates} and timed beside "
                   "(@base)" if args.base_templates else "")),
                summary=text, checked=args.check, rows=rows)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        return text

    for w in grid(args):
        row = run_row(w, points.get(w.key(), points["*"]), args, arch)
        rows.append(row)
        print(f"{w.key():<48} {row.get('ours_us', float('nan')):9.1f} {row['copy_us']:9.1f} "
              f"{row.get('bandwidth_fraction', float('nan')):8.3f} "
              f"{row.get('best_anchor', '-'):>7} {row.get('best_anchor_us', float('nan')):10.1f} "
              f"{row.get('vs_best_anchor', float('nan')):6.2f}", flush=True)
        for what, why in row["rejected"].items():
            print(f"  rejected {what}: {why}")
        write()
    print(write())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
