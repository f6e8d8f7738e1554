"""Tests of evoengine.export without a GPU: the exported module's text, what it imports,
where it says it came from, its dispatch choices, its hash check, and ``evoengine.load``.

One store is built per module: three admitted ``mma`` points that win four sm_90a
workloads over two studies, an admitted ``mma_bwd`` point that wins a backward workload, a
rank-2 elite and an sm_80 elite that must not be exported.
Cubins for sm_90a compile offline, into a compile cache private to this module.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

import evoengine
from evoengine import launch, paths
from evoengine.arch import get_arch
from evoengine.compile import compile_candidate
from evoengine.export import ExportError, export_best, load, render_module
from evoengine.export import import_module_file as import_path
from evoengine.problems.backward import BackwardWorkload
from evoengine.render import (
    Candidate,
    make_candidate,
    make_identity,
    render,
    template_hash,
)
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload
from tests.test_launch import STDLIB, Launches, imported_roots, leaves, sdpa_reference
from tests.test_runtime import cuda_like

ARCH = get_arch("sm_90a")
DEVICE = "NVIDIA H100 80GB HBM3"


def admitted(problem: dict, family: str = "mma", **want: object) -> dict:
    """The first point of ``family`` admitted for ``problem`` on sm_90a with ``want``."""
    space = SearchSpace.load(paths.SPACES / f"{family}.toml")
    for point in space.admitted(problem, ARCH):
        if all(point[k] == v for k, v in want.items()):
            return point
    raise AssertionError(f"no admitted point with {want}")


FP16_64 = {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}
BF16_128_CAUSAL = {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}


def candidate(problem: dict, family: str = "mma", **want: object) -> Candidate:
    space = SearchSpace.load(paths.SPACES / f"{family}.toml")
    return make_candidate(space, admitted(problem, family, **want), problem, ARCH)


@dataclass
class Built:
    db: Path
    module_path: Path
    text: str
    a: Candidate  # wins b1-h8 sq512 and b2-h4 sq2048 (few rows)
    b: Candidate  # wins b16-h16 sq2048 (many rows)
    c: Candidate  # wins a GQA causal bf16 d128 workload, in study s2
    bwd: Candidate  # an mma_bwd point: wins a GQA fp16 d64 backward workload, in study s2
    loser: Candidate  # rank 2 only


def add(store: Store, cand: Candidate, source: str | None = None,
        identity: str | None = None) -> str:
    identity = identity or cand.identity
    store.add_candidate(identity=identity, family=cand.family, template_hash=cand.template_hash,
                        params=cand.params, problem=cand.problem, source=source or render(cand))
    return identity


def win(store: Store, workload: Workload, ranked: list[tuple[str, float]], *, study: str,
        arch: str = "sm_90a", commit: str = "c0ffee1") -> int:
    run = store.start_run(arch=arch, workload=workload.to_dict(), workload_key=workload.key(),
                          device=DEVICE, commit=commit, study=study)
    store.set_elites(arch=arch, workload_key=workload.key(), entries=ranked, run_id=run)
    store.finish_run(run)
    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVOENGINE_CACHE", str(root / "cache"))
        a = candidate(FP16_64, BLOCK_M=64, NUM_WARPS=4, STAGES=1, SWIZZLE="none")
        b = candidate(FP16_64, BLOCK_M=128, NUM_WARPS=8, STAGES=2, SWIZZLE="xor")
        c = candidate(BF16_128_CAUSAL, BLOCK_M=64, BLOCK_N=32, NUM_WARPS=4, STAGES=2)
        bwd = candidate(FP16_64, "mma_bwd", BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4)
        loser = candidate(FP16_64, BLOCK_M=32, NUM_WARPS=2)
        space = SearchSpace.load(paths.SPACES / "mma.toml")
        ampere = make_candidate(space, a.params, a.problem, get_arch("sm_80"))
        db = root / "evo.db"
        with Store(f"sqlite:///{db}") as store:
            for cand in (a, b, c, bwd, loser, ampere):
                add(store, cand)
            win(store, Workload(1, 8, 512, 64), [(a.identity, 12.5), (loser.identity, 14.0)],
                study="s1")
            win(store, Workload(2, 4, 2048, 64), [(a.identity, 40.25)], study="s1")
            win(store, Workload(16, 16, 2048, 64), [(b.identity, 1048.0)], study="s1")
            win(store, Workload(2, 8, 1024, 128, kv_heads=2, causal=True, dtype="bf16"),
                [(c.identity, 230.5)], study="s2")
            win(store, BackwardWorkload(2, 8, 1024, 64, kv_heads=2), [(bwd.identity, 512.0)],
                study="s2")
            win(store, Workload(4, 8, 4096, 64), [(ampere.identity, 900.0)], study="s1",
                arch="sm_80")
        out = export_best(str(db), "sm_90a", output=root / "tuned_attention.py")
        yield Built(db, out.path, out.path.read_text(), a, b, c, bwd, loser)



@pytest.fixture(scope="module")
def module(built: Built) -> ModuleType:
    return import_path(built.module_path, "tuned_attention_under_test")


# A fresh interpreter that cannot import evoengine at all, run outside the repository.
IMPORT_BLOCKED = """
import importlib.abc, json, sys
class NoEvoengine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "evoengine":
            raise ImportError("evoengine is blocked in this test")
