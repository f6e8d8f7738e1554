"""The ``evoengine`` command: a thin layer over the Python API.

Every subcommand turns a user mistake (bad arch, bad shape, bad option value, missing file
or store, a folder or unwritable path for a file, no GPU) into one line on stderr and exit
status 2; tracebacks are for bugs only.
Every ``--store`` is named the same way (``evoengine.store.resolve_url``: a path to a SQLite
file or a SQLAlchemy URL); commands that only read refuse a store that does not exist.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from evoengine import __version__, paths
from evoengine.arch import ARCHS, Arch, get_arch
from evoengine.argtypes import (
    gpu_list,
    non_negative_duration,
    non_negative_int,
    positive_duration,
    positive_int,
)

if TYPE_CHECKING:
    from evoengine.workload import Workload

class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


def _spaces(files: Sequence[str] | None, kind: str | None) -> list:
    """The spaces named, or every shipped space of problem ``kind`` (None: every kind)."""
    from evoengine.problems import problem
    from evoengine.space import SearchSpace, default_spaces

    spaces = [SearchSpace.load(f) for f in files] if files else default_spaces(kind)
    for space in spaces:
        for kind in space.kinds or (space.kind,):
            problem(kind)  # a kind no problem is registered for is refused here
    return spaces


# ---- compile-check ------------------------------------------------------------------------

def cmd_compile_check(args: argparse.Namespace) -> int:
    from evoengine.compile import compile_many, nvrtc_version
    from evoengine.render import make_candidate
    from evoengine.space import spread

    arch = get_arch(args.arch)
    spaces = _spaces(args.space, None)
    if not any(s.supports(arch) for s in spaces):
        raise UsageError(f"no search space targets {arch.name}")
    points = spread(spaces, arch, args.limit, args.seed, head_dims=args.head_dim)
    cands = [make_candidate(space, params, problem, arch) for space, problem, params in points]
    # Problems of a family that admits no point of them: named, as no candidate says it.
    empty = [f"{s.family} " + " ".join(f"{k}={v}" for k, v in problem.items())
             for s in spaces if s.supports(arch)
             for problem in s.problems(head_dims=args.head_dim)
             if s.first_admitted(problem, arch) is None]
    if not args.json:
        print(f"compiling {len(cands)} candidates for {arch.name} with {nvrtc_version()}",
              file=sys.stderr)
        for line in empty:
            print(f"no admitted point: {line}", file=sys.stderr)
    start = time.perf_counter()
    reports = []
    for i, (cand, result) in enumerate(zip(cands, compile_many(cands, arch, args.workers),
                                           strict=True)):
        reports.append({"identity": cand.identity, "family": cand.family,
                        "problem": cand.problem, "params": cand.params, **result.report()})
        if not args.json:
            status = (f"regs {result.registers:3d}  spill {result.spill_bytes:4d}  "
                      f"smem {result.smem_bytes:6d}" if result.ok else f"ERROR {result.error}")
            if result.serialized:
                status += f"  wgmma serialized ({result.serialized})"
            print(f"[{i + 1:3d}/{len(cands)}] {result.seconds:5.2f}s  {status}  {cand.identity}")
    ok = sum(r["ok"] for r in reports)
    serialized = sum(bool(r["serialized"]) for r in reports)
    summary = {"arch": arch.name, "compiler": nvrtc_version(), "candidates": len(reports),
               "compiled": ok, "failed": len(reports) - ok, "serialized": serialized,
               "no_point": empty,
               "seconds": round(time.perf_counter() - start, 2)}
    if args.json:
        json.dump({"summary": summary, "candidates": reports}, sys.stdout, indent=1)
        print()
    else:
        print(f"{ok}/{len(reports)} compiled for {arch.name} in {summary['seconds']} s"
              + (f"; {serialized} with wgmma serialized by ptxas" if serialized else ""))
    return 0


# ---- store views --------------------------------------------------------------------------

def _missing_store(e: FileNotFoundError, given: str | None) -> UsageError:
    """A reading command's one line for a store that does not exist, with where to look."""
    hint = "run `evoengine search` first or pass --store"
    if given is None and Path(paths.REPLAY_STORE).is_file():
        hint = (f"{paths.REPLAY_STORE} holds replayed searches: pass --store "
                f"{paths.REPLAY_STORE}")
    return UsageError(f"{e}; {hint}")


