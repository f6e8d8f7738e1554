"""Tests of the launcher that exported modules carry, where no GPU is needed: what it
imports, the integrity check, the dispatch rule, and the errors raised before any launch.

Input checks shared with the runtime are tested in test_runtime.py; launches in tests/gpu.
The autograd formula is exercised here with fake launches (torch on the CPU, tensors that say
they are CUDA), so what reaches the backward kernel and what comes back is checked in CI.
"""

from __future__ import annotations

import ast
import math
import struct
import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from evoengine import launch as sa
from evoengine.launch import (
    CudaBackward,
    CudaKernel,
    Entry,
    IntegrityError,
    NoKernelError,
    TunedAttention,
    cubin_runs_on,
    dispatch_table,
    kernel_from_spec,
    nearest,
    pack_cubin,
    sdpa_attention,
    sdpa_attention_grads,
    sha256,
    unpack_cubin,
)
from tests.test_runtime import cuda_like

STDLIB = set(sys.stdlib_module_names)


def imported_roots(source: str, *, top_level: bool = False) -> set[str]:
    """The top packages that ``source`` imports (anywhere, or at module level only)."""
    tree = ast.parse(source)
    roots = set()
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_launcher_imports_torch_cupy_transformers_and_the_stdlib_only() -> None:
    roots = imported_roots(sa.module_text())
    assert {"torch", "cupy"} <= roots
    assert roots - STDLIB == {"torch", "cupy", "transformers"}  # transformers: on request
    for path in sa.module_paths():  # and each module, besides its siblings
        assert imported_roots(path.read_text()) - STDLIB <= {"torch", "cupy", "transformers",
                                                             "evoengine"}


def test_cupy_is_imported_only_when_a_kernel_loads() -> None:
    top = imported_roots(sa.module_text(), top_level=True)
    assert "torch" in top
    assert "cupy" not in top and "transformers" not in top


def test_launcher_modules_join_into_one_namespace() -> None:
    # Joined, the modules share one namespace: a top-level name defined in two would silently
    # take the later one's value; siblings are imported at module level only (those lines
    # are what the join drops), and only from modules earlier in MODULES.
    defined: dict[str, str] = {}
    order = {name: i for i, name in enumerate(sa.MODULES)}
    for path in sa.module_paths():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            elif isinstance(node, ast.Try):
                names = [n.name for h in node.handlers for n in h.body
                         if isinstance(n, ast.FunctionDef)]
            for name in names:
                assert name not in defined, f"{name} in {path.name} and {defined[name]}"
                defined[name] = path.name
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("evoengine"):
                sibling = node.module.rpartition(".")[2]
                assert order[sibling] < order[path.stem], f"{path.name} imports {sibling}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.col_offset:
                assert not (node.module or "").startswith("evoengine"), path.name
    namespace: dict[str, object] = {}
    exec(compile(sa.module_text(), "launcher", "exec"), namespace)
    assert isinstance(namespace["TunedAttention"], type)
    assert set(namespace["KERNEL_CLASSES"]) == set(sa.KINDS) == {
        "fwd", "bwd", "varlen", "varlen_bwd", "decode"}


@pytest.mark.parametrize(("cubin", "device", "runs"), [
    ("sm_80", "sm_80", True), ("sm_80", "sm_86", True), ("sm_80", "sm_89", True),
    ("sm_86", "sm_80", False), ("sm_80", "sm_90a", False), ("sm_90a", "sm_90a", True),
    ("sm_89", "sm_90a", False), ("sm_90a", "sm_100", False),
])
def test_cubin_runs_on(cubin: str, device: str, runs: bool) -> None:
    assert cubin_runs_on(cubin, device) is runs


def test_launch_arguments_sit_where_the_kernel_reads_them() -> None:
    # attn_fwd(5 pointers, 4 int, 12 long long, float): each at its natural alignment.
    fields = "QQQQQiiiiqqqqqqqqqqqqf"
    assert len(sa.forward._ARG_OFFSETS) == len(fields) == 22
    for i, offset in enumerate(sa.forward._ARG_OFFSETS):
        assert struct.calcsize("@" + fields[:i]) == offset  # native (C) layout
        assert struct.calcsize("=" + fields[:i]) == offset  # as packed: no padding needed
        assert offset % struct.calcsize(fields[i]) == 0
    assert sa.forward._ARGS.size == 156


def test_cubins_pack_as_text_and_back() -> None:
    data = bytes(range(256)) * 40
    text = pack_cubin(data)
    assert text.isascii() and max(map(len, text.splitlines())) <= 76
    assert "'" not in text and '"' not in text and "\\" not in text
    assert unpack_cubin(text) == data