sys.meta_path.insert(0, NoEvoengine())
sys.path.insert(0, sys.argv[1])
import tuned_attention as t
print(json.dumps({
    "evoengine": sorted(m for m in sys.modules if m.split(".")[0] == "evoengine"),
    "cupy": "cupy" in sys.modules,
    "kernels": [k.name for k in t.attention.kernels],
    "entries": len(t.DISPATCH),
    "namespace": t.attention.namespace,
}))
"""


def import_fresh(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", IMPORT_BLOCKED, str(folder)],
                          cwd=folder, capture_output=True, text=True, timeout=120)


def test_module_imports_in_a_fresh_process_without_evoengine(built: Built) -> None:
    done = import_fresh(built.module_path.parent)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["evoengine"] == [] and facts["cupy"] is False  # cupy waits for a launch
    assert facts["kernels"] == [built.a.identity, built.b.identity, built.c.identity,
                                built.bwd.identity]
    assert facts["entries"] == 5 and facts["namespace"].startswith("evoengine_")


def test_module_imports_only_torch_cupy_and_the_stdlib(built: Built) -> None:
    roots = imported_roots(built.text)
    assert "evoengine" not in roots
    assert roots - STDLIB == {"torch", "cupy", "transformers"}
    assert "transformers" not in imported_roots(built.text, top_level=True)


def test_module_embeds_the_launcher_verbatim(built: Built) -> None:
    body = launch.module_text()
    assert len(body) > 10000 and body in built.text
    assert built.text.count("from __future__ import annotations\n") == 1
    for path in launch.module_paths():  # every module's code, word for word
        text = path.read_text()
        last_def = text[text.rindex("\ndef ") + 1:] if "\ndef " in text else text[-400:]
        assert last_def.strip() in built.text, path.name


def test_header_says_where_it_came_from(module: ModuleType, built: Built) -> None:
    doc = module.__doc__
    assert doc.startswith("Tuned attention kernels for sm_90a, exported by evoengine")
    assert f"store     sqlite:///{built.db.resolve()}" in doc
    assert "study     (all studies)" in doc
    assert re.search(r"commit    \S+ \(the exporting evoengine\)", doc)
    assert doc.count(f"{DEVICE}, commit c0ffee1") == 5  # one line per run exported
    assert "with nvrtc" in doc
    for line in ("12.5 us  b1-h8-kv8-sq512-sk512-d64-full-fp16",
                 "40.2 us  b2-h4-kv4-sq2048-sk2048-d64-full-fp16",
                 "1048.0 us  b16-h16-kv16-sq2048-sk2048-d64-full-fp16",
                 "230.5 us  b2-h8-kv2-sq1024-sk1024-d128-causal-bf16"):
        assert line in doc
    for cand in (built.a, built.b, built.c, built.bwd):
        assert cand.identity in doc
    backward = doc[doc.index("\nBackward:\n"):]
    assert "512.0 us  bwd-b2-h8-kv2-sq1024-sk1024-d64-full-fp16" in backward
    assert built.bwd.identity in backward and built.a.identity not in backward
    assert ".backward() raises NoKernelError" in doc
    prov = module.PROVENANCE
    assert prov["arch"] == "sm_90a" and prov["study"] is None
    assert {r["device"] for r in prov["runs"]} == {DEVICE} and len(prov["runs"]) == 5


def test_module_holds_the_winners_only(module: ModuleType, built: Built) -> None:
    assert [k.name for k in module.attention.kernels] == [
        built.a.identity, built.b.identity, built.c.identity, built.bwd.identity]
    assert built.loser.identity not in built.text  # rank 2
    assert "b4-h8-kv8-sq4096" not in built.text  # an elite of another arch


def test_sources_and_cubins_are_what_evoengine_builds(module: ModuleType, built: Built,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINE_CACHE", str(built.db.parent / "cache"))
    *forward, backward = module.attention.kernels
    for kernel, cand in zip(forward, (built.a, built.b, built.c), strict=True):
        assert kernel.source == render(cand)
        assert kernel.cubin == compile_candidate(cand, ARCH).cubin
        assert kernel.cubin[:4] == b"\x7fELF" and kernel.arch == "sm_90a"
        assert (kernel.block_m, kernel.threads, kernel.smem_bytes) == (
            cand.block_m, cand.threads, cand.smem_bytes)
        assert kernel.defines == cand.defines(ARCH)
    assert isinstance(backward, module.CudaBackward) and backward.name == built.bwd.identity
    for part in (backward.pre, backward.main, backward.post):
        assert part.source == render(built.bwd)
        assert part.cubin == compile_candidate(built.bwd, ARCH).cubin
    assert (backward.main.threads, backward.main.smem_bytes, backward.block_n) == (
        built.bwd.threads, built.bwd.smem_bytes, built.bwd.params["BLOCK_N"])


def test_module_carries_a_backward_table(module: ModuleType, built: Built) -> None:
    assert [s["kind"] for s in module._KERNEL_SPECS] == ["fwd", "fwd", "fwd", "bwd"]
    assert [e.kind for e in module.DISPATCH] == ["fwd"] * 4 + ["bwd"]
    assert list(module.attention.table) == [("bf16", 128, True), ("fp16", 64, False)]
    assert list(module.attention.backward_table) == [("fp16", 64, False)]
    entry = module.attention.select("fp16", 64, False, 700, 700, 8, kind="bwd")
    assert entry.workload == "bwd-b2-h8-kv2-sq1024-sk1024-d64-full-fp16" and entry.kernel == 3
    assert module.attention.select("bf16", 128, True, 700, 700, kind="bwd") is None


def test_dispatch_picks_the_nearest_tuned_kernel(module: ModuleType) -> None:
    select = module.attention.select
    assert select("fp16", 64, False, 512, 512, 8).workload.startswith("b1-h8-kv8-sq512")
    assert select("fp16", 64, False, 1000, 1000, 8).seq_k == 512  # between buckets
    assert select("fp16", 64, False, 1100, 1100, 8).seq_k == 2048
    assert select("fp16", 64, False, 2048, 2048, 8).workload.startswith("b2-h4")  # few rows
    assert select("fp16", 64, False, 3000, 3000, 256).workload.startswith("b16-h16")
    assert select("bf16", 128, True, 7, 9000, 1).kernel == 2
    assert select("fp16", 128, True, 1024, 1024) is None
    assert select("bf16", 64, False, 512, 512) is None


def test_gradients_reach_the_modules_backward_kernel(module: ModuleType,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported ``attention`` has an autograd formula, which launches the module's own
    backward kernel (fake launches on the CPU); a call with no backward kernel says so in one
    line at ``.backward()``."""
    fwd = module.attention.kernels[0]
    launches = Launches(monkeypatch, fwd, module.attention.kernels[3])
    q, k, v = leaves(64)
    out = module.attention(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    out.backward(cuda_like(dout))
    assert len(launches.forward) == len(launches.backward) == 1
    assert launches.forward[0]["lse"] is not None
    want = sdpa_reference(q, k, v, dout, causal=False)
    for got, w in zip((q.grad, k.grad, v.grad), want, strict=True):
        assert got.shape == w.shape
        torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), w, atol=4e-3, rtol=0)

    Launches(monkeypatch, module.attention.kernels[2], None)
    q, k, v = leaves(128, torch.bfloat16)
    with pytest.raises(module.NoKernelError) as info:
        module.attention(q, k, v, causal=True).float().sum().backward()
    assert str(info.value) == (
        "no tuned backward kernel for torch.bfloat16 head_dim 128 causal; this module has "
        "backward kernels for: fp16 head_dim 64 non-causal. Pass fallback='sdpa' to run torch "
        "SDPA for such calls.")


