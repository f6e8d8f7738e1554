"""Search strategies on recorded sweeps: evaluations until within 2% of the recorded optimum.

    python benchmarks/strategies.py                       # every tests/data/sweep-*.json.gz
    python benchmarks/strategies.py RECORD [RECORD ...] --seeds 20 --json out.json
    python benchmarks/strategies.py --synthetic 16,16,2048,64,causal   # development only

For each record and strategy (``evo``, our default; ``tpe``; ``random``; ``kt-ga``, Kernel
Tuner's ``genetic_algorithm`` in its simulation mode on the same data), and seeds 0..N-1,
count the evaluations until the best valid time found is within ``--within`` (2%) of the
record's optimum; report the median and interquartile range over the seeds, and the ratios
the targets name (evo at most half of random's, and no more than Kernel Tuner's GA).

Our strategies run the search users run: ``evoengine.search.search``, the loop of
``evoengine search --replay``, on the record's ``replay_domain``, ``ReplayEvaluator`` and
``replay_compile``, each run in a fresh SQLite store with the seed, ``trials`` = the budget
and ``target_us`` = the target (the loop stops starting trials once it has measured a time
within it). **An evaluation** is one search-phase measurement in that store: a distinct
point the strategy had built, compile errors, wrong answers and faults included (each costs
a compile and a GPU slot in a real search); proposals the space rejects and repeats answered
from the store are not measured (the loop gives up after ``MAX_IDLE_PROPOSALS`` of them in a
row). The count is the position, in the order the store took them, of the first measurement
within the target. As in a real search, the loop proposes up to ``min(max(4, 2 x compile
workers), 32)`` points ahead of their results (``--workers``, default 1), and which results
a sampler has seen when it proposes depends on when the compiler processes and the GPU
thread answer, so a seed's count is not guaranteed to repeat exactly. For Kernel Tuner: the
distinct configurations in its results, in order, failures included (its simulation runner
counts the same against ``max_fevals``).

Kernel Tuner gets a cache file written from the record and a search space equal to ours
(asserted): a ``family`` parameter plus every family's parameters (``mma.BLOCK_M``...),
where a parameter of another family holds its first value, with restrictions admitting
exactly the recorded points. Its failures are cached as
``CompilationFailedConfig`` / ``RuntimeFailedConfig``, as its own runner records them. Its
options are its defaults; ``max_fevals`` is the budget; Python's and NumPy's random state are
seeded per run (``tune_kernel`` has no seed of its own).

A run that does not get within the target in the budget (or whose strategy stops first) is
censored: it counts as more than the budget in the median and is reported as not reached.
Results on a SYNTHETIC record are for developing this script, never findings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengine import paths  # noqa: E402
from evoengine.search import Progress, SearchConfig, search  # noqa: E402
from evoengine.search.domain import Domain  # noqa: E402
from evoengine.search.replay import (  # noqa: E402
    Record,
    ReplayEvaluator,
    load_record,
    replay_compile,
    replay_domain,
    save_record,
)
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.store import Store  # noqa: E402

STRATEGIES = ("evo", "tpe", "random", "kt-ga")
EXTRA = ("nsga2",)  # Optuna's NSGA-II, which the search also runs
WITHIN = 0.02
KT_KERNEL = "evoengine_attention"


def optimum(record: Record, domain: Domain) -> float:
    """The fastest recorded valid time among the domain's points."""
    times = [p.median_us for f, params in domain.all_points()
             if (p := record.lookup(f, params)) is not None and p.ok]
    if not times:
        raise ValueError(f"{record.describe()}: no valid point in the domain")
    return min(times)  # type: ignore[type-var,return-value]


# ---- our strategies -------------------------------------------------------------------------

def run_ours(strategy: str, domain: Domain, record: Record, seed: int, budget: int,
             target_us: float, workdir: Path, *, workers: int = 1,
             keep: bool = True) -> int | None:
    """Evaluations until a valid time <= target_us, or None if not within the budget: one
    run of the search loop on the replay of ``record`` (which must be saved to a file), in a
    fresh store ``workdir/<strategy>-seed<seed>.db``, kept for inspection if ``keep``."""
    path = workdir / f"{strategy}-seed{seed}.db"
    _remove_store(path)
    url = f"sqlite:///{path}"
    config = SearchConfig(workload=record.workload, spaces=list(domain.spaces.values()),
                          arch=domain.arch, store=url, strategy=strategy, trials=budget,
                          target_us=target_us, seed=seed, compile_workers=workers)
    result = search(config, evaluator=ReplayEvaluator(record), domain=domain,
                    compile_fn=replay_compile(record), progress=Progress(1.0, quiet=True))
    with Store(url) as store:
        measured = [m for m in store.measurements(run_id=result.run_id)
                    if m.extra.get("phase") == "search"]
    if not keep:
        _remove_store(path)
    for count, m in enumerate(measured[:budget], start=1):
        if m.ok and m.median_us is not None and m.median_us <= target_us:
            return count
    return None


