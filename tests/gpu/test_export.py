"""The exported module on a real GPU: the criterion for every dispatch entry and between
them in a fresh process, the public call (strided views, GQA, Sq != Sk), CUDA-graph
capture, torch.compile, a Transformers Llama against SDPA, the fallbacks, and
``evoengine.load``; and training: gradients through ``attention`` against the float64
reference, torch.compile of forward and backward, a Llama training step against SDPA.

The store is built here: four admitted ``mma`` points and two ``mma_bwd`` points for this
GPU's target (on sm_90a also an ``mma`` d128 point and a ``wgmma_bwd`` point with a group
split), each the rank-1 elite of a made-up workload. What is tested is the export and
the launch, not the search, so the timings in the store are made up too.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

import evoengine
from evoengine import paths, validate
from evoengine.export import export_best
from evoengine.problems.backward import BackwardWorkload
from evoengine.render import make_candidate, render
from evoengine.runtime import gpu_arch
from evoengine.space import SearchSpace
from evoengine.store import Store
from evoengine.workload import Workload
from tests.test_export import import_path

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (family, problem, preferred parameters, workloads it wins)
WINNERS = [
    ("mma", {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_M=64, NUM_WARPS=4, SWIZZLE="xor"), [Workload(1, 8, 256, 64)]),
    ("mma", {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_M=128, NUM_WARPS=8, STAGES=2), [Workload(1, 8, 2048, 64)]),
    ("mma", {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": True},
     dict(BLOCK_M=128, BLOCK_N=64, NUM_WARPS=4), [Workload(2, 8, 512, 64, kv_heads=2,
                                                           causal=True)]),
    ("mma", {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True},
     dict(BLOCK_M=64, BLOCK_N=32), [Workload(1, 4, 1024, 128, kv_heads=1, seq_k=1536,
                                             causal=True, dtype="bf16")]),
    # Backward kernels for fp16 d64 only: bf16 d128 causal has a forward and no backward.
    ("mma_bwd", {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, DQ_ACCUM="atomic"),
     [BackwardWorkload(1, 8, 512, 64)]),
    ("mma_bwd", {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": True},
     dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, DQ_ACCUM="atomic"),
     [BackwardWorkload(2, 8, 512, 64, kv_heads=2, causal=True)]),
    # sm_90a only (elsewhere the family has no point, and the entry is left out): fp16 d128
    # without the mask, forward and a wgmma_bwd backward whose group is dealt to 4 blocks.
    ("mma", {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_M=64), [Workload(1, 8, 1024, 128, kv_heads=2)]),
    ("wgmma_bwd", {"HEAD_DIM": 128, "DTYPE": "fp16", "CAUSAL": False},
     dict(BLOCK_N=128, BLOCK_M=64, LOADER="tma", GROUP_SPLIT=4),
     [BackwardWorkload(1, 8, 1024, 128, kv_heads=2)]),
]


@dataclass
class Exported:
    db: Path
    path: Path
    module: ModuleType


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    arch = gpu_arch()
    root = tmp_path_factory.mktemp("gpu-export")
    db = root / "evo.db"
    with Store(f"sqlite:///{db}") as store:
        for family, problem, want, workloads in WINNERS:
            space = SearchSpace.load(paths.SPACES / f"{family}.toml")
            if not space.supports(arch) or (family == "mma" and problem["HEAD_DIM"] == 128
                                            and arch.name != "sm_90a"):
                continue  # the split backward's pair (above) is sm_90a's
            points = space.admitted(problem, arch)
            point = next((p for p in points if all(p[k] == v for k, v in want.items())),
                         points[0])
            cand = make_candidate(space, point, problem, arch)
            store.add_candidate(identity=cand.identity, family=cand.family,
                                template_hash=cand.template_hash, params=cand.params,
                                problem=cand.problem, source=render(cand))
            for w in workloads:
                run = store.start_run(arch=arch.name, workload=w.to_dict(),
                                      workload_key=w.key(), device=torch.cuda.get_device_name(),
                                      study="gpu-test")
                store.set_elites(arch=arch.name, workload_key=w.key(),
                                 entries=[(cand.identity, 100.0)], run_id=run)
    done = export_best(db, arch, output=root / "tuned_attention.py")
    yield Exported(db, done.path, import_path(done.path, "tuned_attention_gpu"))


def shapes_for(entries: list) -> list[tuple[int, int, int, int, int, str]]:
    """(batch, heads, kv_heads, seq_q, seq_k, layout): each entry's own lengths, lengths
    between and beyond them, GQA and MQA, Sq != Sk both ways, strided views, tails."""
    seqs = sorted({e.seq_k for e in entries})
    shapes = [(1, 4, 4, e.seq_q, e.seq_k, "bhsd") for e in entries]
    for lo, hi in zip(seqs, seqs[1:], strict=False):
        mid = math.isqrt(lo * hi)
        shapes += [(1, 4, 2, mid - 1, mid - 1, "bhsd"), (2, 4, 4, mid + 3, mid + 1, "bshd")]
    shapes += [(2, 8, 2, 333, seqs[-1] + 500, "bshd"), (1, 6, 1, 700, 129, "bhsd"),
               (1, 2, 2, 1, 1500, "bhsd"), (2, 3, 3, 77, 77, "bhsd"),
               (1, 4, 4, max(1, seqs[0] // 3), max(1, seqs[0] // 3), "bshd")]
    return shapes


FRESH = """
import functools, json, sys
sys.path.insert(0, sys.argv[1])
import tuned_attention as t
assert not [m for m in sys.modules if m.split(".")[0] == "evoengine"], "imported evoengine"
import torch
from evoengine import validate
from tests.gpu.test_export import TORCH_DTYPE, shapes_for
out = []
for (dtype, head_dim, causal), entries in t.attention.table.items():
    for b, h, kv, sq, sk, layout in shapes_for(entries):
        fn = functools.partial(t.attention.forward, causal=causal)
        verdict = validate.check(fn, batch=b, heads=h, kv_heads=kv, seq_q=sq, seq_k=sk,
                                 head_dim=head_dim, causal=causal, dtype=TORCH_DTYPE[dtype],
                                 layout=layout)
        picked = t.attention.select(dtype, head_dim, causal, sq, sk, b * h)
        out.append({"key": [dtype, head_dim, causal], "shape": [b, h, kv, sq, sk, layout],
                    "ok": verdict.ok, "reason": verdict.reason, "kernel": picked.kernel})
