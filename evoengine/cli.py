"""The ``evoengine`` command: a thin layer over the Python API.

Every subcommand turns a user mistake (bad arch, bad shape, missing file, no GPU) into one
line on stderr and exit status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from evoengine import __version__, paths
from evoengine.arch import ARCHS, get_arch

# A replay never writes into the default store: its measurements are not this machine's.
REPLAY_STORE = f"sqlite:///{paths.REPLAY_STORE}"


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


def _spaces(paths: Sequence[str] | None) -> list:
    from evoengine.space import SearchSpace, default_spaces

    return [SearchSpace.load(p) for p in paths] if paths else default_spaces()


# ---- compile-check ------------------------------------------------------------------------

def cmd_compile_check(args: argparse.Namespace) -> int:
    from evoengine.compile import compile_many, nvrtc_version
    from evoengine.render import make_candidate
    from evoengine.space import spread

    arch = get_arch(args.arch)
    spaces = _spaces(args.space)
    if not any(s.supports(arch) for s in spaces):
        raise UsageError(f"no search space targets {arch.name}")
    points = spread(spaces, arch, args.limit, args.seed)
    cands = [make_candidate(space, params, problem, arch) for space, problem, params in points]
    if not args.json:
        print(f"compiling {len(cands)} candidates for {arch.name} with {nvrtc_version()}",
              file=sys.stderr)
    start = time.perf_counter()
    reports = []
    for i, (cand, result) in enumerate(zip(cands, compile_many(cands, arch, args.workers),
                                           strict=True)):
        reports.append({"identity": cand.identity, "family": cand.family,
                        "problem": cand.problem, "params": cand.params, **result.report()})
        if not args.json:
            status = (f"regs {result.registers:3d}  spill {result.spill_bytes:4d}  "
                      f"smem {result.smem_bytes:6d}" if result.ok else f"ERROR {result.error}")
            print(f"[{i + 1:3d}/{len(cands)}] {result.seconds:5.2f}s  {status}  {cand.identity}")
    ok = sum(r["ok"] for r in reports)
    summary = {"arch": arch.name, "compiler": nvrtc_version(), "candidates": len(reports),
               "compiled": ok, "failed": len(reports) - ok,
               "seconds": round(time.perf_counter() - start, 2)}
    if args.json:
        json.dump({"summary": summary, "candidates": reports}, sys.stdout, indent=1)
        print()
    else:
        print(f"{ok}/{len(reports)} compiled for {arch.name} in {summary['seconds']} s")
    return 0


# ---- store views --------------------------------------------------------------------------

def _open_store(url: str | None):  # type: ignore[no-untyped-def]
    from evoengine.store import Store

    if url is None and not Path("runs/evoengine.db").exists():
        raise UsageError("no store at runs/evoengine.db; run `evoengine search` first "
                         "or pass --store")
    return Store(url)


def cmd_list(args: argparse.Namespace) -> int:
    with _open_store(args.store) as store:
        if args.what == "runs":
            rows = [{"id": r.id, "created": r.created_at.isoformat(timespec="seconds"),
                     "status": r.status, "arch": r.arch, "study": r.study,
                     "workload": r.workload_key} for r in store.runs(limit=args.limit)]
        elif args.what == "candidates":
            rows = [{"identity": c.identity, "family": c.family,
                     "compiled": {a: r.ok for a, r in c.compile_reports.items()}}
                    for c in store.candidates(family=args.family, limit=args.limit)]
        else:
            rows = [{"arch": e.arch, "workload": e.workload_key, "rank": e.rank,
                     "median_us": e.median_us, "identity": e.identity}
                    for e in store.elites(arch=args.arch)][: args.limit]
    if args.json:
        json.dump(rows, sys.stdout, indent=1, default=str)
        print()
    elif not rows:
        print(f"no {args.what} in the store")
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _open_store(args.store) as store:
        cand = store.candidate(args.identity)
        if cand is None:
            raise UsageError(f"no candidate {args.identity!r} in {store.url}")
        measurements = store.measurements(identity=args.identity)
    if args.source:
        print(cand.source)
        return 0
    print(f"identity  {cand.identity}\nfamily    {cand.family}\ntemplate  {cand.template_hash}")
    print(f"problem   {json.dumps(cand.problem)}\nparams    {json.dumps(cand.params)}")
    for arch, r in cand.compile_reports.items():
        print(f"compile   {arch}: " + (f"regs {r.registers}, spill {r.spill_bytes}, smem "
                                       f"{r.smem_bytes}, {r.compile_seconds:.2f}s" if r.ok
                                       else f"error {r.error}"))
    for m in measurements:
        print(f"run {m.run_id}   " + (f"{m.median_us:.1f} us +- {m.spread_us:.1f}" if m.ok
                                      else f"failed: {m.reason}"))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from evoengine import paths
    from evoengine.search.replay import record_from_store, save_record

    arch = get_arch(args.arch)
    workload = _workload(args)
    with _open_store(args.store) as store:
        record = record_from_store(store, arch.name, workload.key(), run_ids=args.run,
                                   note=args.note)
    output = args.output or paths.ROOT / "tests" / "data" / f"sweep-{record.key()}.json.gz"
    save_record(record, output)
    print(f"{record.describe()}\nwritten to {output}")
    return 0


# ---- GPU commands -------------------------------------------------------------------------

def cmd_search(args: argparse.Namespace) -> int:
    import signal

    from evoengine.search import (
        EvaluatorError,
        SearchConfig,
        SearchError,
        default_study,
        elite_table,
        search,
    )

    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be at least 1, got {args.trials}")
    if args.heartbeat < 1:
        raise UsageError(f"--heartbeat must be at least 1 second, got {args.heartbeat}")
    spaces = _spaces(args.space)  # reject a bad workload or space before looking for a GPU
    run_kw: dict = {}
    if args.replay:
        workload, arch, run_kw = _replay(args, spaces)
    else:
        if args.shape is None:
            raise UsageError("search needs --shape B,H,S,D (or --replay FILE)")
        workload = _workload(args)
        arch = get_arch(args.arch) if args.arch else None
        _cuda_or_fail("search")
    trials = args.trials if args.trials is not None or args.timeout is not None else 100
    store = args.store or (REPLAY_STORE if args.replay else None)
    config = SearchConfig(workload=workload, spaces=spaces, arch=arch, store=store,
                          study=args.study, strategy=args.sampler, trials=trials,
                          timeout_s=args.timeout, seed=args.seed, compile_workers=args.workers,
                          eval_timeout_s=args.eval_timeout, device=args.device or 0,
                          gpus=args.gpus, heartbeat_s=args.heartbeat,
                          grace_s=3 * args.heartbeat, refresh_s=min(10.0, args.heartbeat))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        budget = f"{trials} trials" if trials else f"{args.timeout:.0f} s"
        study = args.study or (default_study(arch, workload) if arch else "(named by device)")
        where = f"replay of {args.replay}" if args.replay else "this GPU"
        print(f"searching {workload.key()} on {arch.name if arch else where}, study "
              f"{study}, {budget}" + (f" ({where})" if args.replay else ""), file=sys.stderr)
        result = search(config, **run_kw)
    except (SearchError, EvaluatorError) as e:
        raise UsageError(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    t = result.tally
    print(elite_table(result.rows))
    rate = t.evals_per_minute()
    per_gpu = ", ".join(f"GPU {d}: {n}" for d, n in t.per_gpu.items())
    print(f"\nstudy {result.study}, run {result.run_id} ({result.status}"
          f"{': ' + result.stopped_because if result.stopped_because else ''}): "
          f"{t.evaluated} evaluated, {t.valid} valid, {t.compile_failed} compile errors, "
          f"{t.faults} faults; {t.cold_compiles} compiled, {t.cached_compiles} from cache"
          + (f"; {rate:.0f} evals/min" if rate else "")
          + (f" ({per_gpu})" if len(t.per_gpu) > 1 else ""), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result.evidence(), indent=1) + "\n")
    return 130 if result.status == "interrupted" else 0


def _workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from evoengine.workload import Workload

    return Workload.parse(args.shape, kv_heads=args.kv_heads, seq_k=args.seq_k,
                          causal=args.causal, dtype=args.dtype)


def _replay(args: argparse.Namespace, spaces: list):  # type: ignore[no-untyped-def]
    """The workload, arch and search() arguments of ``--replay FILE``: no GPU, no NVRTC."""
    from evoengine.search.replay import (
        ReplayEvaluator,
        load_record,
        replay_compile,
        replay_domain,
    )

    record = load_record(args.replay)
    if args.shape is not None and _workload(args) != record.workload:
        raise UsageError(f"{args.replay} records {record.workload.key()}, but the flags ask "
                         f"for {_workload(args).key()}; drop --shape to take the record's")
    if args.arch is not None and get_arch(args.arch).name != record.arch:
        raise UsageError(f"{args.replay} records {record.arch}, not {get_arch(args.arch).name}")
    if record.synthetic:
        print(f"evoengine: {args.replay} is SYNTHETIC (a cost model, not measurements)",
              file=sys.stderr)
    evaluator = ReplayEvaluator(record, delay_s=args.replay_delay)
    return record.workload, get_arch(record.arch), {
        "evaluator": evaluator, "compile_fn": replay_compile(record),
        "domain": replay_domain(record, spaces if args.space else None)}


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _cuda_or_fail(command: str) -> None:
    """Whether torch sees a CUDA GPU, without creating a context in this process."""
    try:
        import torch
    except ImportError:
        raise UsageError(f"{command} needs a CUDA GPU: torch is not installed") from None
    if not torch.cuda.is_available():
        raise UsageError(f"{command} needs a CUDA GPU: no CUDA GPU is visible to torch")


def cmd_export(args: argparse.Namespace) -> int:
    from evoengine.export import DEFAULT_STORE, export_best
    from evoengine.runtime import NoGPUError, gpu_arch

    if args.arch is not None:
        arch = get_arch(args.arch)
    else:
        try:
            arch = gpu_arch()
        except NoGPUError as e:
            raise UsageError(f"export needs a CUDA GPU to pick the target ({e}); name one "
                             "with --arch, e.g. --arch sm_90a: cubins compile offline") from None
    done = export_best(args.store or DEFAULT_STORE, arch, study=args.study, output=args.output)
    print(done.summary())
    return 0


# ---- parser -------------------------------------------------------------------------------

def _duration(text: str) -> float:
    """Seconds from '90', '90s', '10m' or '2h'."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 90s, 10m, 2h)") from None