def _remove_store(path: Path) -> None:
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)


def scratch_dir() -> str | None:
    """Where the runs' stores go by default: a RAM file system where there is one. Each
    SQLite commit there costs no disk flush, which would otherwise take most of a run's
    time; what is counted (evaluations) does not depend on it."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


# ---- Kernel Tuner ---------------------------------------------------------------------------

def kt_space(domain: Domain, record: Record) -> tuple[dict[str, list[Any]], list[Any],
                                                        dict[str, dict[str, Any]]]:
    """Kernel Tuner's tune_params, restrictions and cache entries for the domain's points."""
    from kernel_tuner.util import CompilationFailedConfig, RuntimeFailedConfig

    tune_params: dict[str, list[Any]] = {"family": list(domain.families)}
    placeholder: dict[str, Any] = {}
    for family, space in domain.spaces.items():
        for name, values in space.parameters.items():
            tune_params[f"{family}.{name}"] = list(values)
            placeholder[f"{family}.{name}"] = values[0]
    restrictions: list[Any] = []
    for family, space in domain.spaces.items():
        names = [f"{family}.{n}" for n in space.parameters]
        admitted = {tuple(p[n] for n in space.parameters) for p in domain.points[family]}
        restrictions.append(_rule(["family", *names], _admits(family, admitted)))
        for name in names:
            restrictions.append(_rule(["family", name],
                                      _placeholder_elsewhere(family, placeholder[name])))
    cache: dict[str, dict[str, Any]] = {}
    for family, params in domain.all_points():
        flat = flat_config(domain, family, params, placeholder)
        p = record.lookup(family, params)
        assert p is not None
        entry: dict[str, Any] = dict(zip(tune_params, flat, strict=True))
        if p.ok:
            entry["time"] = p.median_us / 1000.0  # type: ignore[operator]  # KT reports ms
            entry["times"] = [entry["time"]]
        else:
            entry["time"] = str(RuntimeFailedConfig() if p.compiled else CompilationFailedConfig())
        entry.update(compile_time=0.0, verification_time=0.0, benchmark_time=0.0)
        cache[",".join(str(v) for v in flat)] = entry
    return tune_params, restrictions, cache


def _rule(names: list[str], check: Any) -> Any:
    """A python-constraint constraint on ``names`` that Kernel Tuner applies to the whole
    configuration: it holds until all of ``names`` are assigned, so the solver prunes early
    (Kernel Tuner drops ``(function, names)`` restrictions it cannot parse as lambdas)."""
    from constraint import Constraint

    class Rule(Constraint):
        def __call__(self, variables: Any, domains: Any, assignments: dict[str, Any],
                     forwardcheck: bool = False, *_: Any) -> bool:
            if any(n not in assignments for n in names):
                return True
            return bool(check(*(assignments[n] for n in names)))

    return Rule()


def _admits(family: str, admitted: set[tuple[Any, ...]]) -> Any:
    def check(fam: str, *values: Any) -> bool:
        return fam != family or values in admitted
    return check


def _placeholder_elsewhere(family: str, value: Any) -> Any:
    def check(fam: str, v: Any) -> bool:
        return fam == family or (type(v) is type(value) and v == value)
    return check


def flat_config(domain: Domain, family: str, params: dict[str, Any],
                placeholder: dict[str, Any]) -> tuple[Any, ...]:
    out: list[Any] = [family]
    for f, space in domain.spaces.items():
        for name in space.parameters:
            out.append(params[name] if f == family else placeholder[f"{f}.{name}"])
    return tuple(out)


class KernelTuner:
    """Kernel Tuner's genetic algorithm in simulation mode on one record."""

    def __init__(self, domain: Domain, record: Record, workdir: Path) -> None:
        self.domain = domain
        self.tune_params, self.restrictions, cache = kt_space(domain, record)
        self.problem_size = (record.workload.batch * record.workload.heads,
                             record.workload.seq_q)
        self.path = workdir / f"kt-cache-{record.key()}.json"
        self.path.write_text(json.dumps({
            "device_name": record.device, "kernel_name": KT_KERNEL,
            "problem_size": list(self.problem_size),
            "tune_params_keys": list(self.tune_params), "tune_params": self.tune_params,
            "objective": "time", "cache": cache}))

    def check_space(self) -> None:
        """Kernel Tuner's search space holds exactly the domain's points."""
        from kernel_tuner.searchspace import Searchspace

        space = Searchspace(self.tune_params, self.restrictions, 1_000_000_000)
        placeholder = {k: v[0] for k, v in self.tune_params.items()}
        ours = {flat_config(self.domain, f, p, placeholder) for f, p in self.domain.all_points()}
        theirs = {tuple(c) for c in space.list}
        if theirs != ours:
            raise AssertionError(f"Kernel Tuner's space has {len(theirs)} points, ours "
                                 f"{len(ours)}; {len(theirs ^ ours)} differ")

    def run(self, seed: int, budget: int, target_us: float,
            strategy: str = "genetic_algorithm") -> int | None:
        import kernel_tuner
        import numpy as np

        random.seed(seed)
        np.random.seed(seed)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            results, _ = kernel_tuner.tune_kernel(
                KT_KERNEL, "", self.problem_size, [], self.tune_params,
                restrictions=self.restrictions, cache=str(self.path), simulation_mode=True,
                strategy=strategy, strategy_options={"max_fevals": budget}, objective="time",
                objective_higher_is_better=False, quiet=True, verbose=False)
        seen: set[tuple[Any, ...]] = set()
        for r in results:
            config = tuple(r[k] for k in self.tune_params)
            if config in seen:
                continue
            seen.add(config)
            if len(seen) > budget:
                break
            if "__error__" not in r and r["time"] * 1000.0 <= target_us * (1 + 1e-12):
                return len(seen)
        return None