print(json.dumps(out))
"""


def test_fresh_process_passes_the_criterion_everywhere(exported: Exported) -> None:
    done = subprocess.run([sys.executable, "-c", FRESH, str(exported.path.parent)],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    table = exported.module.attention.table
    assert len(results) == sum(len(shapes_for(g)) for g in table.values())
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['key']} {r['shape']}: {r['reason']}" for r in failed)
    # Every kernel in the table served some call, each entry's own lengths its own kernel.
    forward = [e for e in exported.module.DISPATCH if e.kind == "fwd"]
    assert {r["kernel"] for r in results} == {e.kernel for e in forward}
    for e in forward:
        own = [r for r in results if r["key"] == [e.dtype, e.head_dim, e.causal]
               and r["shape"][3:5] == [e.seq_q, e.seq_k]]
        assert own and all(r["kernel"] == e.kernel for r in own)


def public(attention: ModuleType, causal: bool):  # type: ignore[no-untyped-def]
    """The criterion's call made through the public ``attention(q, k, v, causal, scale)``."""
    def fn(q, k, v, *, scale=None, out=None, lse=None):  # type: ignore[no-untyped-def]
        return out.copy_(attention(q, k, v, causal=causal, scale=scale))
    return fn


@pytest.mark.parametrize(("causal", "shape"), [
    (False, (2, 8, 2, 300, 700, "bshd")), (True, (1, 8, 2, 513, 400, "bhsd")),
    (True, (3, 8, 8, 64, 1000, "bshd")),
])
def test_public_call(exported: Exported, causal: bool, shape: tuple) -> None:
    b, h, kv, sq, sk, layout = shape
    for scale in (None, 0.05):
        verdict = validate.check(public(exported.module.attention, causal), batch=b, heads=h,
                                 kv_heads=kv, seq_q=sq, seq_k=sk, head_dim=64, causal=causal,
                                 dtype=torch.float16, scale=scale, with_lse=False,
                                 layout=layout)
        assert verdict.ok, verdict.reason