def _open_store(given: str | None):  # type: ignore[no-untyped-def]
    """The store a reading command names (default runs/evoengine.db); never created here."""
    from evoengine.store import Store

    try:
        return Store(given, create=False)
    except FileNotFoundError as e:
        raise _missing_store(e, given) from None


def _shown(store) -> str:  # type: ignore[no-untyped-def]
    """A store's URL as shown to people: without its password."""
    import sqlalchemy as sa

    return sa.make_url(store.url).render_as_string(hide_password=True)


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
        for row in rows:  # times to 0.1 us, as everywhere else; --json keeps what was stored
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()))
    return 0


def _timing(m) -> str:  # type: ignore[no-untyped-def]
    """A measurement's time, or its failure, on one line."""
    if not m.ok:
        return f"failed: {m.reason}"
    text = f"{m.median_us:.1f} us +- {m.spread_us:.1f}"
    if m.tflops:
        text += f", {m.tflops:.1f} TFLOPS"
    extra = m.extra or {}
    sdpa = [f"{name} {extra[key]:.1f} us" for name, key in
            (("flash", "sdpa_flash_us"), ("cuDNN", "sdpa_cudnn_us")) if extra.get(key)]
    return text + (f"; SDPA {', '.join(sdpa)}" if sdpa else "")


def _phase(m) -> str:  # type: ignore[no-untyped-def]
    """Which step of its run took a measurement: a search trial or the final re-time."""
    extra = m.extra or {}
    if extra.get("phase") == "search":
        return f"search   trial {extra.get('trial')}"
    if extra.get("phase") == "final":
        return f"re-time  {extra.get('rounds')} rounds, interleaved with SDPA"
    return str(extra.get("phase", "measured"))


def cmd_show(args: argparse.Namespace) -> int:
    with _open_store(args.store) as store:
        cand = store.candidate(args.identity)
        if cand is None:
            raise UsageError(f"no candidate {args.identity!r} in {_shown(store)}; "
                             "`evoengine list candidates` lists them")
        measurements = store.measurements(identity=args.identity)
        runs = {r: store.run(r) for r in dict.fromkeys(m.run_id for m in measurements)}
        elites = [e for e in store.elites() if e.identity == args.identity]
    if args.source:
        source = _source(cand)
        print(source, end="" if source.endswith("\n") else "\n")
        return 0
    print(f"identity  {cand.identity}\nfamily    {cand.family}\ntemplate  {cand.template_hash}")
    print(f"problem   {json.dumps(cand.problem)}\nparams    {json.dumps(cand.params)}")
    for arch, r in cand.compile_reports.items():
        print(f"compile   {arch}: " + (f"regs {r.registers}, spill {r.spill_bytes}, smem "
                                       f"{r.smem_bytes}, {r.compile_seconds:.2f}s" if r.ok
                                       else f"error {r.error}"))
    for e in elites:
        print(f"elite     rank {e.rank} on {e.arch} for {e.workload_key} ({e.median_us:.1f} us)")
    # A run measures a candidate in its search and again in the final re-time: one line
    # each, under the run, so the two are never mistaken for a repeat.
    for run_id, run in runs.items():
        where = "" if run is None else f": {run.workload_key} on {run.arch}" + (
            f", replay of {Path(run.versions['replay']).name}"
            if (run.versions or {}).get("replay") else f", {run.device}" if run.device else "")
        print(f"run {run_id}{where}")
        for m in measurements:
            if m.run_id == run_id:
                print(f"  {_phase(m)}: {_timing(m)}")
    return 0