def spec(**over: object) -> dict:
    source, cubin = "// kernel source\n", b"\x7fELF cubin bytes"
    base = {"name": "mma-x", "problem": {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": True},
            "block_m": 64, "threads": 128, "smem_bytes": 8192, "source": source,
            "source_sha256": sha256(source), "cubin": pack_cubin(cubin),
            "cubin_sha256": sha256(cubin), "defines": {"EVO_SMEM_BYTES": 8192}}
    return {**base, **over}


def test_kernel_from_an_intact_spec() -> None:
    k = kernel_from_spec(spec(), "sm_90a")
    assert (k.name, k.head_dim, k.dtype, k.causal) == ("mma-x", 64, "fp16", True)
    assert (k.block_m, k.threads, k.smem_bytes, k.arch) == (64, 128, 8192, "sm_90a")
    assert k.cubin == b"\x7fELF cubin bytes" and k.source == "// kernel source\n"


def test_altered_source_is_refused() -> None:
    with pytest.raises(IntegrityError, match="CUDA source of kernel mma-x does not match"):
        kernel_from_spec(spec(source="// kernel sourcE\n"), "sm_90a")


def test_altered_cubin_is_refused() -> None:
    with pytest.raises(IntegrityError, match="cubin of kernel mma-x does not match"):
        kernel_from_spec(spec(cubin=pack_cubin(b"\x7fELF cubin byteZ")), "sm_90a")
    with pytest.raises(IntegrityError, match="cubin of kernel mma-x is corrupt"):
        kernel_from_spec(spec(cubin="eJwLycgsVgCi4pL8lFQFIEcNAF7o"), "sm_90a")


def E(seq_q: int, seq_k: int | None = None, rows: int = 8, kernel: int = 0,  # noqa: N802
      key: tuple = ("fp16", 64, False)) -> Entry:
    return Entry(kernel, *key, seq_q=seq_q, seq_k=seq_k or seq_q, batch=1, heads=rows)


def test_dispatch_table_groups_and_sorts() -> None:
    entries = [E(2048, kernel=1), E(512, kernel=0), E(128, key=("bf16", 128, True), kernel=2)]
    table = dispatch_table(entries)
    assert list(table) == [("bf16", 128, True), ("fp16", 64, False)]
    assert [e.seq_k for e in table[("fp16", 64, False)]] == [512, 2048]


@pytest.mark.parametrize(("seq", "tuned"), [
    (1, 512), (512, 512), (1000, 512), (1024, 512),  # 1024 is the geometric midpoint: a tie
    (1025, 2048), (1500, 2048), (2048, 2048), (100000, 2048),
])
def test_nearest_in_log_scale(seq: int, tuned: int) -> None:
    group = dispatch_table([E(512), E(2048)])[("fp16", 64, False)]
    assert nearest(group, seq, seq, 8).seq_k == tuned


def test_nearest_weighs_both_lengths_then_rows() -> None:
    group = [E(1, 4096, kernel=0), E(4096, 4096, kernel=1), E(4096, 4096, rows=256, kernel=2)]
    assert nearest(group, 1, 3000, 8).kernel == 0  # decode-like: one query, many keys
    assert nearest(group, 3000, 3000, 8).kernel == 1
    assert nearest(group, 3000, 3000, 200).kernel == 2  # many rows: the one tuned on many


def kernel(head_dim: int = 64, dtype: str = "fp16", causal: bool = False) -> CudaKernel:
    return CudaKernel(f"k-{dtype}-{head_dim}-{int(causal)}", head_dim=head_dim, dtype=dtype,
                      causal=causal, block_m=64, threads=128, smem_bytes=8192,
                      source="// never compiled here")


@pytest.fixture(scope="module")
def tuned() -> TunedAttention:
    kernels = [kernel(), kernel(), kernel(128, "bf16", True)]
    entries = [E(512, kernel=0), E(2048, kernel=1),
               E(1024, kernel=2, key=("bf16", 128, True))]
    return TunedAttention(kernels, entries, namespace="evotest_standalone")


def test_select_is_pure_python(tuned: TunedAttention) -> None:
    assert tuned.select("fp16", 64, False, 700, 700, 8).kernel == 0
    assert tuned.select("fp16", 64, False, 1500, 1500, 8).kernel == 1
    assert tuned.select("bf16", 128, True, 5, 5000).kernel == 2
    assert tuned.select("fp16", 64, True, 512, 512) is None
    assert tuned.select("fp16", 96, False, 512, 512) is None


def test_explain_names_the_entry_tuned_or_derived_without_a_gpu() -> None:
    """explain reads shapes and dtype only (meta tensors here); a derived entry names the
    tuned one it came from and reports that one's time."""
    src = replace(E(512, kernel=0), median_us=12.5, workload="b1-h8-kv8-sq512-sk512-d64-full-fp16")
    derived = replace(E(512, kernel=1, key=("bf16", 64, False)), tuned=False,
                      workload="b1-h8-kv8-sq512-sk512-d64-full-bf16", derived_from=src.workload)
    attention = TunedAttention([kernel(), kernel(dtype="bf16")], [src, derived],
                               namespace="evotest_explain")
    q = torch.empty(2, 8, 700, 64, dtype=torch.float16, device="meta")
    why = attention.explain(q, q, q)
    assert (why.entry, why.kernel, why.tuned, why.measured_us) == (src, "k-fp16-64-0", True, 12.5)
    assert str(why) == ("fwd fp16 head_dim 64 non-causal b2 h8 sq700 sk700: tuned at "
                        "b1-h8-kv8-sq512-sk512-d64-full-fp16 (12.5 us measured there), kernel "
                        "k-fp16-64-0")
    why = attention.explain(q.bfloat16(), q.bfloat16(), q.bfloat16())
    assert (why.entry, why.source, why.tuned, why.measured_us) == (derived, src, False, 12.5)
    assert "derived (not tuned for bf16 non-causal) from the kernel tuned at b1-h8" in str(why)
    none = attention.explain(q, q, q, causal=True, kind="bwd")
    assert none.entry is None and "no tuned backward kernel for torch.float16" in str(none)
    with pytest.raises(ValueError, match="kind must be one of"):
        attention.explain(q, q, q, kind="decode")


def test_an_entry_must_name_a_kernel_of_its_problem() -> None:
    with pytest.raises(ValueError, match="compiled for another problem"):
        TunedAttention([kernel()], [E(512, key=("fp16", 64, True))], namespace="evotest_bad")


def test_two_instances_get_two_custom_ops() -> None:
    a = TunedAttention([kernel()], [E(512)], namespace="evotest_twice")
    b = TunedAttention([kernel()], [E(512)], namespace="evotest_twice")
    assert (a.namespace, b.namespace) == ("evotest_twice", "evotest_twice_2")
    assert hasattr(torch.ops.evotest_twice_2, "attention")
    assert "evotest_twice" in repr(a) and "fp16 head_dim 64 non-causal" in repr(a)


def q_like(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return cuda_like(torch.zeros(*shape, dtype=dtype))


def test_cpu_tensors_are_refused_naming_cuda(tuned: TunedAttention) -> None:
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        tuned(q, q, q)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        tuned([1.0], q, q)  # type: ignore[arg-type]


def test_autograd_calls_go_through_the_custom_op_with_the_same_errors(
        tuned: TunedAttention) -> None:
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        tuned(q, q, q)


def test_no_kernel_names_what_the_module_has(tuned: TunedAttention) -> None:
    q = q_like(1, 2, 16, 96)
    with pytest.raises(NoKernelError) as info:
        tuned.forward(q, q, q)
    message = str(info.value)
    assert "no tuned kernel for torch.float16 head_dim 96 non-causal" in message
    assert "bf16 head_dim 128 causal" in message and "fp16 head_dim 64 non-causal" in message
    assert "fallback='sdpa'" in message
    assert issubclass(NoKernelError, ValueError)


def test_float32_is_refused_unless_falling_back(tuned: TunedAttention) -> None:
    q = q_like(1, 2, 16, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="q must be float16 or bfloat16, got torch.float32"):
        tuned.forward(q, q, q)
    with pytest.raises(ValueError, match="fallback must be None or 'sdpa', got 'flash'"):
        tuned.forward(q, q, q, fallback="flash")


@pytest.mark.parametrize(("args", "message"), [
    ((q_like(1, 3, 16, 64), q_like(1, 2, 16, 64), q_like(1, 2, 16, 64)),
     r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ((q_like(1, 2, 16, 64), q_like(1, 2, 16, 64), q_like(1, 2, 8, 64)),
     "k and v must have one shape"),
    ((q_like(1, 2, 16, 64), q_like(1, 2, 16, 64, dtype=torch.bfloat16),
      q_like(1, 2, 16, 64, dtype=torch.bfloat16)), "q, k, v must share a dtype"),
    ((q_like(1, 2, 0, 64), q_like(1, 2, 16, 64), q_like(1, 2, 16, 64)), "q is empty"),
    ((q_like(1, 2, 64, 16).mT, q_like(1, 2, 16, 64), q_like(1, 2, 16, 64)),
     "q must have a contiguous last dim"),
])
def test_bad_shapes_are_named(tuned: TunedAttention, args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tuned.forward(*args)


def test_grid_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="at most 65535"):
        sa.check_grid(sa.Problem(70000, 1, 1, 8, 8, 64))


def test_a_gpu_that_cannot_run_the_kernel_is_named_or_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    k = kernel()
    tuned = TunedAttention([k], [E(512)], namespace="evotest_refused")

    def refuse(index: int) -> None:
        raise NoKernelError(f"kernel {k.name} needs sm_80 or newer; cuda:{index} is sm_75")

    monkeypatch.setattr(k, "load", refuse)
    q = q_like(1, 2, 16, 64)
    with pytest.raises(NoKernelError, match=r"needs sm_80 or newer; cuda:-1 is sm_75\. "
                                            r"Pass fallback='sdpa'"):
        tuned.forward(q, q, q)
    x = torch.randn(1, 2, 16, 64).to(torch.float16)
    out = tuned.forward(cuda_like(x), cuda_like(x), cuda_like(x), fallback="sdpa")
    torch.testing.assert_close(out.as_subclass(torch.Tensor), sdpa_attention(x, x, x,
                                                                             causal=False))


def test_a_source_is_built_with_the_launchers_nvrtc_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU its cubin does not run on, a kernel is built from its source by cupy's NVRTC
    with the options evoengine.compile uses offline (``NVRTC_OPTIONS``), the target named."""
    seen: dict = {}

    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            seen.update(code=code, options=options)

        def get_function(self, name: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(kernel=name)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule))
    kernel = CudaKernel("k", head_dim=64, dtype="fp16", causal=False, block_m=64, threads=128,
                        smem_bytes=0, source="// src", defines={"HEAD_DIM": 64})
    kernel._compile("sm_90a", 1000)
    assert seen["options"] == (*sa.NVRTC_OPTIONS, "-arch=sm_90a", "-DHEAD_DIM=64",
                               "-DEVO_SMEM_LIMIT=1000")


# ---- the backward pass ------------------------------------------------------------------------

def backward_kernel(head_dim: int = 16, dtype: str = "fp16", causal: bool = True) -> CudaBackward:
    return CudaBackward(f"b-{dtype}-{head_dim}-{int(causal)}", head_dim=head_dim, dtype=dtype,
                        causal=causal, block_m=64, block_n=64, threads=256, smem_bytes=0,
                        dq_accum="atomic", source="// never compiled here")


def test_backward_spec_builds_the_backward_launcher() -> None:
    k = kernel_from_spec(spec(kind="bwd", name="mma_bwd-x", threads=256, smem_bytes=40960,
                              params={"BLOCK_N": 128, "DQ_ACCUM": "separate"}), "sm_90a")
    assert isinstance(k, CudaBackward) and (k.block_m, k.block_n, k.dq_accum) == (
        64, 128, "separate")
    assert [x.entry for x in (k.pre, k.main, k.post)] == list(sa.BACKWARD_ENTRIES)
    assert (k.main.threads, k.main.smem_bytes, k.pre.threads) == (256, 40960, sa.PRE_THREADS)
    assert k.main.cubin == k.pre.cubin == b"\x7fELF cubin bytes"
    assert isinstance(kernel_from_spec(spec(), "sm_90a"), CudaKernel)  # no kind: a forward
    with pytest.raises(ValueError, match="kernel mma-x is of kind 'prefill'; this launcher "
                                         "knows fwd, bwd, varlen, varlen_bwd, decode"):
        kernel_from_spec(spec(kind="prefill"), "sm_90a")


def test_backward_spec_names_how_the_main_kernel_is_launched() -> None:
    params = {"BLOCK_N": 128, "DQ_ACCUM": "atomic", "LOADER": "tma", "SWIZZLE": 128}
    k = kernel_from_spec(spec(kind="bwd", name="wgmma_bwd-x", threads=384, smem_bytes=40960,
                              params=params), "sm_90a")
    assert k.main_launch == "stream"  # specs exported before MAIN_LAUNCH existed
    k = kernel_from_spec(spec(kind="bwd", name="wgmma_bwd-y", threads=384, smem_bytes=40960,
                              params={**params, "MAIN_LAUNCH": "programmatic"}), "sm_90a")
    assert k.main_launch == "programmatic"
    with pytest.raises(ValueError, match=r"^kernel b: main_launch must be one of \('stream', "
                                         r"'programmatic'\), got 'graph'$"):
        CudaBackward("b", head_dim=64, dtype="fp16", causal=True, block_m=64, block_n=64,
                     threads=256, smem_bytes=0, dq_accum="atomic", source="//",
                     main_launch="graph")


def test_backward_entries_form_a_second_table() -> None:
    fwd = [kernel(), kernel(128, "bf16", True)]
    bwd = [backward_kernel(64, "fp16", False)]
    entries = [E(512, kernel=0), E(1024, kernel=1, key=("bf16", 128, True)),
               sa.Entry(2, "fp16", 64, False, 2048, 2048, 1, 8, kind="bwd")]
    tuned = TunedAttention([*fwd, *bwd], entries, namespace="evotest_tables")
    assert list(tuned.table) == [("bf16", 128, True), ("fp16", 64, False)]
    assert list(tuned.backward_table) == [("fp16", 64, False)]
    assert tuned.select("fp16", 64, False, 9, 9, kind="bwd").seq_k == 2048
    assert tuned.select("bf16", 128, True, 9, 9, kind="bwd") is None
    assert "backward for fp16 head_dim 64 non-causal" in repr(tuned)
    with pytest.raises(ValueError, match="names kernel k-fp16-64-0, which is compiled for "
                                         "another problem"):
        TunedAttention([kernel()], [sa.Entry(0, "fp16", 64, False, 512, 512, 1, 8, kind="bwd")],
                       namespace="evotest_bad_kind")


class Launches:
    """Fake launches on CPU tensors: the forward writes SDPA's output and a made-up lse, the
    backward SDPA's gradients; each records what it was given."""

    LSE = 0.25

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fwd: CudaKernel,
                 bwd: CudaBackward | None) -> None:
        self.causal = fwd.causal
        self.forward: list[dict] = []
        self.backward: list[dict] = []
        for k in (fwd, bwd):
            if k is not None:
                monkeypatch.setattr(k, "load", lambda index: None)
        monkeypatch.setattr(fwd, "launch", self.launch_forward)
        if bwd is not None:
            monkeypatch.setattr(bwd, "launch", self.launch_backward)

    def launch_forward(self, q, k, v, out, lse, p, scale) -> None:  # type: ignore[no-untyped-def]
        out.copy_(sdpa_attention(q.float(), k.float(), v.float(), causal=self.causal,
                                 scale=scale))
        if lse is not None:
            lse.fill_(self.LSE)
        self.forward.append(dict(out=out, lse=lse))

    def launch_backward(self, q, k, v, out, lse, dout, dq, dk, dv, *, scale,  # type: ignore[no-untyped-def]
                        deterministic) -> None:
        grads = sdpa_attention_grads(q.float(), k.float(), v.float(), dout.float(),
                                     causal=self.causal, scale=scale)
        for d, g in zip((dq, dk, dv), grads, strict=True):
            d.copy_(g)
        self.backward.append(dict(out=out, lse=lse.clone(), dout=dout,
                                  deterministic=deterministic))


def leaves(head_dim: int = 16, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    """q [1, 4, 8, head_dim] over k, v [1, 2, 8, head_dim] (GQA), CPU tensors that say CUDA."""
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 4, 8, head_dim), (1, 2, 8, head_dim), (1, 2, 8, head_dim))
    return tuple(cuda_like(torch.randn(*s, generator=g).to(dtype)).requires_grad_()
                 for s in shapes)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   dtype: torch.dtype = torch.float32,
                   causal: bool = True) -> tuple[torch.Tensor, ...]:
    plain = [x.detach().as_subclass(torch.Tensor).to(dtype) for x in (q, k, v, dout)]
    return sdpa_attention_grads(*plain, causal=causal)