# ---- the benchmark --------------------------------------------------------------------------

def summarize(counts: Sequence[int | None], budget: int) -> dict[str, Any]:
    """Median and quartiles, censored runs counted as more than the budget (inf)."""
    values = sorted(math.inf if c is None else c for c in counts)

    def q(p: float) -> float:
        return float(statistics.quantiles(values, n=4, method="inclusive")[int(p * 4) - 1]
                     if len(values) > 1 else values[0])

    med = statistics.median(values)
    return {"evaluations": list(counts), "reached": sum(c is not None for c in counts),
            "runs": len(counts), "median": None if math.isinf(med) else med,
            "q1": None if math.isinf(q(0.25)) else q(0.25),
            "q3": None if math.isinf(q(0.75)) else q(0.75), "budget": budget}


def benchmark(record: Record, strategies: Sequence[str], seeds: int, budget: int | None,
              within: float = WITHIN, *, spaces: Sequence[SearchSpace] | None = None,
              workdir: Path | None = None, workers: int = 1,
              log: Any = sys.stderr) -> dict[str, Any]:
    """Every strategy on ``record`` for seeds 0..seeds-1 (``spaces``: default all). The
    stores of our strategies' runs, and Kernel Tuner's cache, are written in ``workdir``
    and kept there (default: a temporary folder in ``scratch_dir()``, removed as it goes)."""
    domain = replay_domain(record, spaces)
    best = optimum(record, domain)
    target = best * (1 + within)
    budget = min(budget or len(domain), len(domain))
    out: dict[str, Any] = {
        "record": record.path, "describe": record.describe(), "synthetic": record.synthetic,
        "device": record.device, "date": record.date, "commit": record.commit,
        "arch": record.arch, "workload": record.workload.key(), "domain": len(domain),
        "skipped_points": len(domain.skipped), "optimum_us": best, "within": within,
        "target_us": target, "budget": budget, "seeds": seeds, "compile_workers": workers,
        "points_within": sum(1 for f, p in domain.all_points()
                             if (r := record.lookup(f, p)) is not None and r.ok
                             and r.median_us <= target),  # type: ignore[operator]
        "strategies": {},
    }
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        work = Path(workdir or tmp)
        replayed = record
        if record.path is None:  # the search's compiler processes read the record from a file
            replayed = load_record(save_record(record, work / f"record-{record.key()}.json.gz"))
        kt = None
        for strategy in strategies:
            start = time.perf_counter()
            if strategy == "kt-ga":
                kt = kt or KernelTuner(domain, record, work)
                kt.check_space()
                counts = [kt.run(s, budget, target) for s in range(seeds)]
            else:
                counts = [run_ours(strategy, domain, replayed, s, budget, target, work,
                                   workers=workers, keep=workdir is not None)
                          for s in range(seeds)]
            out["strategies"][strategy] = {**summarize(counts, budget),
                                           "seconds": round(time.perf_counter() - start, 1)}
            print(f"  {strategy:7s} {_fmt(out['strategies'][strategy])}", file=log)
    s = out["strategies"]

    def ratio(a: str, b: str) -> float | None:
        if a in s and b in s and s[a]["median"] and s[b]["median"]:
            return s[a]["median"] / s[b]["median"]
        return None

    out["ratios"] = {"evo/random": ratio("evo", "random"), "evo/kt-ga": ratio("evo", "kt-ga")}
    r = out["ratios"]
    out["targets"] = {
        "evo <= random/2": None if r["evo/random"] is None else r["evo/random"] <= 0.5,
        "evo <= kt-ga": None if r["evo/kt-ga"] is None else r["evo/kt-ga"] <= 1.0,
    }
    return out


