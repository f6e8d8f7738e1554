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
    assert doc["summary"]["serialized"] == 0  # ptxas serialises no wgmma here (none on sm_89)
    families = {c["family"] for c in doc["candidates"]}
    assert families == {"mma", "wmma", "mma_bwd", "decode"}  # every family of every kind, sm_89
    for c in doc["candidates"]:
        assert c["ok"] and c["registers"] > 0 and c["smem_bytes"] <= 99 * 1024
        assert c["serialized"] is None


def test_compile_check_other_head_dims_names_what_admits_none(tmp_path: Path) -> None:
    """--head-dim compiles problems of another head dim (d96: 12 chunks a row, which the
    backward and decode copy by index) and names each family's problems that admit no point
    (the wgmma backward at d256: no tile fits)."""
    space = ["--space", str(ROOT / "search_spaces" / "wgmma_bwd.toml"),
             "--space", str(ROOT / "search_spaces" / "decode.toml")]
    done = run("compile-check", "--arch", "sm_90a", *space, "--head-dim", "96",
               "--head-dim", "256", "--limit", "2", "--json",
               env={"EVOENGINE_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["summary"]["compiled"] == 2
    assert {(c["family"], c["problem"]["HEAD_DIM"]) for c in doc["candidates"]} == {
        ("wgmma_bwd", 96), ("decode", 96)}
    assert doc["summary"]["no_point"] == [
        f"wgmma_bwd HEAD_DIM=256 DTYPE={t} CAUSAL={c}"
        for t in ("fp16", "bf16") for c in (False, True)]


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


def test_python_m_evoengine_cli_is_the_command_too() -> None:
    """``python -m evoengine.cli`` (the module's name) runs the command rather than importing
    the module and exiting 0 with no output; a bad call fails in one line, as the script's."""
    cli = subprocess.run([sys.executable, "-m", "evoengine.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stdout == run("--help").stdout
    bad = subprocess.run([sys.executable, "-m", "evoengine.cli", "search", "--kind", "decode"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "search needs a workload" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


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


# ---- one way to name a store; readers never create one (issue #15 items 2 and 3) -----------

RECORD = ROOT / "tests" / "data" / "sweep-sm_90a-b8-h16-kv16-sq4096-sk4096-d128-causal-fp16.json.gz"


def in_scratch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command run from a scratch folder, with this checkout's evoengine."""
    return run(*args, cwd=cwd, env={"PYTHONPATH": str(ROOT),
                                    "EVOENGINE_CACHE": str(cwd / "cache")})


def one_line(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evoengine: "), done.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_every_command_takes_a_path_or_a_url(tmp_path: Path) -> None:
    done = in_scratch("search", "--replay", str(RECORD), "--trials", "3", "--store", "my.db",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "my.db").is_file()
    for name in ("my.db", str(tmp_path / "my.db"), f"sqlite:///{tmp_path / 'my.db'}"):
        listed = in_scratch("list", "elites", "--store", name, "--json", cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        identity = json.loads(listed.stdout)[0]["identity"]
        shown = in_scratch("show", identity, "--store", name, cwd=tmp_path)
        assert shown.returncode == 0 and shown.stdout.startswith(f"identity  {identity}")


def test_list_without_a_store_points_at_the_replay_store(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    with Store(f"sqlite:///{tmp_path / 'runs' / 'replay.db'}"):
        pass
    one_line(in_scratch("list", cwd=tmp_path), "no store at", "runs/evoengine.db",
             "--store runs/replay.db")


@pytest.mark.parametrize("command", [
    ("list",), ("list", "elites"), ("show", "mma-x"), ("export", "best", "--arch", "sm_90a"),
    ("record", "--shape", "1,8,512,64"),
])
@pytest.mark.parametrize("store", ["sqlite:///runs/typo/evo.db", "runs/typo/evo.db"])
def test_reading_commands_refuse_a_missing_store(tmp_path: Path, command: tuple[str, ...],
                                                 store: str) -> None:
    done = in_scratch(*command, "--store", store, cwd=tmp_path)
    one_line(done, f"no store at {tmp_path / 'runs' / 'typo' / 'evo.db'}")
    assert not (tmp_path / "runs").exists()  # neither the file nor its folders


# ---- option values and argparse's own errors (items 4 and 5) --------------------------------

def test_every_option_that_takes_a_number_checks_it() -> None:
    from evoengine import argtypes, cli

    checked = {argtypes.positive_int, argtypes.non_negative_int, argtypes.positive_duration,
               argtypes.non_negative_duration, argtypes.gpu_list}
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.type is None or action.type in checked, (name, action.dest)


@pytest.mark.parametrize("args", [
    ("compile-check", "--arch", "sm_89", "--limit", "-3"),
    ("compile-check", "--arch", "sm_89", "--limit", "0"),
    ("compile-check", "--arch", "sm_89", "--workers", "0"),
    ("compile-check", "--arch", "sm_89", "--seed", "-1"),
    ("search", "--trials", "0"),
    ("search", "--timeout", "0"),
    ("search", "--timeout", "-5m"),
    ("search", "--timeout", "inf"),
    ("search", "--eval-timeout", "0s"),
    ("search", "--replay-delay", "-1"),
    ("search", "--heartbeat", "0"),
    ("search", "--workers", "-2"),
    ("search", "--kv-heads", "0"),
    ("search", "--seq-k", "-4"),
    ("search", "--device", "-1"),
    ("search", "--seed", "-1"),
    ("record", "--shape", "1,8,512,64", "--run", "0"),
    ("list", "--limit", "0"),
    ("list", "--limit", "-1"),
])
def test_zero_and_negative_counts_and_durations_are_refused(
        args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    from evoengine.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(args))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"evoengine: argument {args[-2]}: expected ")


def test_compile_check_limit_zero_compiles_nothing(tmp_path: Path) -> None:
    one_line(run("compile-check", "--arch", "sm_89", "--limit", "0",
                 env={"EVOENGINE_CACHE": str(tmp_path)}), "--limit", "positive integer")


@pytest.mark.parametrize("args,message", [
    (("search", "--trials", "5", "--timeout", "3"), "not allowed with argument --trials"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    ((), "required: COMMAND"),
    (("list", "everything"), "invalid choice: 'everything'"),
    (("compile-check",), "required: --arch"),
    (("search", "--dtype", "fp8"), "invalid choice: 'fp8'"),
])
def test_argparse_errors_are_one_line(args: tuple[str, ...], message: str) -> None:
    one_line(run(*args), message)


# ---- show, list, and refusing what no template serves (item 6) ------------------------------

def _measured_twice(url: str, source: str, params: dict | None = None) -> str:
    """A candidate measured in a search and again, with the same numbers, in the final
    re-time, as a replay stores it; returns its identity."""
    from evoengine.arch import get_arch
    from evoengine.render import make_candidate
    from evoengine.space import SearchSpace
    from evoengine.workload import Workload

    space = SearchSpace.load(ROOT / "search_spaces" / "mma.toml")
    w = Workload(1, 8, 512, 64, causal=True)
    params = params or space.admitted(w.problem(), get_arch("sm_90a"))[0]
    cand = make_candidate(space, params, w.problem(), get_arch("sm_90a"))
    with Store(url) as store:
        run_id = store.start_run(arch="sm_90a", workload=w.to_dict(), workload_key=w.key(),
                                 versions={"replay": "/x/sweep-a.json.gz"})
        store.add_candidate(identity=cand.identity, family="mma",
                            template_hash=cand.template_hash, params=cand.params,
                            problem=cand.problem, source=source)
        store.set_compile_report(cand.identity, arch="sm_90a", ok=True, registers=96,
                                 spill_bytes=0, smem_bytes=4096, compile_seconds=0.5)
        for extra in ({"phase": "search", "trial": 7},
                      {"phase": "final", "rounds": 5, "sdpa_flash_us": 20.0}):
            store.add_measurement(run_id, cand.identity, ok=True, median_us=12.3456789,
                                  spread_us=0.25, extra=extra)
        store.set_elites(arch="sm_90a", workload_key=w.key(),
                         entries=[(cand.identity, 12.3456789)], run_id=run_id)
    return cand.identity


def test_show_labels_each_measurement_and_repeats_no_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    identity = _measured_twice(url, "// src\n")
    shown = run("show", identity, "--store", url)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == len(set(lines)), shown.stdout
    assert "run 1: b1-h8-kv8-sq512-sk512-d64-causal-fp16 on sm_90a, replay of sweep-a.json.gz" \
        in lines
    assert "  search   trial 7: 12.3 us +- 0.2" in lines
    assert ("  re-time  5 rounds, interleaved with SDPA: 12.3 us +- 0.2; SDPA flash 20.0 us"
            in lines)
    assert run("show", identity, "--store", url, "--source").stdout == "// src\n"


def test_show_source_renders_what_a_replay_did_not_store(tmp_path: Path) -> None:
    from evoengine.arch import get_arch
    from evoengine.render import make_candidate, render
    from evoengine.space import SearchSpace

    url = f"sqlite:///{tmp_path / 'e.db'}"
    identity = _measured_twice(url, "")
    done = run("show", identity, "--store", url, "--source")
    assert done.returncode == 0, done.stderr
    with Store(url) as store:
        cand = store.candidate(identity)
    space = SearchSpace.load(ROOT / "search_spaces" / "mma.toml")
    assert done.stdout == render(make_candidate(space, cand.params, cand.problem,
                                                get_arch("sm_90a")))
    assert "rendered from the current templates" in done.stderr
    # A point the space cannot build now (a parameter it no longer has) is refused, in a line.
    with Store(url) as store:
        store.add_candidate(identity="mma-old", family="mma", template_hash=cand.template_hash,
                            params={"BLOCK_M": 64}, problem=cand.problem, source="")
    one_line(run("show", "mma-old", "--store", url, "--source"), "no source stored for mma-old")


def test_list_rounds_times_but_json_keeps_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    _measured_twice(url, "")
    listed = run("list", "elites", "--store", url)
    assert "  median_us=12.3  " in listed.stdout, listed.stdout
    as_json = json.loads(run("list", "elites", "--store", url, "--json").stdout)
    assert as_json[0]["median_us"] == 12.3456789


@pytest.mark.parametrize("arch", [(), ("--arch", "sm_90a")])
def test_search_refuses_a_head_dim_no_template_serves_before_asking_for_a_gpu(
        arch: tuple[str, ...]) -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU: the refusal must come first all the same.
    done = run("search", "--shape", "2,8,256,72", *arch, env={"CUDA_VISIBLE_DEVICES": ""})
    one_line(done, "no search space admits b2-h8-kv8-sq256-sk256-d72", "HEAD_DIM % 16 == 0")
    assert "needs a CUDA GPU" not in done.stderr


def test_search_names_a_decode_workload_by_its_own_flags() -> None:
    done = run("search", "--kind", "decode", "--decode", "1,1,32,8,128",
               env={"CUDA_VISIBLE_DEVICES": ""})
    one_line(done, "search needs a workload", "--cache-len")
    done = run("search", "--kind", "decode", "--decode", "1,1,32,8,72", "--cache-len", "4096",
               env={"CUDA_VISIBLE_DEVICES": ""})
    one_line(done, "no search space admits decode-b1-q1-h32-kv8-d72-c4096-paged64-fp16")
    assert "needs a CUDA GPU" not in done.stderr


# ---- files a command writes, stores that are not stores (the audit of 2026-11-24) ----------

@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one replayed search in it (no GPU)."""
    root = tmp_path_factory.mktemp("replayed")
    record = sorted((ROOT / "tests" / "data").glob("sweep-*.json.gz"))[0]
    done = run("search", "--replay", str(record), "--store", str(root / "evo.db"), "--trials",
               "2", env={"EVOENGINE_CACHE": str(root / "cache")})
    assert done.returncode == 0, done.stderr
    (root / "folder").mkdir()
    (root / "file").write_text("")
    (root / "corrupt.db").write_text("not a database")
    return root


@pytest.mark.parametrize("args,message", [
    (("report", "-o", "folder"), "the report folder is a folder"),
    (("report", "-o", "file/page.html"), "cannot be written: file is not a folder"),
    (("export", "best", "--arch", "sm_90a", "-o", "folder"), "the module folder is a folder"),
    (("export", "best", "--arch", "sm_90a", "-o", "file/m.py"), "file is not a folder"),
    (("search", "--replay", "{record}", "--trials", "1", "--json", "folder"),
     "the --json file folder is a folder"),  # before searching, not after
    (("report", "--store", "corrupt.db"), "file is not a database"),
    (("export", "best", "--arch", "sm_90a", "--store", "corrupt.db"), "file is not a database"),
    (("list", "--store", "corrupt.db"), "file is not a database"),
    (("tune", "folder", "--dry-run"), "folder is a folder without a config.json"),
])
def test_what_a_command_cannot_read_or_write_is_one_line(replayed: Path, args: tuple[str, ...],
                                                         message: str) -> None:
    record = str(sorted((ROOT / "tests" / "data").glob("sweep-*.json.gz"))[0])
    args = tuple(a.format(record=record) for a in args)
    store = () if "--store" in args or args[0] == "tune" else ("--store", "evo.db")
    one_line(run(*args, *store, cwd=replayed, env={"EVOENGINE_CACHE": str(replayed / "cache")}),
             message)
    assert not list(replayed.glob(".*.tmp"))  # an export that failed leaves no temporary
    with Store(f"sqlite:///{replayed / 'evo.db'}", create=False) as s:
        assert len(s.runs()) == 1  # nothing searched


def test_an_os_error_without_a_file_says_where(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError that names no file (a closed descriptor, a broken pipe) ends the command in
    one line that says where it was raised; one about a path stays the path's message."""
    import errno

    from evoengine import cli

    def bad_fd(args: object) -> int:
        raise OSError(errno.EBADF, "Bad file descriptor")

    def missing(args: object) -> int:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "runs/x.db")

    for func, expected in ((bad_fd, "Bad file descriptor [test_cli.py:"),
                           (missing, "No such file or directory: 'runs/x.db'\n")):
        monkeypatch.setattr(cli, "cmd_list", func)  # main builds its parser after this
        assert cli.main(["list", "runs"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("evoengine: ") and expected in err and err.count("\n") == 1