def output_grad(like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(1)).half()


def test_gradients_flow_through_the_backward_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autograd through ``attention`` reaches the backward entry with the forward's out and
    lse; GQA gradients of k and v come back shaped like k and v."""
    fwd, bwd = kernel(16, "fp16", True), backward_kernel()
    entries = [E(8, kernel=0, key=("fp16", 16, True)),
               sa.Entry(1, "fp16", 16, True, 8, 8, 1, 4, kind="bwd")]
    tuned = TunedAttention([fwd, bwd], entries, namespace="evotest_grad")
    launches = Launches(monkeypatch, fwd, bwd)
    q, k, v = leaves()
    out = tuned(q, k, v, causal=True)
    dout = output_grad(out)
    out.backward(cuda_like(dout))
    (f,), (b,) = launches.forward, launches.backward
    assert f["lse"] is not None and f["lse"].shape == (1, 4, 8)
    assert torch.equal(b["lse"], torch.full((1, 4, 8), Launches.LSE))
    assert b["out"].data_ptr() == f["out"].data_ptr() and b["deterministic"] is False
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == ((1, 4, 8, 16), (1, 2, 8, 16),
                                                          (1, 2, 8, 16))
    for got, want in zip((q.grad, k.grad, v.grad), sdpa_reference(q, k, v, dout), strict=True):
        torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want, atol=4e-3,
                                   rtol=0)  # the fake kernel's float32, rounded to fp16


def test_grad_free_calls_keep_no_log_sum_exp(monkeypatch: pytest.MonkeyPatch) -> None:
    fwd = kernel(16, "fp16", True)
    tuned = TunedAttention([fwd], [E(8, kernel=0, key=("fp16", 16, True))],
                           namespace="evotest_nograd")
    launches = Launches(monkeypatch, fwd, None)
    q, k, v = leaves()
    with torch.no_grad():
        tuned(q, k, v, causal=True)
    out, lse = tuned._op(q.detach(), k.detach(), v.detach(), True, None, None, False, False)
    assert [f["lse"] for f in launches.forward] == [None, None] and lse.numel() == 0


def test_no_backward_kernel_is_one_line_or_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    fwd = kernel(16, "fp16", True)
    tuned = TunedAttention([fwd, backward_kernel(64, "bf16", False)],
                           [E(8, kernel=0, key=("fp16", 16, True)),
                            sa.Entry(1, "bf16", 64, False, 8, 8, 1, 4, kind="bwd")],
                           namespace="evotest_nobwd")
    Launches(monkeypatch, fwd, None)
    q, k, v = leaves()
    with pytest.raises(NoKernelError) as info:
        tuned(q, k, v, causal=True).float().sum().backward()
    assert str(info.value) == (
        "no tuned backward kernel for torch.float16 head_dim 16 causal; this module has "
        "backward kernels for: bf16 head_dim 64 non-causal. Pass fallback='sdpa' to run torch "
        "SDPA for such calls.")
    assert q.grad is None
    out = tuned(q, k, v, causal=True, fallback="sdpa")
    dout = output_grad(out)
    out.backward(cuda_like(dout))
    want = sdpa_reference(q, k, v, dout, torch.float16)  # SDPA's backward, in fp16 too
    for got, w in zip((q.grad, k.grad, v.grad), want, strict=True):
        assert torch.equal(got.as_subclass(torch.Tensor), w)


def test_every_launcher_function_that_promises_a_value_returns_one() -> None:
    # A function annotated to return something whose body has no return (or yield, or
    # raise) hands back None: how a lost line once sent every wgmma launch a null tensor map.
    for path in sa.module_paths():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or node.returns is None:
                continue
            if isinstance(node.returns, ast.Constant) and node.returns.value is None:
                continue
            if ast.unparse(node.returns) in ("None", "NoReturn"):
                continue
            own = [n for n in ast.walk(node) if isinstance(n, (ast.Return, ast.Yield, ast.Raise))]
            assert own, f"{path.name}: {node.name} promises {ast.unparse(node.returns)}"


def test_encode_tensor_map_returns_the_128_bytes_the_driver_wrote(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    def fake_encoder(at: int, *args: object) -> int:
        ctypes.memmove(at, bytes(range(128)), 128)
        return 0

    monkeypatch.setattr(sa.tma, "_tensor_map_encoder", lambda: fake_encoder)
    g = sa.tma_geometry((1, 2, 64, 64), (2 * 64 * 64, 64 * 64, 64, 1), 2, 64, 128)
    assert sa.tma.encode_tensor_map(0x1000, g, "fp16") == bytes(range(128))


@pytest.mark.parametrize("sq,sk", [(9, 9), (13, 6), (5, 11)])
def test_sdpa_fallback_takes_a_negative_scale_and_zeroes_rows_that_see_no_key(sq: int,
                                                                             sk: int) -> None:
    from evoengine.validate import reference

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, sq, 16), torch.randn(1, 2, sk, 16), torch.randn(1, 2, sk, 16)
    for scale in (-0.2, 0.3):
        ref, _ = reference(q, k, v, causal=True, scale=scale)
        out = sdpa_attention(q, k, v, causal=True, scale=scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert bool((out[:, :, :max(0, sq - sk)] == 0).all())


# ---- a hostile caller: every entry of an exported module, refused in one line ------------


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (device checks between tensors); only checks,
    which raise before anything is allocated on that device, may be given it."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def fake(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return cuda_like(torch.zeros(*shape, dtype=dtype))


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


def ints(*values: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return cuda_like(torch.tensor(values, dtype=dtype))


class Served:
    """attention, attention_varlen and attention_decode as an exported module binds them,
    over fp16 head-dim-64 kernels whose launches are recorded instead of run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.launches: list[str] = []
        common = dict(head_dim=64, dtype="fp16", block_m=64, threads=128, smem_bytes=8192,
                      source="// never compiled here")
        fwd = CudaKernel("f", causal=False, **common)  # type: ignore[arg-type]
        var = sa.varlen.CudaVarlenKernel("v", causal=False, **common)  # type: ignore[arg-type]
        dec = sa.CudaDecode("d", paged=True, block_n=64, split_policy="fixed", splits=1,
                            **{**common, "block_m": 16})  # type: ignore[arg-type]
        for k in (fwd, var, dec):
            monkeypatch.setattr(k, "load", lambda index: None)
            monkeypatch.setattr(k, "launch", lambda *a, name=k.kind, **kw:
                                self.launches.append(name))
        entries = [sa.Entry(0, "fp16", 64, False, 512, 512, 1, 8),
                   sa.Entry(1, "fp16", 64, False, 512, 512, 1, 8, kind="varlen"),
                   sa.Entry(2, "fp16", 64, True, 1, 4096, 1, 8, kind="decode")]
        self.attention = TunedAttention([fwd, var, dec], entries, namespace="evotest_hostile")
        self.varlen = self.attention.varlen
        self.decode = sa.TunedDecode(self.attention.kernels, entries)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Served:
    return Served(monkeypatch)