def qkv(b: int = 2, h: int = 8, kv: int = 2, sq: int = 300, sk: int = 300, d: int = 64,
        dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, h, sq, d, device="cuda", dtype=dtype),
            torch.randn(b, kv, sk, d, device="cuda", dtype=dtype),
            torch.randn(b, kv, sk, d, device="cuda", dtype=dtype))


def test_views_of_bshd_projections_need_no_copy(exported: Exported) -> None:
    attention = exported.module.attention
    b, s, h, d = 2, 257, 8, 64
    proj = torch.randn(b, s, 3 * h * d, device="cuda", dtype=torch.float16)
    q, k, v = (x.view(b, s, h, d).transpose(1, 2) for x in proj.split(h * d, dim=-1))
    assert not q.is_contiguous() and q.data_ptr() == proj.data_ptr()
    out = attention(q, k, v, causal=True)
    as_bshd = attention(q, k, v, causal=True, bshd=True)
    assert out.is_contiguous() and as_bshd.transpose(1, 2).is_contiguous()
    assert torch.equal(out, as_bshd)
    ref, _ = validate.reference(q, k, v, causal=True)
    verdict = validate.judge(out, ref, validate.sdpa(q, k, v, causal=True))
    assert verdict.ok, verdict.reason


def test_cuda_graph_capture(exported: Exported) -> None:
    attention = exported.module.attention
    q, k, v = qkv()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, causal=True)
    for _ in range(3):  # new inputs each replay: a launch outside the graph would go stale
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attention(q, k, v, causal=True))


def test_runs_from_another_thread_and_stream(exported: Exported) -> None:
    attention = exported.module.attention
    q, k, v = qkv()
    expected = attention(q, k, v)
    got: list[torch.Tensor] = []

    def work() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            got.append(attention(q, k, v))
        stream.synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert torch.equal(got[0], expected)


def test_torch_compile_traces_the_custom_op_without_breaks(exported: Exported) -> None:
    attention = exported.module.attention
    graphs: list[str] = []

    def record(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(str(gm.graph))
        return gm.forward

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q * 0.5, k, v, causal=True).transpose(1, 2).float().sum(-1)

    torch._dynamo.reset()
    q, k, v = qkv()
    eager = layer(q, k, v)
    torch.testing.assert_close(torch.compile(layer, backend=record, fullgraph=True)(q, k, v),
                               eager)
    assert len(graphs) == 1 and f"{attention.namespace}.attention" in graphs[0]
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        compiled = torch.compile(layer, mode=mode, fullgraph=True)
        for sq in (300, 300, 300, 160):
            q, k, v = qkv(sq=sq, sk=sq + 40)
            torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), atol=2e-2, rtol=1e-3)


def test_fallback_to_sdpa_is_opt_in(exported: Exported) -> None:
    attention = exported.module.attention
    q, k, v = qkv(d=96)
    with pytest.raises(exported.module.NoKernelError, match="no tuned kernel for torch.float16 "
                       "head_dim 96 non-causal; this module has kernels for: "):
        attention(q, k, v)
    out = attention(q, k, v, fallback="sdpa")
    assert torch.equal(out, validate.sdpa(q, k, v, causal=False))
    q32, k32, v32 = (x.float() for x in qkv())
    with pytest.raises(ValueError, match="q must be float16 or bfloat16, got torch.float32"):
        attention(q32, k32, v32)
    ref, _ = validate.reference(q32, k32, v32, causal=True)
    out32 = attention(q32, k32, v32, causal=True, fallback="sdpa")
    assert out32.dtype == torch.float32 and (out32.double() - ref).abs().max() < 2e-3