def _gpu_list(text: str) -> list[int]:
    """Device indices from '0,1,3': distinct, non-negative."""
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of GPU indices: {text!r} "
                                         "(try 0,1)") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"GPU indices must be distinct and >= 0: {text!r}")
    return devices


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evoengine",
        description="Search for the fastest correct attention kernel for a GPU and workload.",
    )
    p.add_argument("--version", action="version", version=f"evoengine {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    archs = ", ".join(ARCHS)

    c = sub.add_parser("compile-check", help="compile a sample of the spaces offline (no GPU)",
                       description="Render candidates the constraints admit and compile each "
                       "with NVRTC for the target, without a GPU. Reports registers, spills, "
                       "shared memory and compile time, or the compiler's error. Exits 0 "
                       "whatever the candidates did.")
    c.add_argument("--arch", required=True, help=f"target ({archs})")
    c.add_argument("--space", action="append", metavar="FILE",
                   help="search-space file (repeatable; default: all of search_spaces/)")
    c.add_argument("--limit", type=int, default=None, metavar="N",
                   help="compile N candidates spread over families and problems (default all)")
    c.add_argument("--seed", type=int, default=0, help="which spread of candidates (default 0)")
    c.add_argument("--workers", type=int, default=None, help="compiler processes (default: cores)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_compile_check)

    s = sub.add_parser("search", help="search for the fastest kernel on this GPU",
                       description="Evolve candidates on the GPU: compile, validate against "
                       "SDPA's criterion, time, keep the elites in the store. Running the same "
                       "study again resumes it.")
    s.add_argument("--arch", help="target (default: the GPU present)")
    s.add_argument("--shape", metavar="B,H,S,D",
                   help="batch, query heads, query length, head dim (required unless --replay)")
    s.add_argument("--kv-heads", type=int, help="key/value heads (default: H)")
    s.add_argument("--seq-k", type=int, help="key length (default: S)")
    s.add_argument("--causal", action="store_true", help="causal mask, aligned bottom-right")
    s.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    budget = s.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=int, help="trials to run now (default 100)")
    budget.add_argument("--timeout", type=_duration, help="wall-clock budget (90s, 10m, 2h)")
    s.add_argument("--space", action="append", metavar="FILE", help="search-space file(s)")
    s.add_argument("--store", metavar="URL", help="SQLAlchemy URL (default sqlite:///runs/evoengine.db)")
    s.add_argument("--study", help="study name (default: derived from arch and workload)")
    s.add_argument("--sampler", choices=["evo", "nsga2", "tpe", "random"], default="evo",
                   help="strategy: evo (genetic, default), nsga2, tpe or random")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--workers", type=int, default=None,
                   help="compiler processes (default: cores - 1)")
    s.add_argument("--eval-timeout", type=_duration, default=30.0, metavar="SECONDS",
                   help="a candidate with no answer after this long is a hang (default 30s)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--device", type=int, default=None,
                       help="CUDA device index (default 0)")
    where.add_argument("--gpus", type=_gpu_list, metavar="I,J,...",
                       help="one evaluator per listed GPU, fed by one compile pool and one "
                       "sampler (e.g. --gpus 0,1); not with --device")
    s.add_argument("--heartbeat", type=int, default=60, metavar="SECONDS",
                   help="heartbeat of running trials; a worker silent for 3x this (killed, "
                   "host lost) has its trials failed and their points retried (default 60)")
    s.add_argument("--json", metavar="FILE", help="write the results JSON (device, rows...)")
    s.add_argument("--replay", metavar="FILE",
                   help="no GPU: answer from a recorded sweep (evoengine record); the "
                   f"workload and arch are the record's; --store defaults to {REPLAY_STORE}")
    s.add_argument("--replay-delay", type=_duration, default=0.0, metavar="SECONDS",
                   help="with --replay, sleep this long per evaluation (default 0)")
    s.set_defaults(func=cmd_search)

    r = sub.add_parser("record", help="write a recorded sweep from the store (for --replay)",
                       description="Export the search-phase measurements of one workload on one "
                       "target as a replay record (gzip'd JSON, format in "
                       "evoengine/search/replay.py): every point once, failures with their "
                       "reason, with the device, driver, date and commit of the runs.")
    r.add_argument("--store", metavar="URL", help="SQLAlchemy URL (default runs/evoengine.db)")
    r.add_argument("--arch", default="sm_90a", help="target (default sm_90a)")
    r.add_argument("--shape", required=True, metavar="B,H,S,D")
    r.add_argument("--kv-heads", type=int, help="key/value heads (default: H)")
    r.add_argument("--seq-k", type=int, help="key length (default: S)")
    r.add_argument("--causal", action="store_true")
    r.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    r.add_argument("--run", type=int, action="append", metavar="ID",
                   help="only these runs (repeatable; default: every run of the workload)")
    r.add_argument("--note", default="", help="how the sweep was run, kept in the record")
    r.add_argument("-o", "--output", metavar="FILE",
                   help="default tests/data/sweep-<arch>-<workload key>.json.gz")
    r.set_defaults(func=cmd_record)

    e = sub.add_parser("export", help="write the best kernels as a standalone module",
                       description="Write one self-contained Python module (cupy + torch only) "
                       "holding the elites' sources, cubins and a dispatch table.")
    e.add_argument("which", choices=["best"], help="what to export")
    e.add_argument("--arch", help=f"target ({archs}; default: the GPU present)")
    e.add_argument("--store", metavar="URL",
                   help="SQLAlchemy URL or SQLite file (default runs/evoengine.db)")
    e.add_argument("--study", help="only elites found by runs of this study")
    e.add_argument("-o", "--output", default="tuned_attention.py",
                   help="the module to write (default tuned_attention.py)")
    e.set_defaults(func=cmd_export)

    ls = sub.add_parser("list", help="list runs, candidates or elites in the store")
    ls.add_argument("what", nargs="?", choices=["runs", "candidates", "elites"], default="runs")
    ls.add_argument("--store", metavar="URL")
    ls.add_argument("--family")
    ls.add_argument("--arch")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)

    sh = sub.add_parser("show", help="show one candidate: parameters, compile reports, timings")
    sh.add_argument("identity")
    sh.add_argument("--store", metavar="URL")
    sh.add_argument("--source", action="store_true", help="print the rendered CUDA source")
    sh.set_defaults(func=cmd_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"evoengine: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError) as e:  # SpaceError is a ValueError
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"evoengine: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("evoengine: interrupted", file=sys.stderr)
        return 130