def _source(cand) -> str:  # type: ignore[no-untyped-def]
    """The candidate's CUDA source: as stored, else rendered again where that gives exactly
    this candidate (a replay stores no source: its templates may have moved on since)."""
    if cand.source:
        return str(cand.source)
    from evoengine.render import make_candidate, render, template_hash
    from evoengine.space import SearchSpace

    why = f"no source stored for {cand.identity} (replayed runs keep none)"
    try:
        now = template_hash(cand.family)
        if now != cand.template_hash:
            raise ValueError(f"its template has changed since (hash {cand.template_hash}, "
                             f"now {now})")
        space = SearchSpace.load(paths.SPACES / f"{cand.family}.toml")
        arch = get_arch(next(iter(cand.compile_reports), space.archs[0]))
        rendered = make_candidate(space, cand.params, cand.problem, arch)
        if rendered.identity != cand.identity:
            raise ValueError(f"the space now makes it {rendered.identity}")
    except (ValueError, KeyError) as e:
        raise UsageError(f"{why}, and the current templates cannot render it: "
                         f"{e.args[0] if e.args else e}") from None
    print(f"evoengine: {why}; rendered from the current templates (same hash)",
          file=sys.stderr)
    return render(rendered)


def cmd_record(args: argparse.Namespace) -> int:
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


def cmd_report(args: argparse.Namespace) -> int:
    from evoengine.report import Selection, write_report

    selection = Selection(studies=tuple(args.study or ()), tunes=tuple(args.tune or ()),
                          arch=get_arch(args.arch).name if args.arch else None, kind=args.kind)
    try:
        done = write_report(args.store, selection, args.output)
    except FileNotFoundError as e:
        raise _missing_store(e, args.store) from None
    print(done.summary())
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
    from evoengine.store import resolve_url

    # Everything the user can get wrong is refused before looking for a GPU: the spaces,
    # the workload, whether any family can serve it, the store's name.
    spaces = _spaces(args.space, args.kind)
    wrong = [f"{s.path or s.family} ({s.kind})" for s in spaces if not s.serves(args.kind)]
    if wrong:
        raise UsageError(f"--kind {args.kind} searches {args.kind} spaces, not "
                         + ", ".join(wrong))
    store = resolve_url(args.store or (paths.REPLAY_STORE if args.replay else None))
    if args.json:
        paths.output_file(args.json, "--json file")
    run_kw: dict = {}
    if args.replay:
        workload, arch, run_kw = _replay(args, spaces)
    else:
        try:  # each kind names its workload by its own flags (--shape, --decode, ...)
            workload = _workload(args)
        except ValueError as e:
            raise UsageError(f"search needs a workload: {e} (or --replay FILE)") from None
        arch = get_arch(args.arch) if args.arch else None
        _refuse_unserved(spaces, workload, arch)
        _cuda_or_fail("search")
    trials = args.trials if args.trials is not None or args.timeout is not None else 100
    config = SearchConfig(workload=workload, spaces=spaces, arch=arch, store=store,
                          study=args.study, strategy=args.sampler, trials=trials,
                          timeout_s=args.timeout, seed=args.seed, compile_workers=args.workers,
                          priors=args.priors and not args.replay,
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
          + (f"; started from {t.seeds} seeds ({t.seeds_from_priors} from the priors)"
             if t.seeds else "")
          + (f" ({per_gpu})" if len(t.per_gpu) > 1 else ""), file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.evidence(), indent=1) + "\n")
    return 130 if result.status == "interrupted" else 0