def _fmt(s: dict[str, Any]) -> str:
    med = "-" if s["median"] is None else f"{s['median']:g}"
    q1 = "-" if s["q1"] is None else f"{s['q1']:g}"
    q3 = f">{s['budget']}" if s["q3"] is None else f"{s['q3']:g}"
    return (f"median {med:>6}  IQR {q1:>6} .. {q3:<6}  reached {s['reached']}/{s['runs']}  "
            f"({s.get('seconds', 0)} s)")


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        lines.append(f"\n{res['describe']}\n  domain {res['domain']} points, optimum "
                     f"{res['optimum_us']:.2f} us, target <= {res['target_us']:.2f} us "
                     f"({res['points_within']} points), budget {res['budget']}, "
                     f"{res['seeds']} seeds")
        lines.append(f"  {'strategy':8s} {'median':>7s} {'q1':>7s} {'q3':>7s}  reached")
        for name, s in res["strategies"].items():
            cell = [("-" if s[k] is None else f"{s[k]:g}") for k in ("median", "q1", "q3")]
            lines.append(f"  {name:8s} {cell[0]:>7s} {cell[1]:>7s} {cell[2]:>7s}  "
                         f"{s['reached']}/{s['runs']}")
        r = res["ratios"]
        lines.append("  " + "  ".join(f"{k} = {'-' if v is None else f'{v:.2f}'}"
                                      for k, v in r.items()))
        lines.append("  targets: " + ", ".join(
            f"{k}: {'n/a' if v is None else ('met' if v else 'MISSED')}"
            for k, v in res["targets"].items()))
        if res["synthetic"]:
            lines.append("  SYNTHETIC record: a cost model, not measurements; not a finding")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="*", help="record files (default tests/data/sweep-*.json.gz)")
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 per strategy (default 20)")
    p.add_argument("--budget", type=int, default=None,
                   help="max evaluations per run (default: the whole domain)")
    p.add_argument("--within", type=float, default=WITHIN, help="target gap (default 0.02)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES + EXTRA)}")
    p.add_argument("--synthetic", metavar="B,H,S,D[,causal]",
                   help="use a SYNTHETIC record of this workload (development only)")
    p.add_argument("--workers", type=int, default=1,
                   help="the search's compile workers (default 1; it proposes up to "
                        "max(4, 2 x workers) points ahead of their results)")
    p.add_argument("--json", metavar="FILE", help="write the results document")
    args = p.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES + EXTRA)
    if unknown:
        p.error(f"unknown strategies {sorted(unknown)}")
    records: list[Record] = []
    if args.synthetic:
        from evoengine.search.replay import synthetic_record
        from evoengine.workload import Workload

        records.append(synthetic_record(Workload.parse_spec(args.synthetic)))
    for path in args.records or ([] if args.synthetic else
                                 sorted((paths.ROOT / "tests" / "data").glob("sweep-*.json.gz"))):
        records.append(load_record(path))
    if not records:
        p.error("no record: give files, or --synthetic for development")
    results = []
    for record in records:
        print(record.describe(), file=sys.stderr)
        results.append(benchmark(record, strategies, args.seeds, args.budget, args.within,
                                 workers=args.workers))
    print(table(results))
    if args.json:
        from evoengine.provenance import header

        doc = header(device=None, driver=None, torch=None,
                     method="replay of recorded sweeps through evoengine.search.search (no GPU); "
                     "per strategy and seed, evaluations until the best valid time is within "
                     f"{args.within:.0%} of the record's optimum; median and IQR over seeds",
                     header_note="device, driver, torch: none (a CPU replay; each record's "
                     "own device is in results[].device)", results=results)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