def test_bad_inputs_on_the_gpu(exported: Exported) -> None:
    attention = exported.module.attention
    q, k, v = qkv(h=8, kv=2)
    padded = torch.randn(2, 8, 300, 68, device="cuda", dtype=torch.float16)[..., :64]
    cases = [
        ((q, k.to(torch.bfloat16), v.to(torch.bfloat16)), "q, k, v must share a dtype"),
        ((q, k, v[:, :, :10]), "k and v must have one shape"),
        ((q[:, :3], k, v), r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        ((q.transpose(2, 3).contiguous().transpose(2, 3), k, v),
         "q must have a contiguous last dim"),
        ((q[:, :, :0], k, v), "q is empty"),
        ((padded, k, v), "q must be 16-byte aligned"),
        ((q, k[..., :32], v[..., :32]), r"k, v must be \[2, kv_heads, seq_k, 64\]"),
        ((q.cpu(), k, v), "q must be a CUDA tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            attention(*args)
    # Arguments that torch would have converted (float("0.1"), bool("no")), and an lse given
    # without out (once written unchecked): refused before any launch, as on the CPU.
    for kw, error, message in ((dict(scale="0.1"), TypeError, "scale must be a float"),
                               (dict(causal="no"), TypeError, "causal must be a bool")):
        with pytest.raises(error, match=message):
            attention(q, k, v, **kw)
        with pytest.raises(error, match=message):
            attention(q.requires_grad_(), k, v, **kw)  # through the custom op
        q = q.detach()
    lse = torch.empty(2, 8, q.shape[2], device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="lse must be a contiguous float32"):
        attention.forward(q, k, v, lse=lse)
    torch.cuda.synchronize()


def test_embedded_source_builds_for_this_gpu(exported: Exported) -> None:
    module = exported.module
    (spec,) = [s for s in module._KERNEL_SPECS if s["kind"] == "fwd"
               and s["problem"] == {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": True}]
    source_only = module.kernel_from_spec({**spec, "cubin": None}, None)
    verdict = validate.check(source_only, batch=2, heads=8, kv_heads=2, seq_q=300, seq_k=420,
                             head_dim=64, causal=True, dtype=torch.float16)
    assert verdict.ok, verdict.reason
    elsewhere = module.kernel_from_spec(spec, "sm_80" if module.ARCH != "sm_80" else "sm_86")
    with pytest.warns(RuntimeWarning, match="compiling its source"):
        verdict = validate.check(elsewhere, batch=1, heads=2, kv_heads=2, seq_q=100,
                                 seq_k=100, head_dim=64, causal=True, dtype=torch.float16)
    assert verdict.ok, verdict.reason


def test_load_from_the_store(exported: Exported) -> None:
    attention = evoengine.load(store=str(exported.db))
    assert attention.namespace != exported.module.attention.namespace
    for causal in (False, True):
        verdict = validate.check(functools.partial(attention.forward, causal=causal), batch=2,
                                 heads=8, kv_heads=2, seq_q=600, seq_k=600, head_dim=64,
                                 causal=causal, dtype=torch.float16)
        assert verdict.ok, verdict.reason


# ---- training ------------------------------------------------------------------------------

def grads_verdict(attention: ModuleType, b: int, h: int, kv: int, sq: int, sk: int,
                  causal: bool, layout: str = "bhsd", fallback: str | None = None,
                  dtype: torch.dtype = torch.float16, d: int = 64) -> validate.Verdict:
    """The backward criterion on gradients that autograd takes through ``attention``."""
    gen = torch.Generator(device="cuda").manual_seed(sq * 31 + sk)

    def leaf(heads: int, s: int) -> torch.Tensor:
        shape = (b, s, heads, d) if layout == "bshd" else (b, heads, s, d)
        x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        x = x.transpose(1, 2) if layout == "bshd" else x
        return x.detach().requires_grad_()

    q, k, v = leaf(h, sq), leaf(kv, sk), leaf(kv, sk)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(dtype)
    attention(q, k, v, causal=causal, fallback=fallback).backward(dout)
    refs = validate.reference_grads(q, k, v, dout, causal=causal)
    baselines = validate.sdpa_grads(q, k, v, dout, causal=causal)
    no_key = None
    if causal and sq > sk:
        no_key = torch.arange(sq, device="cuda") < sq - sk
    return validate.judge_grads((q.grad, k.grad, v.grad), refs, baselines, no_key_rows=no_key)


def backward_launches(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the backward kernels the module launches from now on, in order."""
    launches: list[str] = []
    launch = module.CudaBackward.launch

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(self.name)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(module.CudaBackward, "launch", counted)
    return launches


@pytest.mark.parametrize("shape", [
    (2, 8, 2, 300, 700, False, "bhsd"), (1, 8, 8, 512, 512, False, "bshd"),
    (2, 8, 2, 513, 400, True, "bhsd"), (1, 4, 1, 77, 77, True, "bshd"),
])
def test_gradients_match_the_reference(exported: Exported, shape: tuple,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    launches = backward_launches(exported.module, monkeypatch)
    verdict = grads_verdict(exported.module.attention, *shape)
    assert verdict.ok, verdict.reason
    assert len(launches) == 1  # the tuned backward kernel, not SDPA's


@pytest.mark.parametrize("shape", [
    (2, 8, 2, 300, 700, False, "bshd"), (1, 8, 1, 77, 129, False, "bhsd"),
    (1, 4, 4, 513, 513, False, "bhsd"),
])
def test_split_group_backward_from_the_module(exported: Exported, shape: tuple,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported wgmma_bwd kernel with GROUP_SPLIT 4 (sm_90a): its shares of dK and dV and
    the fourth kernel that adds them, through autograd, on groups of 4, 8 and 1."""
    if gpu_arch().name != "sm_90a":
        pytest.skip("wgmma_bwd targets sm_90a")
    splits: list[int] = []
    launch = exported.module.CudaBackward.launch

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        splits.append(self.group_split)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(exported.module.CudaBackward, "launch", counted)
    verdict = grads_verdict(exported.module.attention, *shape, d=128)
    assert verdict.ok, verdict.reason
    assert splits == [4]


def test_deterministic_backward_is_bitwise_repeatable(exported: Exported) -> None:
    attention = exported.module.attention
    q, k, v = qkv(sq=700, sk=700)
    out, lse = attention.forward_lse(q, k, v, causal=True)
    dout = torch.randn_like(out)
    first = attention.backward(q, k, v, out, lse, dout, causal=True, deterministic=True)
    again = attention.backward(q, k, v, out, lse, dout, causal=True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_no_backward_kernel_raises_one_line_or_runs_sdpa(exported: Exported) -> None:
    attention = exported.module.attention  # bf16 d128 causal: a forward kernel, no backward
    with pytest.raises(exported.module.NoKernelError) as info:
        grads_verdict(attention, 1, 4, 1, 300, 300, True, dtype=torch.bfloat16, d=128)
    assert str(info.value).startswith("no tuned backward kernel for torch.bfloat16 head_dim "
                                      "128 causal; this module has backward kernels for: ")
    assert "\n" not in str(info.value)
    verdict = grads_verdict(attention, 1, 4, 1, 300, 300, True, fallback="sdpa",
                            dtype=torch.bfloat16, d=128)
    assert verdict.ok, verdict.reason


def test_torch_compile_traces_forward_and_backward_without_breaks(exported: Exported) -> None:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    attention = exported.module.attention
    graphs: dict[str, list[str]] = {"fw": [], "bw": []}

    def record(gm: torch.fx.GraphModule, inputs: list) -> object:
        def compiler(which: str):  # type: ignore[no-untyped-def]
            def compile_graph(g: torch.fx.GraphModule, _: list) -> object:
                graphs[which].append(str(g.graph))
                return make_boxed_func(g.forward)
            return compile_graph
        return aot_module_simplified(gm, inputs, fw_compiler=compiler("fw"),
                                     bw_compiler=compiler("bw"))

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q * 0.5, k, v, causal=True).float().square().sum()

    def grads(fn, q, k, v):  # type: ignore[no-untyped-def]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    torch._dynamo.reset()
    q, k, v = qkv()
    eager = grads(loss, q, k, v)
    traced = grads(torch.compile(loss, backend=record, fullgraph=True), q, k, v)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b)
    assert len(graphs["fw"]) == len(graphs["bw"]) == 1
    assert f"{attention.namespace}.attention" in graphs["fw"][0]
    assert f"{attention.namespace}.attention_backward" in graphs["bw"][0]
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    for sq in (300, 300, 160):
        q, k, v = qkv(sq=sq, sk=sq + 40)
        for a, b in zip(grads(compiled, q, k, v), grads(loss, q, k, v), strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-3)


# ---- Transformers ---------------------------------------------------------------------------

def llama(attn_implementation: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def llamas(attn_implementation: str, train: bool = False) -> dict[str, torch.nn.Module]:
    """One tiny Llama's weights three ways: float32 SDPA ("exact", the yardstick), fp16 SDPA
    ("sdpa") and fp16 ``attn_implementation`` ("ours")."""
    torch.manual_seed(0)
    exact = llama("sdpa").train(train).to("cuda")
    sdpa = llama("sdpa").train(train).to("cuda", torch.float16)
    ours = llama(attn_implementation).train(train).to("cuda", torch.float16)
    sdpa.load_state_dict(exact.state_dict())
    ours.load_state_dict(exact.state_dict())
    return {"exact": exact, "sdpa": sdpa, "ours": ours}


def assert_training_step_matches(models: dict[str, torch.nn.Module], ids: torch.Tensor,
                                 **kwargs: torch.Tensor) -> None:
    """One step of each model on ``ids`` (labels: ``ids`` unless given): ours' loss and every
    parameter's gradient as close to the float32 model's as fp16 SDPA's, within the
    criterion's factor; no parameter of ours left without a gradient."""
    kwargs.setdefault("labels", ids)
    losses = {}
    for name, model in models.items():
        out = model(ids, **kwargs)
        out.loss.backward()
        losses[name] = out.loss.item()
    factor = validate.ERR_FACTOR
    assert abs(losses["ours"] - losses["exact"]) <= (
        factor * abs(losses["sdpa"] - losses["exact"]) + 1e-3), losses
    for (name, p_exact), p_sdpa, p_ours in zip(models["exact"].named_parameters(),
                                               models["sdpa"].parameters(),
                                               models["ours"].parameters(), strict=True):
        assert p_ours.grad is not None, f"{name} got no gradient"
        ref = p_exact.grad
        sdpa_err = (p_sdpa.grad.float() - ref).abs().max().item()
        ours_err = (p_ours.grad.float() - ref).abs().max().item()
        floor = validate.ulp_at(torch.float16, ref.abs().max().item()) + validate.GRAD_FLOOR
        assert ours_err <= factor * sdpa_err + floor, (name, ours_err, sdpa_err)


@torch.no_grad()
def test_transformers_llama_matches_sdpa(exported: Exported,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    module = exported.module
    assert module.register_transformers() == "evoengine"
    models = llamas("evoengine")
    exact, sdpa, ours = models["exact"], models["sdpa"], models["ours"]
    launches = []
    launch = module.CudaKernel.launch
    monkeypatch.setattr(module.CudaKernel, "launch",
                        lambda self, *a: (launches.append(self.causal), launch(self, *a))[1])

    ids = torch.randint(0, 1000, (2, 200), device="cuda")
    step = torch.randint(0, 1000, (2, 1), device="cuda")
    prefill = {name: m(ids, use_cache=True) for name, m in
               (("exact", exact), ("sdpa", sdpa), ("ours", ours))}
    assert launches == [True, True]  # two layers, causal prefill, through the tuned kernels
    decode = {name: m(step, past_key_values=prefill[name].past_key_values)
              for name, m in (("exact", exact), ("sdpa", sdpa), ("ours", ours))}
    assert launches == [True, True, False, False]  # one query sees every cached key
    for phase in (prefill, decode):
        ref = phase["exact"].logits
        ours_err = (phase["ours"].logits.float() - ref).abs().max().item()
        sdpa_err = (phase["sdpa"].logits.float() - ref).abs().max().item()
        assert ours_err <= 2 * sdpa_err + 1e-3, (ours_err, sdpa_err)

    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    with pytest.raises(ValueError, match="cannot serve an attention mask"):
        ours(ids, attention_mask=mask)
    module.register_transformers(fallback="sdpa")
    try:
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits,
                                   sdpa(ids, attention_mask=mask).logits)
    finally:
        module.register_transformers()


def test_transformers_llama_training_step_matches_sdpa(exported: Exported,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One training step of a tiny Llama (GQA, head_dim 64, fp16): loss and every parameter's
    gradient as close to the float32 model's as SDPA's in fp16 is, within the criterion's
    factor; attention's forward and backward run the tuned kernels."""
    pytest.importorskip("transformers")
    module = exported.module
    assert module.register_transformers() == "evoengine"
    models = llamas("evoengine", train=True)
    launches = backward_launches(module, monkeypatch)
    assert_training_step_matches(models, torch.randint(0, 1000, (2, 200), device="cuda"))
    assert len(launches) == 2  # two layers' backward, through the tuned kernel