def cmd_tune(args: argparse.Namespace) -> int:
    import signal

    from evoengine import geometry as geo
    from evoengine import tune
    from evoengine.search import EvaluatorError, SearchError
    from evoengine.store import resolve_url

    overrides = dict(heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     dtype=args.dtype, causal=args.causal, max_seq=args.max_seq,
                     min_seq=args.min_seq, latency_max_seq=args.latency_seq)
    if args.config is not None:
        geometry = geo.from_config(args.config, **overrides)
    else:
        if args.q_heads is None or args.head_dim is None:
            raise UsageError("tune needs a config.json, or --q-heads and --head-dim")
        geometry = geo.ModelGeometry(
            heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            dtype=args.dtype or "bf16", causal=bool(args.causal),
            max_seq=args.max_seq or geo.DEFAULT_MAX_SEQ,
            min_seq=args.min_seq or geo.LADDER_START,
            latency_max_seq=(geo.LATENCY_MAX_SEQ if args.latency_seq is None
                             else args.latency_seq))
    name = args.name or (geo.default_name(args.config) if args.config else
                         f"h{geometry.heads}-kv{geometry.kv_heads}-d{geometry.head_dim}")
    if args.arch is not None:
        arch = get_arch(args.arch)
    elif args.dry_run:
        arch = _gpu_arch_or(get_arch("sm_90a"))
    else:
        _cuda_or_fail("tune")
        arch = tune.device_arch(args.gpus[0] if args.gpus else args.device or 0)
    kinds = (None if args.kinds is None
             else [k.strip() for k in args.kinds.split(",") if k.strip()])
    plan = tune.plan(geometry, arch, name=name, kinds=kinds, split=args.split,
                     timeout_s=args.timeout or tune.DEFAULT_TIMEOUT_S, trials=args.trials,
                     spaces=args.space, cross=args.cross)
    if args.dry_run:
        print(plan.describe())
        return 0
    _cuda_or_fail("tune")
    print(plan.describe(), file=sys.stderr)
    options = dict(seed=args.seed, compile_workers=args.workers, priors=args.priors,
                   eval_timeout_s=args.eval_timeout, device=args.device or 0, gpus=args.gpus)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = tune.tune(plan, store=resolve_url(args.store), output=args.output,
                           spaces=args.space, options=options)
    except (SearchError, EvaluatorError) as e:
        raise UsageError(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(result.summary())
    if result.status != "done":
        print(f"evoengine: run the same command again to resume tune {plan.name}",
              file=sys.stderr)
    return 130 if result.status == "interrupted" else 0


def _gpu_arch_or(default: Arch) -> Arch:
    """The GPU's target, or ``default`` (said on stderr) where torch sees none."""
    from evoengine.runtime import NoGPUError, gpu_arch

    try:
        return gpu_arch()
    except (NoGPUError, ImportError, ValueError):
        print(f"evoengine: no GPU here: planning for {default.name} (--arch to choose)",
              file=sys.stderr)
        return default


def _workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from evoengine.problems import problem

    return problem(args.kind).workload_from_arguments(args)


def _refuse_unserved(spaces: list, workload: Workload, arch: Arch | None) -> None:
    """Refuse a workload whose problem (head dim, dtype, causal) every space rules out on
    every target it could run on (``arch``, else each target the space supports).

    Only the constraints that read nothing but problem and target names are evaluated
    (``SearchSpace.problem_violations``). A problem these let through but no point fits is
    still refused, by the search, once it knows the GPU.
    """
    if arch is not None and not any(s.supports(arch) for s in spaces):
        raise UsageError(f"no search space targets {arch.name}")
    problem = workload.problem()
    why: dict[str, str] = {}
    for space in spaces:
        for name in (arch.name,) if arch else space.archs:
            if not space.supports(get_arch(name)):
                continue
            broken = space.problem_violations(problem, get_arch(name))
            if not broken:
                return
            why.setdefault(space.family, broken[0])
    if why:
        raise UsageError(f"no search space admits {workload.key()}"
                         + (f" on {arch.name}" if arch else "") + ": "
                         + "; ".join(f"{family}: {text}" for family, text in why.items()))


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
    from evoengine.export import export_best
    from evoengine.runtime import NoGPUError, gpu_arch

    if args.arch is not None:
        arch = get_arch(args.arch)
    else:
        try:
            arch = gpu_arch()
        except NoGPUError as e:
            raise UsageError(f"export needs a CUDA GPU to pick the target ({e}); name one "
                             "with --arch, e.g. --arch sm_90a: cubins compile offline") from None
    _open_store(args.store).close()  # a missing store is named with a hint, as for `list`
    done = export_best(args.store, arch, study=args.study, output=args.output,
                       tune=args.tune, cover=args.cover or args.tune is not None)
    print(done.summary())
    return 0


# ---- parser -------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse, with its mistakes in one line like every other mistake (``evoengine: ...``,
    exit 2) instead of the usage block first; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"evoengine: {message} (see {self.prog} --help)\n")


