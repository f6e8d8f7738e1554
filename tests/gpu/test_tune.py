"""``evoengine tune`` end to end on the GPU: a tiny decoder's config.json (written here), the
forward and backward tuned over its prefill ladder in one short ``--timeout``, the module it
exports covering the geometry (both dtypes, both masks, any length and batch: every call
finds a kernel of ours, tuned or derived, and passes the criterion, forward and gradients),
and a rerun that skips every finished workload.

``EVO_TUNE_TIMEOUT`` sets the budget (default 40s: six workloads, each held to the 10 s
floor, then the cross re-time) and ``EVO_TUNE_KINDS`` the kinds (default fwd,bwd). Each
search adds its worker's start, SDPA's baseline and its elites' final re-time to its share,
so the whole takes minutes: on the H100 at d470f69 (6 workloads, the cross re-time, the
export, the checks and the rerun) the file took 349 s, 7 passed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from evoengine import tune as evotune
from evoengine import validate
from evoengine.arch import get_arch
from evoengine.geometry import from_config
from evoengine.problems import problem
from evoengine.store import Store
from evoengine.tune import TunePlan
from tests.gpu.test_export import grads_verdict
from tests.test_export import import_path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "torch_dtype": "float16"}
TIMEOUT = os.environ.get("EVO_TUNE_TIMEOUT", "40s")
KINDS = os.environ.get("EVO_TUNE_KINDS", "fwd,bwd")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, heads, kv_heads, seq_q, seq_k, layout): off the ladder, between and beyond it,
# GQA, Sq != Sk, strided views, tails.
SHAPES = [(1, 4, 2, 77, 77, "bhsd"), (3, 4, 2, 700, 700, "bshd"), (1, 4, 2, 2000, 2000, "bhsd"),
          (2, 4, 2, 300, 900, "bshd"), (16, 4, 2, 512, 512, "bhsd"), (1, 4, 2, 1, 1500, "bhsd")]


def tune(folder: Path) -> tuple[int, str]:
    """Run the command, its output streamed as it comes (``pytest -s`` shows it live, so a
    run cut short still says how far it got); its exit status and output."""
    cmd = [sys.executable, "-m", "evoengine", "tune", str(folder / "tiny-llama" / "config.json"),
           "--kinds", KINDS, "--timeout", TIMEOUT, "--store", str(folder / "evo.db"),
           "-o", str(folder / "tiny_attention.py")]
    print(f"$ evoengine tune ... --kinds {KINDS} --timeout {TIMEOUT}", flush=True)
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        status = proc.wait(timeout=900)
    return status, "".join(lines)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModuleType]:
    root = tmp_path_factory.mktemp("gpu-tune")
    (root / "tiny-llama").mkdir()
    (root / "tiny-llama" / "config.json").write_text(json.dumps(CONFIG))
    status, output = tune(root)
    assert status == 0, output[-3000:]
    return root, import_path(root / "tiny_attention.py", "tiny_attention_gpu")


def test_the_module_covers_the_geometry_with_no_refusal(tuned: tuple[Path, ModuleType]) -> None:
    _, module = tuned
    attention = module.attention
    served: list[str] = []
    for dtype, torch_dtype in DTYPES.items():
        for causal in (False, True):
            for b, h, kv, sq, sk, layout in SHAPES:
                q = torch.empty(b, h, sq, 64, dtype=torch_dtype, device="cuda")
                k = torch.empty(b, kv, sk, 64, dtype=torch_dtype, device="cuda")
                for kind in KINDS.split(","):
                    why = attention.explain(q, k, k, causal=causal, kind=kind)
                    assert why.entry is not None, str(why)
                    assert why.tuned == (dtype == "fp16" and causal)
                verdict = validate.check(functools.partial(attention.forward, causal=causal),
                                         batch=b, heads=h, kv_heads=kv, seq_q=sq, seq_k=sk,
                                         head_dim=64, causal=causal, dtype=torch_dtype,
                                         layout=layout)
                assert verdict.ok, f"{dtype} causal={causal} {b, h, kv, sq, sk}: {verdict.reason}"
                served.append(str(attention.explain(q, k, k, causal=causal)))
    print("\n".join(served[:: len(SHAPES)]))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_every_dtype_and_mask(tuned: tuple[Path, ModuleType], dtype: str,
                                           causal: bool) -> None:
    if "bwd" not in KINDS.split(","):
        pytest.skip("EVO_TUNE_KINDS tunes no backward")
    _, module = tuned
    for b, h, kv, sq, sk, layout in ((2, 4, 2, 300, 700, "bhsd"), (1, 4, 2, 513, 400, "bshd")):
        verdict = grads_verdict(module.attention, b, h, kv, sq, sk, causal, layout,
                                dtype=DTYPES[dtype])
        assert verdict.ok, f"{dtype} causal={causal} {b, h, kv, sq, sk}: {verdict.reason}"


def plan(root: Path) -> TunePlan:
    return evotune.plan(from_config(root / "tiny-llama" / "config.json"), get_arch("sm_90a"),
                        name="tiny-llama", kinds=KINDS.split(","))


def test_the_cross_retime_timed_every_rung_and_its_cell(tuned: tuple[Path, ModuleType]) -> None:
    """Each rung of a crossed kind: a done run on it and on each of its cell's workloads,
    holding a final-phase time of every candidate, and the rung's elites from that run."""
    root, _ = tuned
    tp = plan(root)
    assert tp.crossed == tuple(KINDS.split(","))
    with Store(f"sqlite:///{root / 'evo.db'}") as store:
        runs = {r.study: r for r in store.runs() if "/cross/" in (r.study or "")}
        for part in tp.parts:
            cell = problem(part.kind).cell_workloads(part.workload)
            for w in (*cell, part.workload):
                run = runs[f"tiny-llama/cross/sm_90a-{w.key()}"]
                times = [m for m in store.measurements(run_id=run.id)
                         if m.extra.get("phase") == "final" and m.extra.get("cross")]
                assert run.status == "done" and len(times) >= 2, w.key()
                assert all(m.median_us and m.median_us > 0 for m in times)
            top = store.elites(arch="sm_90a", workload_key=part.workload.key())[0]
            assert top.run_id == runs[f"tiny-llama/cross/sm_90a-{part.workload.key()}"].id


def test_a_rerun_skips_every_finished_workload(tuned: tuple[Path, ModuleType]) -> None:
    root, _ = tuned
    status, output = tune(root)
    n = len(plan(root).parts)
    assert status == 0
    skipped = [line for line in output.splitlines()
               if line.startswith("[") and "finished before" in line and line.endswith("skipped")]
    assert len(skipped) == 2 * n, output  # each search, then each rung's cross re-time
    assert f"0 workloads searched now, {n} finished before, of {n}" in output
