"""The search on a real GPU: a faulting and a hanging kernel planted among real ones each
cost exactly one trial; the command runs end to end and writes its evidence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evoengine.search import GpuEvaluator, Progress, SearchConfig, search
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload
from tests.test_search import small_space

HERE = Path(__file__).parent


def test_planted_fault_and_hang_cost_one_trial_each(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINE_TEMPLATES", str(HERE / "templates"))
    planted = SearchSpace.load(HERE / "spaces" / "planted.toml")
    workload = Workload(2, 4, 333, 64)
    url = f"sqlite:///{tmp_path / 'evo.db'}"
    six = small_space(tmp_path, lazy=False)  # eager rescale: no point near the tolerance
    evaluator = GpuEvaluator(workload, timeout_s=15.0)
    try:
        result = search(SearchConfig(workload=workload, spaces=[six, planted],
                                     store=url, trials=8, seed=0),
                        evaluator=evaluator, progress=Progress(workload.flops()))
        restarts = evaluator.restarts
    finally:
        evaluator.close()
    with Store(url) as store:
        ms = [m for m in store.measurements(run_id=result.run_id)
              if m.extra["phase"] == "search"]
    by_kind = {m.identity.split("-")[0] + ("-" + m.identity.split("kind")[1].split("-")[0]
                                           if "kind" in m.identity else ""): m for m in ms}
    print({k: (m.ok, m.reason, m.median_us) for k, m in by_kind.items()})
    assert len(ms) == 8
    assert by_kind["planted-fault"].reason.startswith("fault")  # type: ignore[union-attr]
    assert by_kind["planted-hang"].reason.startswith("timeout")  # type: ignore[union-attr]
    assert sum(m.ok for m in ms) == 6  # every real kernel still measured
    assert result.tally.faults == 2 and restarts == 2
    assert result.status == "done" and len(result.rows) == 5
    assert all(r["family"] == "mma" and r["sdpa_flash_us"] for r in result.rows)


def test_search_command_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "evoengine", "search", "--shape", "1,8,512,64", "--trials", "12",
           "--store", f"sqlite:///{tmp_path / 'evo.db'}", "--json", str(out), "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] and doc["rows"][0]["ours_us"] > 0
    assert doc["search"]["evaluated"] + doc["search"]["compile_failed"] == 12
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0  # the same study resumes
    with Store(f"sqlite:///{tmp_path / 'evo.db'}") as store:
        ids = [m.identity for m in store.measurements() if m.extra["phase"] == "search"]
    assert len(ids) == 24 == len(set(ids))