def _store_option(parser: argparse.ArgumentParser, default: str, reads: bool) -> None:
    parser.add_argument("--store", metavar="STORE",
                        help=f"a SQLite file's path or a SQLAlchemy URL (default {default}"
                        + ("; must exist)" if reads else ")"))


def _evaluation_options(parser: argparse.ArgumentParser) -> None:
    """How a search evaluates (search and tune alike): seed, compilers, hang timeout, GPUs."""
    parser.add_argument("--seed", type=non_negative_int, default=None)
    parser.add_argument("--no-priors", dest="priors", action="store_false",
                        help="start from the store's elites only, not also from the points "
                        "measured fastest on the target (search_spaces/priors/)")
    parser.add_argument("--workers", type=positive_int, default=None,
                        help="compiler processes (default: cores - 1)")
    parser.add_argument("--eval-timeout", type=positive_duration, default=30.0,
                        metavar="SECONDS",
                        help="a candidate with no answer after this long is a hang "
                        "(default 30s)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", type=non_negative_int, default=None,
                       help="CUDA device index (default 0)")
    where.add_argument("--gpus", type=gpu_list, metavar="I,J,...",
                       help="one evaluator per listed GPU, fed by one compile pool and one "
                       "sampler (e.g. --gpus 0,1); not with --device")