def test_bad_input_is_refused_before_the_gpu(module: ModuleType) -> None:
    q = torch.zeros(1, 8, 64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        module.attention(q, q, q)
    with pytest.raises(ValueError, match="fallback must be None or 'sdpa'"):
        module.attention(q, q, q, fallback="eager")
    assert module.NoKernelError.__name__ == "NoKernelError"


def alter(text: str, var: str, change: Callable[[str], str]) -> str:
    """``text`` with the body of the literal assigned to ``var`` passed through ``change``."""
    start = text.index(f"\n{var} = ") + len(var) + 4
    quote = text[start:start + 4].lstrip("r")[:3]
    body_start = text.index(quote, start) + 3
    body_end = text.index(quote, body_start)
    body = text[body_start:body_end]
    changed = change(body)
    assert changed != body
    return text[:body_start] + changed + text[body_end:]


@pytest.mark.parametrize(("var", "change", "message"), [
    ("_SOURCE_1", lambda s: s.replace("BLOCK_N", "BLOCK_M", 1),
     "the CUDA source of kernel {b} does not match its recorded sha256"),
    ("_CUBIN_0", lambda s: s[:200] + ("A" if s[200] != "A" else "B") + s[201:],
     "the cubin of kernel {a} "),
])
def test_an_altered_module_refuses_to_import(built: Built, tmp_path: Path, var: str,
                                             change: Callable[[str], str], message: str) -> None:
    (tmp_path / "tuned_attention.py").write_text(alter(built.text, var, change))
    done = import_fresh(tmp_path)
    assert done.returncode != 0
    expected = message.format(a=built.a.identity, b=built.b.identity)
    assert f"IntegrityError: {expected}" in done.stderr
    assert "this module was altered; export it again" in done.stderr


def test_two_modules_with_the_same_kernels_coexist(module: ModuleType, built: Built) -> None:
    again = import_path(built.module_path, "tuned_attention_again")
    assert again.attention.namespace == f"{module.attention.namespace}_2"


def test_study_filter(built: Built, tmp_path: Path) -> None:
    s1 = export_best(built.db, "sm_90a", study="s1", output=tmp_path / "s1.py")  # forward only
    assert s1.kernels == [built.a.identity, built.b.identity] and len(s1.entries) == 3
    assert "study     s1" in s1.path.read_text()
    s2 = export_best(built.db, "sm_90a", study="s2", output=tmp_path / "s2.py")
    assert s2.kernels == [built.c.identity, built.bwd.identity]
    assert "bf16 head_dim 128 causal at sk 1024; backward fp16 head_dim 64 non-causal at sk " \
           "1024" in s2.summary()


@pytest.mark.parametrize(("arch", "study", "message"), [
    ("sm_90a", "nope", "no elites for sm_90a from study 'nope'; it has elites for sm_80, "
                       "sm_90a (studies on sm_90a: s1, s2)"),
    ("sm_89", None, "no elites for sm_89; it has elites for sm_80, sm_90a"),
])
def test_nothing_to_export_says_what_there_is(built: Built, tmp_path: Path, arch: str,
                                              study: str | None, message: str) -> None:
    with pytest.raises(ExportError, match=re.escape(message)):
        export_best(built.db, arch, study=study, output=tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()


def test_an_elite_of_another_kind_than_its_workload_is_refused(built: Built,
                                                                tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'mixed.db'}") as store:
        add(store, built.bwd)
        win(store, Workload(1, 8, 512, 64), [(built.bwd.identity, 10.0)], study="s1")
    with pytest.raises(ExportError, match=f"elite {built.bwd.identity} is a bwd/varlen_bwd "
                                          "kernel but won fwd workloads"):
        export_best(tmp_path / "mixed.db", "sm_90a", output=tmp_path / "x.py")


def test_a_missing_store_is_refused_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "e.db"
    for store in (missing, str(missing), f"sqlite:///{missing}"):
        with pytest.raises(FileNotFoundError, match=f"no store at {re.escape(str(missing))}"):
            export_best(store, "sm_90a", output=tmp_path / "x.py")
    assert not missing.parent.exists()


def test_load_gives_the_same_dispatch_from_the_store(module: ModuleType, built: Built,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINE_CACHE", str(built.db.parent / "cache"))
    attention = evoengine.load(store=str(built.db), arch="sm_90a")
    assert attention.namespace.startswith("evoload_")
    assert [k.name for k in attention.kernels] == [k.name for k in module.attention.kernels]
    assert [k.cubin for k in attention.kernels] == [k.cubin for k in module.attention.kernels]
    assert list(map(repr, attention.entries)) == list(map(repr, module.DISPATCH))
    only_s2 = load(built.db, "sm_90a", study="s2")
    assert list(only_s2.table) == [("bf16", 128, True)]
    assert list(only_s2.backward_table) == [("fp16", 64, False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_load_without_arch_needs_a_gpu(built: Built) -> None:
    from evoengine.runtime import NoGPUError

    with pytest.raises(NoGPUError):
        evoengine.load(store=str(built.db))


def test_an_elite_from_an_older_template_ships_its_stored_source(
        built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINE_CACHE", str(built.db.parent / "cache"))
    cand = built.a
    old_identity = cand.identity.rsplit("-", 1)[0] + "-0ldtemplate0"
    old_source = render(cand).replace("// FlashAttention-2", "// (older template) FlashAttention-2")
    with Store(f"sqlite:///{tmp_path / 'old.db'}") as store:
        add(store, cand, source=old_source, identity=old_identity)
        win(store, Workload(1, 8, 512, 64), [(old_identity, 11.0)], study="s1")
    done = export_best(tmp_path / "old.db", "sm_90a", output=tmp_path / "old.py")
    (kernel,) = import_path(done.path, "tuned_attention_old").attention.kernels
    assert kernel.name == old_identity and kernel.source == old_source
    assert kernel.cubin[:4] == b"\x7fELF"


RECORD = (Path(__file__).parent / "data"
          / "sweep-sm_90a-b8-h16-kv16-sq4096-sk4096-d128-causal-fp16.json.gz")


def test_a_store_from_before_a_parameter_was_added_exports(
        built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A point stored without TILE_ORDER and SCHEDULER (the layout of the recorded sweep, and
    of a store written by replaying it) exports with their legacy values; the same kernel
    stored in today's layout for another workload is one kernel in the module."""
    from evoengine.search.replay import load_record

    monkeypatch.setenv("EVOENGINE_CACHE", str(built.db.parent / "cache"))
    record = load_record(RECORD)
    best = min((p for p in record.points if p.family == "wgmma" and p.ok),
               key=lambda p: p.median_us)  # type: ignore[arg-type,return-value]
    assert "TILE_ORDER" not in best.params and "SCHEDULER" not in best.params
    problem = record.workload.problem()
    old_identity = make_identity("wgmma", problem, best.params)  # as the replay stores it
    space = SearchSpace.load(paths.SPACES / "wgmma.toml")
    legacy = {"TILE_ORDER": "head", "SCHEDULER": "static", "PACK_GQA": False,
              "P_BARRIER": "warpgroup", "O_STAGE": "own_or_q", "O_STORE": "threads"}
    assert space.legacy == legacy
    today = make_candidate(space, {**best.params, **legacy}, problem, ARCH)
    other = Workload(2, 16, 4096, 128, causal=True)
    with Store(f"sqlite:///{tmp_path / 'before.db'}") as store:
        store.add_candidate(identity=old_identity, family="wgmma",
                            template_hash=template_hash("wgmma"), params=best.params,
                            problem=problem, source="")
        win(store, record.workload, [(old_identity, best.median_us)], study="replay")
        add(store, today)
        win(store, other, [(today.identity, 300.0)], study="today")
    done = export_best(tmp_path / "before.db", "sm_90a", output=tmp_path / "before.py")
    assert done.kernels == [today.identity] and len(done.entries) == 2
    module = import_path(done.path, "tuned_attention_before")
    (spec,) = module._KERNEL_SPECS
    assert spec["params"] == {**best.params, **legacy}
    (kernel,) = module.attention.kernels
    assert kernel.source == render(today) and kernel.cubin[:4] == b"\x7fELF"


def test_render_module_is_deterministic_given_its_inputs(tmp_path: Path) -> None:
    prov = {"arch": "sm_90a", "exporter": "evoengine x", "store": "s", "study": None,
            "commit": None, "exported_at": "t", "compiler": "nvrtc", "launcher_sha256": "0" * 64,
            "runs": []}
    spec = {"name": "k", "family": "mma", "problem": dict(FP16_64), "params": {},
            "block_m": 64, "threads": 128, "smem_bytes": 8192, "defines": {},
            "source": "a '' \\ \"\"\" source\n", "source_sha256": launch.sha256(
                "a '' \\ \"\"\" source\n"), "cubin": b"\x7fELF", "cubin_sha256":
            launch.sha256(b"\x7fELF")}
    entries = [launch.Entry(0, "fp16", 64, False, 512, 512, 1, 8, 1.0, "w")]
    text = render_module([spec], entries, prov)
    assert text == render_module([spec], entries, prov)
    (tmp_path / "generated.py").write_text(text)
    generated = import_path(tmp_path / "generated.py", "tuned_attention_generated")
    assert generated.attention.kernels[0].source == spec["source"]  # quotes, backslashes

