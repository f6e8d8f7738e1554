"""Concurrent writers on one store: N processes each doing the search loop's write pattern
per trial, against the storage options for one host (issue #6).

Per trial, like ``evoengine.search.loop``: Optuna ask + heartbeat + identity attribute,
claim, candidate, compile report, measurement (settling the claim), tell, elites.
Reports trials per second overall, errors, and the worst and 99th-percentile time one
trial's writes took (a stall past the heartbeat grace fails a live worker's trial).

    python benchmarks/store_writers.py --procs 1 2 4 8 --trials 150 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

METHOD = ("N processes (spawned), each {trials} trials of the search loop's writes (Optuna ask, "
          "heartbeat, identity attribute, claim, candidate with a 4 kB source, compile report, "
          "measurement, tell, elites), started together; trials per second over the slowest "
          "process's wall time, and each trial's write latency (median, p99, max); no GPU")
OPTIONS = {
    "wal": "store and Optuna's RDBStorage on one SQLite file (WAL, busy timeouts)",
    "journal": "store on SQLite (WAL); Optuna's JournalStorage in a file beside it",
    "postgresql": "store and Optuna's RDBStorage on PostgreSQL (EVO_TEST_POSTGRES)",
}


def _optuna_storage(option: str, folder: Path, url: str) -> Any:
    import optuna

    if option == "journal":
        backend = optuna.storages.journal.JournalFileBackend(str(folder / "optuna.log"))
        return optuna.storages.JournalStorage(backend)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=180,
                                              engine_kwargs=kwargs)
        except Exception:
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def worker(option: str, folder: str, url: str, index: int, trials: int,
           start_at: float) -> dict[str, Any]:
    import optuna

    from evoengine.store import Store

    warnings.simplefilter("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    errors: list[str] = []
    latencies: list[float] = []
    store = Store(url)
    storage = _optuna_storage(option, Path(folder), url)
    study = optuna.create_study(study_name="bench", storage=storage, load_if_exists=True,
                                sampler=optuna.samplers.RandomSampler(seed=index))
    run_id = store.start_run(arch="sm_90a", workload={}, workload_key="k")
    while time.time() < start_at:
        time.sleep(0.001)
    began = time.perf_counter()
    done = 0
    for n in range(trials):
        t0 = time.perf_counter()
        try:
            trial = study.ask()
            if option != "journal":
                storage.record_heartbeat(trial._trial_id)
            x = trial.suggest_float("x", 0, 1)
            identity = f"w{index}-t{n}"
            trial.set_user_attr("identity", identity)
            store.claim(arch="sm_90a", workload_key="k", identity=identity, run_id=run_id,
                        trial_id=trial._trial_id)
            store.add_candidate(identity=identity, family="f", template_hash="h",
                                params={"x": x}, problem={}, source="// " + "x" * 4000)
            store.set_compile_report(identity, arch="sm_90a", ok=True, registers=128)
            store.add_measurement(run_id, identity, ok=True, median_us=100 * x,
                                  extra={"phase": "search"}, trial_id=trial._trial_id)
            study.tell(trial, 100 * x)
            store.update_elites(arch="sm_90a", workload_key="k", limit=5, run_id=run_id)
            done += 1
        except Exception as e:  # noqa: BLE001 (counted: the point of the benchmark)
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if len(errors) == 1:
                traceback.print_exc()
        latencies.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - began
    store.close()
    return {"done": done, "errors": errors, "seconds": seconds, "latencies": latencies}


def measure(option: str, procs: int, trials: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/evo.db"
        if option == "postgresql":
            url = _fresh_pg_database()
        ctx = mp.get_context("spawn")
        with ctx.Pool(procs) as pool:
            start_at = time.time() + 3.0 + 0.5 * procs
            got = pool.starmap(worker, [(option, folder, url, i, trials, start_at)
                                        for i in range(procs)])
    lat = sorted(x for g in got for x in g["latencies"])
    wall = max(g["seconds"] for g in got)
    errors = [e for g in got for e in g["errors"]]
    return {"option": option, "procs": procs, "trials_per_proc": trials,
            "trials_done": sum(g["done"] for g in got), "errors": len(errors),
            "first_errors": sorted(set(errors))[:3],
            "trials_per_s": round(sum(g["done"] for g in got) / wall, 1),
            "trial_ms_median": round(1000 * statistics.median(lat), 1),
            "trial_ms_p99": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1),
            "trial_ms_max": round(1000 * lat[-1], 1)}


def _fresh_pg_database() -> str:
    import uuid

    import sqlalchemy as sa

    server = sa.make_url(os.environ["EVO_TEST_POSTGRES"])
    name = f"evo_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return server.set(database=name).render_as_string(hide_password=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--options", nargs="+", choices=list(OPTIONS), default=["wal", "journal"])
    p.add_argument("--procs", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--trials", type=int, default=150)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rows = []
    for option in args.options:
        for procs in args.procs:
            row = measure(option, procs, args.trials)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        from evoengine.provenance import header

        doc = header(device=None, driver=None, torch=None, method=METHOD.format(
            trials=args.trials), cpus=os.cpu_count(), options=OPTIONS, rows=rows)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