def _workload_options(parser: argparse.ArgumentParser, when: str) -> None:
    """``--kind`` and the flags each problem kind names its workloads by (kinds that share
    flags share the function that declares them)."""
    from evoengine.problems import DEFAULT_KIND, PROBLEMS

    parser.add_argument("--kind", choices=list(PROBLEMS), default=DEFAULT_KIND,
                        help="which attention call: " + "; ".join(
                            f"{k}: {p.summary}" for k, p in PROBLEMS.items())
                        + f" (default {DEFAULT_KIND})")
    group = parser.add_argument_group(f"workload ({when})")
    declared: set[object] = set()
    for problem in PROBLEMS.values():
        declare = type(problem).add_arguments
        if declare not in declared:
            declared.add(declare)
            problem.add_arguments(group)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    c.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="compile N candidates spread over families and problems (default all)")
    c.add_argument("--seed", type=non_negative_int, default=0,
                   help="which spread of candidates (default 0)")
    c.add_argument("--workers", type=positive_int, default=None,
                   help="compiler processes (default: cores)")
    c.add_argument("--head-dim", type=positive_int, action="append", metavar="N",
                   help="compile problems of this head dim instead of the spaces' own "
                   "(repeatable); a problem no point of a family admits is named")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_compile_check)

    s = sub.add_parser("search", help="search for the fastest kernel on this GPU",
                       description="Evolve candidates on the GPU: compile, validate against "
                       "SDPA's criterion, time, keep the elites in the store. Running the same "
                       "study again resumes it.")
    s.add_argument("--arch", help="target (default: the GPU present)")
    _workload_options(s, "required unless --replay")
    budget = s.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=positive_int, help="trials to run now (default 100)")
    budget.add_argument("--timeout", type=positive_duration,
                        help="wall-clock budget (90s, 10m, 2h)")
    s.add_argument("--space", action="append", metavar="FILE", help="search-space file(s)")
    _store_option(s, f"{paths.DEFAULT_STORE}; with --replay {paths.REPLAY_STORE}", reads=False)
    s.add_argument("--study", help="study name (default: derived from arch and workload)")
    s.add_argument("--sampler", choices=["evo", "nsga2", "tpe", "random"], default="evo",
                   help="strategy: evo (genetic, default), nsga2, tpe or random")
    _evaluation_options(s)
    s.add_argument("--heartbeat", type=positive_int, default=60, metavar="SECONDS",
                   help="heartbeat of running trials; a worker silent for 3x this (killed, "
                   "host lost) has its trials failed and their points retried (default 60)")
    s.add_argument("--json", metavar="FILE", help="write the results JSON (device, rows...)")
    s.add_argument("--replay", metavar="FILE",
                   help="no GPU: answer from a recorded sweep (evoengine record); the "
                   "workload and arch are the record's")
    s.add_argument("--replay-delay", type=non_negative_duration, default=0.0, metavar="SECONDS",
                   help="with --replay, sleep this long per evaluation (default 0)")
    s.set_defaults(func=cmd_search)

    t = sub.add_parser("tune", help="search every call of a model's attention, export one "
                       "module", description="Read a model's attention geometry from its "
                       "Transformers config.json (or flags), search kernels for the calls it "
                       "makes (prefill lengths 256, 512, 1K, ... up to its maximum, ~16K tokens "
                       "per call), splitting one --timeout over them, choose each length's "
                       "kernel among its neighbours' best over the lengths it will serve (the "
                       "cross re-time), and export one module that serves every call of that "
                       "geometry. Running the same command again resumes: finished workloads "
                       "are skipped.")
    t.add_argument("config", nargs="?", help="the model's config.json (optional with "
                   "--q-heads and --head-dim)")
    g = t.add_argument_group("geometry (override the config's)")
    g.add_argument("--q-heads", type=positive_int, metavar="N", help="query heads")
    g.add_argument("--kv-heads", type=positive_int, metavar="N",
                   help="key/value heads (default: the query heads)")
    g.add_argument("--head-dim", type=positive_int, metavar="D", help="head dim")
    g.add_argument("--dtype", choices=["fp16", "bf16"],
                   help="default: the config's torch_dtype (float32: bf16)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="default: causal for decoders (architectures ...ForCausalLM)")
    g.add_argument("--max-seq", type=positive_int, metavar="N",
                   help="longest sequence to tune for (default: max_position_embeddings, "
                   "at most 16384)")
    g.add_argument("--min-seq", type=positive_int, metavar="N",
                   help="the prefill ladder's first length (default 256; it doubles from "
                   "there up to --max-seq)")
    g.add_argument("--latency-seq", type=non_negative_int, metavar="N",
                   help="also tune the forward for one sequence at each ladder length up to "
                   "N (default 1024; 0: none): calls too small to fill the GPU")
    t.add_argument("--kinds", metavar="K,K",
                   help="problem kinds to tune, e.g. fwd or fwd,bwd (default: every kind the "
                   "model makes calls of: fwd,bwd,varlen and, for a decoder, decode)")
    tb = t.add_mutually_exclusive_group()
    tb.add_argument("--timeout", type=positive_duration,
                    help="wall-clock budget of the whole tune (default 30m)")
    tb.add_argument("--trials", type=positive_int, help="trials per workload instead")
    t.add_argument("--split", choices=["equal", "flops"], default="equal",
                   help="how --timeout is split over the workloads (default equal)")
    t.add_argument("--no-cross", dest="cross", action="store_false",
                   help="skip the cross re-time: each length keeps its search's fastest "
                   "kernel (the searches then share the whole --timeout)")
    t.add_argument("--name", help="the tune's name, prefix of its studies (default: the "
                   "config's folder or file name)")
    t.add_argument("--arch", help=f"target ({archs}; default: the GPU present)")
    _store_option(t, paths.DEFAULT_STORE, reads=False)
    t.add_argument("-o", "--output", default="tuned_attention.py",
                   help="the module to write (default tuned_attention.py)")
    t.add_argument("--dry-run", action="store_true",
                   help="print the plan (workloads, studies, budget split) and stop")
    t.add_argument("--space", action="append", metavar="FILE", help="search-space file(s)")
    _evaluation_options(t)
    t.set_defaults(func=cmd_tune)

    r = sub.add_parser("record", help="write a recorded sweep from the store (for --replay)",
                       description="Export the search-phase measurements of one workload on one "
                       "target as a replay record (gzip'd JSON, format in "
                       "evoengine/search/replay/record.py): every point once, failures with their "
                       "reason, with the device, driver, date and commit of the runs.")
    _store_option(r, paths.DEFAULT_STORE, reads=True)
    r.add_argument("--arch", default="sm_90a", help="target (default sm_90a)")
    _workload_options(r, "required")
    r.add_argument("--run", type=positive_int, action="append", metavar="ID",
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
    _store_option(e, paths.DEFAULT_STORE, reads=True)
    which = e.add_mutually_exclusive_group()
    which.add_argument("--study", help="only elites found by runs of this study")
    which.add_argument("--tune", metavar="NAME", help="only elites of `evoengine tune`'s "
                       "studies of this name (implies --cover)")
    e.add_argument("--cover", action="store_true", help="also compile each tuned kernel for "
                   "the dtype and causal flag of its head dim that nothing was tuned for")
    e.add_argument("-o", "--output", default="tuned_attention.py",
                   help="the module to write (default tuned_attention.py)")
    e.set_defaults(func=cmd_export)

    ls = sub.add_parser("list", help="list runs, candidates or elites in the store")
    ls.add_argument("what", nargs="?", choices=["runs", "candidates", "elites"], default="runs")
    _store_option(ls, paths.DEFAULT_STORE, reads=True)
    ls.add_argument("--family", help="candidates of this family only")
    ls.add_argument("--arch", help="elites on this target only")
    ls.add_argument("--limit", type=positive_int, default=50, metavar="N",
                    help="at most N rows (default 50)")
    ls.add_argument("--json", action="store_true", help="print one JSON document")
    ls.set_defaults(func=cmd_list)

    from evoengine.problems import PROBLEMS

    rp = sub.add_parser("report", help="write one HTML page of what the searches found",
                        description="Write one self-contained HTML page (inline SVG plots, no "
                        "script, nothing fetched) per workload of the selected runs: the best "
                        "time against evaluations, ours next to the anchors of the final "
                        "re-time, the elites, the parameter importances of each study; then "
                        "the runs' devices, commits and dates. With no selection: every run.")
    _store_option(rp, paths.DEFAULT_STORE, reads=True)
    rp.add_argument("--study", action="append", metavar="NAME",
                    help="runs of this study; NAME* for every study starting with NAME "
                    "(repeatable)")
    rp.add_argument("--tune", action="append", metavar="NAME",
                    help="runs of every study of this tune (named NAME/...; repeatable)")
    rp.add_argument("--arch", help=f"runs on this target only ({archs})")
    rp.add_argument("--kind", choices=list(PROBLEMS), help="runs of this problem kind only")
    rp.add_argument("-o", "--output", default="runs/report.html", metavar="FILE",
                    help="the page to write (default runs/report.html)")
    rp.set_defaults(func=cmd_report)

    sh = sub.add_parser("show", help="show one candidate: parameters, compile reports, timings")
    sh.add_argument("identity")
    _store_option(sh, paths.DEFAULT_STORE, reads=True)
    sh.add_argument("--source", action="store_true", help="print the rendered CUDA source")
    sh.set_defaults(func=cmd_show)
    return p


def _where(e: BaseException) -> str:
    """Where an OSError that names no file was raised (" [loop.py:123]"), so that one line
    still traces it (a search once ended on "[Errno 9] Bad file descriptor" alone); "" for the
    rest, whose message says what went wrong."""
    if not isinstance(e, OSError) or e.filename is not None or e.__traceback__ is None:
        return ""
    import traceback

    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f" [{Path(frame.filename).name}:{frame.lineno}]"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"evoengine: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as e:  # SpaceError is a ValueError
        # OSError: a file that is missing, a folder, not ours to read or write.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"evoengine: {msg}{_where(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("evoengine: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # ``python -m evoengine.cli`` as ``python -m evoengine``
    raise SystemExit(main())