Q, KV = (2, 8, 128, 64), (2, 2, 128, 64)
PQ, PKV, CU_Q, CU_K = (30, 8, 64), (40, 2, 64), (0, 10, 30), (0, 15, 40)
DQ, PAGES = (2, 1, 8, 64), (10, 16, 2, 64)
F8 = torch.float8_e4m3fn
TABLE = ((0, 1, 2, 3), (4, 5, 6, 7))


def attention_call(**over: object) -> tuple[tuple, dict]:
    args = dict(q=fake(*Q), k=fake(*KV), v=fake(*KV))
    kw = {k: over.pop(k) for k in ("causal", "scale", "fallback", "out", "lse") if k in over}
    args.update(over)
    return (args["q"], args["k"], args["v"]), kw


def varlen_call(**over: object) -> tuple[tuple, dict]:
    args = dict(q=fake(*PQ), k=fake(*PKV), v=fake(*PKV), cu_q=ints(*CU_Q), cu_k=ints(*CU_K),
                max_q=20, max_k=25)
    kw = {k: over.pop(k) for k in ("causal", "scale", "fallback", "out", "lse", "check")
          if k in over}
    args.update(over)
    return tuple(args.values()), kw


def decode_call(**over: object) -> tuple[tuple, dict]:
    args = dict(q=fake(*DQ), k=fake(*PAGES), v=fake(*PAGES), lens=ints(20, 30),
                table=cuda_like(torch.tensor(TABLE, dtype=torch.int32)))
    kw = {k: over.pop(k) for k in ("causal", "scale", "fallback") if k in over}
    args.update(over)
    return tuple(args.values()), kw


