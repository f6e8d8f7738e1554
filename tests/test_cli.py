"""The command line, run the way a user runs it (a subprocess), without a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evoengine.store import Store

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengine", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env={**os.environ, **(env or {})})


def no_gpu() -> bool:
    from tests.conftest import gpu_reason

    return gpu_reason() is not None


@pytest.mark.parametrize("command,expect", [
    ("compile-check", "--limit"), ("search", "--shape"), ("export", "--output"),
    ("list", "elites"), ("show", "--source"),
])
def test_help(command: str, expect: str) -> None:
    done = run(command, "--help")
    assert done.returncode == 0
    assert expect in done.stdout


def test_top_level_help_lists_commands() -> None:
    done = run("--help")
    assert done.returncode == 0
    for command in ("compile-check", "search", "export", "list", "show"):
        assert command in done.stdout


def test_compile_check_json(tmp_path: Path) -> None:
    done = run("compile-check", "--arch", "sm_89", "--limit", "4", "--json",
               env={"EVOENGINE_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["summary"]["candidates"] == 4
    assert doc["summary"]["compiled"] == 4
    families = {c["family"] for c in doc["candidates"]}
    assert families == {"mma", "wmma"}  # the spread covers every family
    for c in doc["candidates"]:
        assert c["ok"] and c["registers"] > 0 and c["smem_bytes"] <= 99 * 1024


def test_compile_error_is_a_result_not_a_crash(tmp_path: Path) -> None:
    space = tmp_path / "broken.toml"
    text = (ROOT / "search_spaces" / "mma.toml").read_text()
    # Lie about shared memory: the kernel's static_assert must reject every candidate.
    space.write_text(re.sub(r'SMEM_BYTES = "(.*)"', r'SMEM_BYTES = "(\1) + 16"', text))
    done = run("compile-check", "--arch", "sm_90a", "--space", str(space), "--limit", "2",
               "--json", env={"EVOENGINE_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["summary"]["failed"] == 2
    assert all(not c["ok"] and c["error"] for c in doc["candidates"])


@pytest.mark.parametrize("args,message", [
    (("compile-check", "--arch", "sm_75"), "unknown arch"),
    (("compile-check", "--arch", "sm_90a", "--space", "missing.toml"), "no such search-space"),
    (("search", "--shape", "1,2,3"), "B,H,S,D"),
    (("search", "--shape", "2,6,128,64", "--kv-heads", "4"), "multiple of kv heads"),
    (("show", "nothing", "--store", "sqlite:////nonexistent/dir/x.db"), ""),
])
def test_bad_input_is_one_line_exit_2(args: tuple[str, ...], message: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert message in done.stderr


@pytest.mark.skipif(not no_gpu(), reason="checks the message shown where no GPU is")
@pytest.mark.parametrize("args", [("search", "--shape", "2,8,256,64"), ("export", "best")])
def test_gpu_commands_say_they_need_a_gpu(args: tuple[str, ...]) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not no_gpu(), reason="checks the message shown where no GPU is")
def test_export_without_a_gpu_asks_for_an_arch() -> None:
    done = run("export", "best")
    assert done.returncode == 2 and "--arch" in done.stderr and "compile offline" in done.stderr


def test_export_best_for_an_explicit_arch_needs_no_gpu(tmp_path: Path) -> None:
    from evoengine import paths
    from evoengine.arch import get_arch
    from evoengine.render import make_candidate, render
    from evoengine.space import SearchSpace
    from evoengine.workload import Workload

    arch = get_arch("sm_89")
    space = SearchSpace.load(paths.SPACES / "mma.toml")
    w = Workload(1, 8, 512, 64, causal=True)
    cand = make_candidate(space, space.admitted(w.problem(), arch)[0], w.problem(), arch)
    db = tmp_path / "e.db"
    with Store(f"sqlite:///{db}") as store:
        run_id = store.start_run(arch="sm_89", workload=w.to_dict(), workload_key=w.key(),
                                 study="s")
        store.add_candidate(identity=cand.identity, family="mma", template_hash="t",
                            params=cand.params, problem=cand.problem, source=render(cand))
        store.set_elites(arch="sm_89", workload_key=w.key(), entries=[(cand.identity, 9.5)],
                         run_id=run_id)
    out = tmp_path / "tuned.py"
    env = {"EVOENGINE_CACHE": str(tmp_path / "cache")}
    done = run("export", "best", "--arch", "sm_89", "--store", str(db), "-o", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 1 kernel for sm_89, 1 dispatch entry")
    assert "fp16 head_dim 64 causal at sk 512" in done.stdout
    assert out.read_text().startswith('"""Tuned attention kernels for sm_89')
    for args, message in [(("--study", "other"), "no elites for sm_89 from study 'other'"),
                          (("--arch", "sm_80"), "no elites for sm_80; it has elites for sm_89"),
                          (("--store", str(tmp_path / "none.db")), "no store at")]:
        base = {"--arch": "sm_89", "--store": str(db), "-o": str(tmp_path / "x.py")}
        base.update(dict(zip(args[::2], args[1::2], strict=True)))
        failed = run("export", "best", *[x for kv in base.items() for x in kv], env=env)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
        assert "Traceback" not in failed.stderr


def test_python_m_matches_the_script() -> None:
    script = Path(sys.executable).with_name("evoengine")
    if not script.exists():
        pytest.skip("console script not installed next to this interpreter")
    a = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    b = run("--help")
    assert a.returncode == b.returncode == 0
    assert a.stdout.replace("evoengine", "") == b.stdout.replace("evoengine", "")


def test_list_and_show_read_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    with Store(url) as store:
        run_id = store.start_run(arch="sm_90a", workload={"batch": 1}, workload_key="w1")
        store.add_candidate(identity="mma-x", family="mma", template_hash="abc",
                            params={"BLOCK_M": 64}, problem={"HEAD_DIM": 64}, source="// src")
        store.set_compile_report("mma-x", arch="sm_90a", ok=True, registers=96, spill_bytes=0,
                                 smem_bytes=4096, compile_seconds=0.5)
        store.add_measurement(run_id, "mma-x", ok=True, median_us=12.5, spread_us=0.25)
        store.set_elites(arch="sm_90a", workload_key="w1", entries=[("mma-x", 12.5)])
    runs = json.loads(run("list", "runs", "--store", url, "--json").stdout)
    assert [r["id"] for r in runs] == [run_id]
    elites = json.loads(run("list", "elites", "--store", url, "--json").stdout)
    assert elites[0]["identity"] == "mma-x" and elites[0]["median_us"] == 12.5
    shown = run("show", "mma-x", "--store", url)
    assert shown.returncode == 0
    assert "regs 96" in shown.stdout and "12.5 us" in shown.stdout
    assert run("show", "mma-x", "--store", url, "--source").stdout.strip() == "// src"
    missing = run("show", "mma-y", "--store", url)
    assert missing.returncode == 2 and "no candidate" in missing.stderr


def test_list_without_a_store_says_so(tmp_path: Path) -> None:
    done = run("list", cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "no store" in done.stderr