def misaligned(*shape: int) -> torch.Tensor:
    n = math.prod(shape)
    return cuda_like(torch.zeros(n + 1, dtype=torch.float16)[1:].view(*shape))


HOSTILE = [  # (entry, the call's changes, error, message)
    # attention
    ("attention", dict(q=fake(8, 128, 64)), ValueError, r"q must be 4-D \[batch, heads"),
    ("attention", dict(q=fake(*Q, dtype=torch.float32)), ValueError,
     "q must be float16 or bfloat16, got torch.float32"),
    ("attention", dict(q=fake(*Q, dtype=F8), k=fake(*KV, dtype=F8), v=fake(*KV, dtype=F8),
                       fallback="sdpa"), ValueError,
     "q must be float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"),
    ("attention", dict(k=fake(*KV, dtype=torch.bfloat16)), ValueError, "share a dtype"),
    ("attention", dict(q=torch.zeros(*Q, dtype=torch.float16)), ValueError,
     "q must be a CUDA tensor, got device cpu"),
    ("attention", dict(q=on_device(torch.zeros(*Q, dtype=torch.float16)),
                       k=on_device(torch.zeros(*KV, dtype=torch.float16)),
                       v=torch.zeros(*KV, dtype=torch.float16)), ValueError,
     "v must be a CUDA tensor"),
    ("attention", dict(k=fake(2, 3, 128, 64), v=fake(2, 3, 128, 64)), ValueError,
     r"query heads \(8\) must be a multiple of key/value heads \(3\)"),
    ("attention", dict(q=fake(2, 8, 128, 72), k=fake(2, 2, 128, 72), v=fake(2, 2, 128, 72)),
     NoKernelError, "no tuned kernel for torch.float16 head_dim 72"),
    ("attention", dict(q=fake(2, 8, 128, 4), k=fake(2, 2, 128, 4), v=fake(2, 2, 128, 4)),
     ValueError, r"q's head_dim \(4\) must be a multiple of 8"),
    ("attention", dict(q=fake(2, 8, 128, 512), k=fake(2, 2, 128, 512), v=fake(2, 2, 128, 512)),
     NoKernelError, "no tuned kernel for torch.float16 head_dim 512"),
    ("attention", dict(q=fake(0, 8, 128, 64), k=fake(0, 2, 128, 64), v=fake(0, 2, 128, 64)),
     ValueError, r"q is empty: shape \(0, 8, 128, 64\) \(every dim must be >= 1\)"),
    ("attention", dict(k=fake(2, 2, 0, 64), v=fake(2, 2, 0, 64)), ValueError, "k is empty"),
    ("attention", dict(q=fake(2, 8, 128, 128)[..., ::2]), ValueError,
     "q must have a contiguous last dim"),
    ("attention", dict(q=misaligned(*Q)), ValueError, "q must be 16-byte aligned"),
    ("attention", dict(scale=math.nan), ValueError, "scale must be finite, got nan"),
    ("attention", dict(scale="0.1"), TypeError, "scale must be a float or None, got str"),
    ("attention", dict(scale=torch.tensor(0.1)), TypeError, "scale must be a float or None"),
    ("attention", dict(causal="no"), TypeError, "causal must be a bool, got str 'no'"),
    ("attention", dict(causal=None), TypeError, "causal must be a bool, got NoneType"),
    ("attention", dict(fallback="SDPA"), ValueError, "fallback must be None or 'sdpa'"),
    ("attention", dict(q=fake(1, 70000, 1, 64), k=fake(1, 70000, 1, 64),
                       v=fake(1, 70000, 1, 64)), ValueError, "at most 65535"),
    ("attention", dict(q=None), TypeError, "q must be a torch.Tensor, got NoneType"),
    ("forward", dict(out=fake(2, 8, 128, 32)), ValueError, "out must match q"),
    ("forward", dict(out=[0.0]), TypeError, "out must be a torch.Tensor or None, got list"),
    ("forward", dict(lse=fake(2, 8, 128)), ValueError,
     r"lse must be a contiguous float32 \[2, 8, 128\]"),  # given alone: once written unchecked
    ("forward", dict(lse=[0.0]), TypeError, "lse must be a torch.Tensor or None, got list"),
    # attention_varlen
    ("varlen", dict(q=fake(1, *PQ)), ValueError, r"q must be 3-D \[total, heads, head_dim\]"),
    ("varlen", dict(k=fake(*PKV, dtype=torch.bfloat16)), ValueError, "share a dtype"),
    ("varlen", dict(q=torch.zeros(*PQ, dtype=torch.float16)), ValueError,
     "q must be a CUDA tensor"),
    ("varlen", dict(k=fake(40, 3, 64), v=fake(40, 3, 64)), ValueError,
     r"query heads \(8\) must be a multiple of kv heads \(3\)"),
    ("varlen", dict(q=fake(30, 0, 64)), ValueError, "q must have heads >= 1 and head_dim >= 1"),
    ("varlen", dict(q=fake(30, 8, 4), k=fake(40, 2, 4), v=fake(40, 2, 4)), ValueError,
     r"q's head_dim \(4\) must be a multiple of 8"),
    ("varlen", dict(q=fake(30, 8, 72), k=fake(40, 2, 72), v=fake(40, 2, 72)), NoKernelError,
     "no tuned varlen kernel for torch.float16 head_dim 72"),
    ("varlen", dict(q=misaligned(*PQ)), ValueError, "q must be 16-byte aligned"),
    ("varlen", dict(scale="0.1"), TypeError, "scale must be a float or None"),
    ("varlen", dict(causal="no"), TypeError, "causal must be a bool"),
    ("varlen", dict(cu_q=ints(*CU_Q, dtype=torch.int64)), ValueError,
     "cu_seqlens_q must be int32, got torch.int64"),
    ("varlen", dict(cu_q=[0, 10, 30]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("varlen", dict(q=on_device(torch.zeros(*PQ, dtype=torch.float16)),
                    k=on_device(torch.zeros(*PKV, dtype=torch.float16)),
                    v=on_device(torch.zeros(*PKV, dtype=torch.float16)),
                    cu_q=torch.tensor(CU_Q, dtype=torch.int32),
                    cu_k=on_device(torch.tensor(CU_K, dtype=torch.int32))), ValueError,
     "cu_seqlens_q must be on cuda:0 with q, got cpu"),
    ("varlen", dict(cu_q=ints(0, 20, 10, 30), cu_k=ints(0, 15, 15, 40)), ValueError,
     "cu_seqlens_q must start at 0 and never decrease"),
    ("varlen", dict(cu_q=ints(0, 10, 20)), ValueError,
     "cu_seqlens_q must end at the packed length 30, got 20"),
    ("varlen", dict(cu_k=ints(0, 15, 99), max_k=99), ValueError,
     "cu_seqlens_k must end at the packed length 40, got 99"),  # past the tensor
    ("varlen", dict(cu_q=ints(0), cu_k=ints(0)), ValueError, r"\[batch \+ 1\] tensor, batch >= 1"),
    ("varlen", dict(cu_k=ints(0, 40)), ValueError, "must both be"),
    ("varlen", dict(max_q=19), ValueError,
     r"max_seqlen_q \(19\) is smaller than a sequence of length 20"),
    ("varlen", dict(max_k=-1), ValueError, r"max_seqlen_k must be an int in \[0, 2\*\*31\)"),
    ("varlen", dict(max_q=2**31), ValueError, r"max_seqlen_q must be an int in \[0, 2\*\*31\)"),
    ("varlen", dict(max_q=20.0), ValueError, "max_seqlen_q must be an int"),
    ("varlen", dict(out=[0.0]), TypeError, "out must be a torch.Tensor or None"),
    ("varlen", dict(lse=fake(30, 8)), ValueError, r"lse must be a contiguous float32 \[8, 30\]"),
    # attention_decode
    ("decode", dict(q=fake(2, 8, 64)), ValueError, r"q must be 4-D \[batch, q_len, q_heads"),
    ("decode", dict(k=fake(10, 16, 2, 64, dtype=torch.bfloat16)), ValueError, "share a dtype"),
    ("decode", dict(q=torch.zeros(*DQ, dtype=torch.float16)), ValueError, "one CUDA device"),
    ("decode", dict(k=fake(10, 16, 3, 64), v=fake(10, 16, 3, 64)), ValueError,
     "must be a multiple of kv heads"),
    ("decode", dict(q=fake(2, 1, 8, 4), k=fake(10, 16, 2, 4), v=fake(10, 16, 2, 4)),
     ValueError, r"q's head_dim \(4\) must be a multiple of 8"),
    ("decode", dict(q=fake(0, 1, 8, 64), lens=ints(), table=fake(0, 4, dtype=torch.int32)),
     ValueError, "must not be empty"),
    ("decode", dict(q=fake(2, 17, 8, 64)), ValueError, "q_len must be at most 16"),
    ("decode", dict(scale="0.1"), TypeError, "scale must be a float or None"),
    ("decode", dict(causal="no"), TypeError, "causal must be a bool"),
    ("decode", dict(lens=ints(20, 30, dtype=torch.int64)), ValueError,
     "cache_seqlens must be a contiguous int32"),
    ("decode", dict(lens=ints(20, 65)), ValueError,
     r"cache_seqlens must lie in \[0, max_pages x page_size = 64\]"),
    ("decode", dict(lens=ints(-1, 30)), ValueError, "cache_seqlens must lie in"),
    ("decode", dict(table=cuda_like(torch.tensor(((0, 1, 2, 3), (4, 10, 6, 7)),
                                                 dtype=torch.int32))), ValueError,
     r"block_table entries within a sequence's length must lie in \[0, num_pages = 10\)"),
    ("decode", dict(table=cuda_like(torch.tensor(((0, -1, 2, 3), (4, 5, 6, 7)),
                                                 dtype=torch.int32))), ValueError,
     "block_table entries"),
    ("decode", dict(table=cuda_like(torch.tensor(TABLE))), ValueError, "block_table must be int32"),
    ("decode", dict(k=fake(10, 12, 2, 64), v=fake(10, 12, 2, 64)), ValueError,
     "page_size .* must be a power of 2, got 12"),
    ("decode", dict(fallback="x"), ValueError, "fallback must be None or 'sdpa'"),
]


@pytest.mark.parametrize(("entry", "over", "error", "message"), HOSTILE,
                         ids=[f"{h[0]}-{i}" for i, h in enumerate(HOSTILE)])
def test_hostile_input_is_one_line_before_any_launch(served: Served, entry: str, over: dict,
                                                     error: type, message: str) -> None:
    over = dict(over)
    if entry in ("attention", "forward"):
        args, kw = attention_call(**over)
        call = served.attention if entry == "attention" else served.attention.forward
    elif entry == "varlen":
        (args, kw), call = varlen_call(**over), served.varlen
    else:
        (args, kw), call = decode_call(**over), served.decode
    with pytest.raises(error, match=message) as info:
        call(*args, **kw)
    assert info.type is error  # not a subclass standing in for it, nor torch's own
    assert "\n" not in str(info.value)
    assert served.launches == []


def test_a_call_made_before_is_checked_again_where_it_differs(served: Served) -> None:
    """The eager call's checks are memoised by shapes, strides, dtypes, devices and flags:
    the same call again launches without them, but a misaligned pointer, another head dim,
    dtype or flag is still refused in one line, never launched."""
    q, k, v = fake(*Q), fake(*KV), fake(*KV)
    served.attention(q, k, v, causal=False)
    served.attention(fake(*Q), fake(*KV), fake(*KV), causal=False)
    assert served.launches == ["fwd", "fwd"] and len(served.attention._plans) == 1
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        served.attention(misaligned(*Q), k, v, causal=False)
    with pytest.raises(ValueError, match="fallback must be None or 'sdpa'"):
        served.attention(q, k, v, causal=False, fallback="flash")
    with pytest.raises(TypeError, match="causal must be a bool"):
        served.attention(q, k, v, causal="no")
    with pytest.raises(ValueError, match="must share a dtype"):
        served.attention(q, fake(*KV, dtype=torch.bfloat16), v, causal=False)
    with pytest.raises(NoKernelError):
        served.attention(fake(2, 8, 128, 32), fake(2, 2, 128, 32), fake(2, 2, 128, 32))
    assert served.launches == ["fwd", "fwd"]


def test_the_sdpa_fallback_serves_what_no_kernel_takes(served: Served) -> None:
    """float32 and head dims no kernel takes run through SDPA with fallback='sdpa', on every
    entry (a float32 model with padding reaches attention_varlen through Transformers)."""
    f32 = torch.float32
    for shape in ((2, 8, 16, 64), (2, 8, 16, 4)):
        dtype = f32 if shape[-1] == 64 else torch.float16
        q, kv = fake(*shape, dtype=dtype), fake(2, 2, 16, shape[-1], dtype=dtype)
        assert served.attention(q, kv, kv, fallback="sdpa").shape == shape
        assert served.attention(q.requires_grad_(), kv, kv, fallback="sdpa").shape == shape
    args, _ = varlen_call(q=fake(*PQ, dtype=f32), k=fake(*PKV, dtype=f32), v=fake(*PKV, dtype=f32))
    assert served.varlen(*args, fallback="sdpa").shape == PQ
    args, _ = varlen_call(q=fake(30, 8, 4), k=fake(40, 2, 4), v=fake(40, 2, 4))
    assert served.varlen(*args, fallback="sdpa").shape == (30, 8, 4)
    args, _ = decode_call(q=fake(*DQ, dtype=f32), k=fake(*PAGES, dtype=f32),
                          v=fake(*PAGES, dtype=f32))
    assert served.decode(*args, fallback="sdpa").shape == DQ
    assert served.launches == []


def test_a_kernel_that_serves_checks_alignment_even_with_a_fallback(served: Served) -> None:
    """The fallback skips alignment only where SDPA serves: a misaligned call that a kernel
    serves is refused, never launched, with fallback='sdpa' too."""
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        served.attention.forward(misaligned(*Q), fake(*KV), fake(*KV), fallback="sdpa")
    args, _ = varlen_call(q=misaligned(*PQ))
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        served.varlen(*args, fallback="sdpa")
    args, _ = decode_call(q=misaligned(*DQ))
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        served.decode(*args, fallback="sdpa")
    assert served.launches == []
    served.attention(fake(*Q), fake(*KV), fake(*KV), causal=0, scale=np.float32(0.1))
    assert served.launches == ["fwd"]  # 0/1 and numpy scalars are taken


def test_explain_takes_empty_dims_and_refuses_what_the_call_would() -> None:
    attention = TunedAttention([kernel()], [E(512)], namespace="evotest_explain_empty")
    q = torch.empty(0, 8, 0, 64, dtype=torch.float16, device="meta")
    assert attention.explain(q, q, q).entry == E(512)  # was a math domain error
    with pytest.raises(TypeError, match="^q must be a torch.Tensor, got list$"):
        attention.explain([0.0], q, q)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^causal must be a bool, got str 'no'$"):
        attention.explain(q, q, q, causal="no")  # type: ignore[arg-type]


def test_a_call_in_a_kernels_context_returns_its_result_and_gives_the_context_back() -> None:
    """``in_context`` (launches, and the decode launcher's count of clusters that fit): the call
    runs with the kernel's context current and returns what it returns; a thread that had
    another device's context gets it back, one that had none keeps the kernel's."""
    from evoengine.launch.core import Loaded, in_context

    current = [0]
    loaded = Loaded(1, 7, lambda *a: None, lambda: current[0],
                    lambda c: current.__setitem__(0, c), None)
    seen: list[int] = []

    def call(x: int) -> int:
        seen.append(current[0])
        return 2 * x

    for before, after in ((7, 7), (0, 7), (9, 9)):
        current[0] = before
        assert in_context(loaded, call, 21) == 42 and current[0] == after
    assert seen == [7, 7, 7]
