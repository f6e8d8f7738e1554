"""Ragged batches on a real GPU: the VARLEN kernels against the float64 reference per sequence.

Fresh packed inputs per check, NaN-poisoned outputs and log-sum-exp, empty sequences (no
query, no key), tails that are no multiple of any tile, uneven query and key lengths (causal
aligned bottom-right per sequence), GQA/MQA, strided slices of one qkv tensor, the softmax
scale; then the launcher's input checks and the SDPA fallback.
"""

from __future__ import annotations

import functools

import pytest
import torch

from evoengine import paths, validate
from evoengine.compile import compile_many
from evoengine.launch.varlen import varlen_sdpa
from evoengine.problems.varlen import VarlenWorkload, parse_seqlens
from evoengine.problems.varlen_bwd import VarlenBackwardWorkload
from evoengine.render import Candidate, make_candidate
from evoengine.runtime import VarlenKernel, gpu_arch
from evoengine.space import SearchSpace
from tests.gpu.test_kernels import wgmma_point

MMA_POINT = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                 LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split")


# One to three consumer warpgroups, ping-pong, a persistent grid with each scheduler and tile
# order (the ragged skipping of tiles with no row), P through shared memory.
WGMMA_POINTS = [
    wgmma_point(),
    wgmma_point(BLOCK_M=192, BLOCK_N=64, STAGES=3, SWIZZLE=64, PINGPONG=True, PERSISTENT=True),
    wgmma_point(BLOCK_M=64, BLOCK_N=176, P_FROM="smem", INTRA_WG_OVERLAP=False),
    wgmma_point(PINGPONG=True, PERSISTENT=True, TILE_ORDER="l2", SCHEDULER="dynamic"),
    wgmma_point(BLOCK_N=176, PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
]
RAGGED = ((300, 300), (0, 0), (1, 1), (129, 77), (0, 50), (40, 0), (77, 300), (509, 509),
          (64, 64), (1000, 999))

_built: dict[str, VarlenKernel] = {}


def varlen_candidates(family: str, points: list[dict[str, object]], causal: bool,
                      dtype: str = "fp16", head_dim: int = 128) -> list[Candidate]:
    sp = SearchSpace.load(paths.SPACES / f"{family}.toml")
    arch = gpu_arch()
    problem = dict(HEAD_DIM=head_dim, DTYPE=dtype, CAUSAL=causal, VARLEN=True)
    return [make_candidate(sp, p, problem, arch) for p in points
            if not sp.violations(p, problem, arch)]


def kernels(cands: list[Candidate]) -> list[VarlenKernel]:
    todo = [c for c in cands if c.identity not in _built]
    for cand, compiled in zip(todo, compile_many(todo, gpu_arch()), strict=True):
        assert compiled.ok, compiled.error
        _built[cand.identity] = VarlenKernel(cand, compiled)
    return [_built[c.identity] for c in cands]


def families() -> list[str]:
    return ["mma", "wgmma"] if gpu_arch().name == "sm_90a" else ["mma"]


def points(family: str) -> list[dict[str, object]]:
    return WGMMA_POINTS if family == "wgmma" else [MMA_POINT]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", ["mma", "wgmma"])
def test_ragged_batches_pass_the_criterion(family: str, causal: bool) -> None:
    if family not in families():
        pytest.skip(f"{family} needs sm_90a")
    for kernel in kernels(varlen_candidates(family, points(family), causal)):
        for heads, kv, strided in ((8, 2, True), (6, 1, False), (4, 4, True)):
            v = validate.check_varlen(kernel, seqlens=RAGGED, heads=heads, kv_heads=kv,
                                      head_dim=128, causal=causal, dtype=torch.float16,
                                      strided=strided)
            assert v.ok, f"{kernel.name} H{heads}/{kv} strided={strided}: {v.reason}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", ["mma", "wgmma"])
def test_a_batch_with_no_key_at_all(family: str, causal: bool) -> None:
    """Queries and no key in the whole batch (k and v of zero rows, where a TMA map cannot
    be made): zeros and log-sum-exp -inf, not an error; and a batch of empty sequences."""
    if family not in families():
        pytest.skip(f"{family} needs sm_90a")
    for kernel in kernels(varlen_candidates(family, points(family), causal)):
        for seqlens, strided in ((((5, 0), (0, 0), (17, 0)), False), (((9, 0),), True),
                                 (((0, 0), (0, 0)), False)):
            v = validate.check_varlen(kernel, seqlens=seqlens, heads=4, kv_heads=2,
                                      head_dim=128, causal=causal, dtype=torch.float16,
                                      strided=strided)
            assert v.ok, f"{kernel.name} {seqlens} strided={strided}: {v.reason}"


@pytest.mark.parametrize("causal", [False, True])
def test_packed_gqa_ragged_batches(causal: bool) -> None:
    """PACK_GQA on ragged batches: groups of 4, 32 and 3."""
    if "wgmma" not in families():
        pytest.skip("wgmma needs sm_90a")
    sp = SearchSpace.load(paths.SPACES / "wgmma.toml").with_untested()
    problem = dict(HEAD_DIM=128, DTYPE="fp16", CAUSAL=causal, VARLEN=True)
    points = [wgmma_point(PACK_GQA=True),
              wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic", PACK_GQA=True)]
    cands = [make_candidate(sp, p, problem, gpu_arch()) for p in points
             if not sp.violations(p, problem, gpu_arch())]
    for kernel in kernels(cands):
        for heads, kv, strided in ((8, 2, True), (32, 1, False), (6, 2, True)):
            v = validate.check_varlen(kernel, seqlens=RAGGED, heads=heads, kv_heads=kv,
                                      head_dim=128, causal=causal, dtype=torch.float16,
                                      strided=strided)
            assert v.ok, f"{kernel.name} H{heads}/{kv} strided={strided}: {v.reason}"


@pytest.mark.parametrize("causal", [False, True])
def test_p_barrier_and_o_stage_on_ragged_batches(causal: bool) -> None:
    """wgmma's P_BARRIER and O_STAGE values on ragged batches: the 192 x 128 d128 tile,
    persistent, O in the P tile (O_STAGE "p") with and without P ordered by the turn barrier
    (P_BARRIER "turn"): 24 sequences up to 2K tokens (many tiles per block), GQA 32/8, and the
    ragged set strided."""
    if "wgmma" not in families():
        pytest.skip("wgmma needs sm_90a")
    sp = SearchSpace.load(paths.SPACES / "wgmma.toml").with_untested()
    problem = dict(HEAD_DIM=128, DTYPE="bf16", CAUSAL=causal, VARLEN=True)
    base = wgmma_point(BLOCK_M=192, P_FROM="smem", PINGPONG=True, PERSISTENT=True,
                       SCHEDULER="dynamic" if causal else "static", O_STAGE="p")
    points = [base, {**base, "P_BARRIER": "turn"}]
    assert not any(sp.violations(p, problem, gpu_arch()) for p in points)
    lengths, _ = parse_seqlens("random:24:64:2048:1")
    for kernel in kernels([make_candidate(sp, p, problem, gpu_arch()) for p in points]):
        for seqlens, heads, kv, strided in ((lengths, 32, 8, False), (RAGGED, 8, 2, True)):
            v = validate.check_varlen(kernel, seqlens=seqlens, heads=heads, kv_heads=kv,
                                      head_dim=128, causal=causal, dtype=torch.bfloat16,
                                      strided=strided)
            assert v.ok, f"{kernel.name} H{heads}/{kv} strided={strided}: {v.reason}"


@pytest.mark.parametrize("pack", [False, True])
def test_dynamic_counter_is_fresh_per_launch(pack: bool) -> None:
    """The ragged kernel's tile counter is the launcher's, zeroed per launch on the launch's
    stream, as the forward's: launches back to back, on two streams at once and replayed from
    a CUDA graph all cover every tile, bit for bit like the first (which passes the
    criterion). 24 sequences up to 2K tokens: many tiles per SM."""
    if "wgmma" not in families():
        pytest.skip("wgmma needs sm_90a")
    point = wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic", PACK_GQA=pack)
    (kernel,) = kernels(varlen_candidates("wgmma", [point], causal=True, dtype="bf16"))
    lengths, _ = parse_seqlens("random:24:64:2048:1")
    v = validate.check_varlen(kernel, seqlens=lengths, heads=32, kv_heads=8, head_dim=128,
                              causal=True, dtype=torch.bfloat16)
    assert v.ok, f"{kernel.name}: {v.reason}"
    w = VarlenWorkload(lengths, heads=32, kv_heads=8, head_dim=128, causal=True, dtype="bf16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v_ = (torch.randn(total, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                for total, h in ((w.total_q, 32), (w.total_k, 8), (w.total_k, 8)))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in w.cu_seqlens())
    args = (q, k, v_, cu_q, cu_k, w.max_seqlen_q, w.max_seqlen_k)
    first = kernel(*args)
    for _ in range(3):
        assert torch.equal(kernel(*args), first)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [torch.full_like(first, float("nan")) for _ in streams]
    torch.cuda.synchronize()
    for stream, out in zip(streams, outs, strict=True):
        with torch.cuda.stream(stream):
            kernel(*args, out=out, check=False)
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    graph_out = torch.full_like(first, float("nan"))
    kernel(*args, out=graph_out, check=False)  # warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(*args, out=graph_out, check=False)
    for _ in range(2):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, first)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_head_dim_64_bf16_and_a_scale(dtype: str) -> None:
    family = families()[-1]
    point = wgmma_point(BLOCK_N=96, SWIZZLE=64) if family == "wgmma" else MMA_POINT
    (kernel,) = kernels(varlen_candidates(family, [point], True, dtype=dtype, head_dim=64))
    for scale in (None, 0.3, -0.2):
        v = validate.check_varlen(kernel, seqlens=RAGGED, heads=4, kv_heads=2, head_dim=64,
                                  causal=True, dtype=validate_dtype(dtype), scale=scale)
        assert v.ok, f"{kernel.name} scale {scale}: {v.reason}"


def validate_dtype(name: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def test_the_issue_workload_passes_the_workload_criterion() -> None:
    """16 sequences of 128..4096 (random.Random(0)), GQA 32/8, d128, causal: the plan's edge
    sequences and the workload's own lengths."""
    lengths, source = parse_seqlens("random:16:128:4096:0")
    w = VarlenWorkload(lengths, heads=32, kv_heads=8, head_dim=128, causal=True, source=source)
    family = families()[-1]
    point = wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic") \
        if family == "wgmma" else MMA_POINT
    (kernel,) = kernels(varlen_candidates(family, [point], True))
    v = validate.check_varlen_workload(kernel, w)
    assert v.ok, v.reason


def test_a_wrong_kernel_fails() -> None:
    """The criterion catches a kernel that reads the wrong keys (cu_seqlens_q for keys)."""
    family = families()[-1]
    point = wgmma_point() if family == "wgmma" else MMA_POINT
    (kernel,) = kernels(varlen_candidates(family, [point], False))

    def keys_of_queries(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # noqa: ANN001, ANN202
        return kernel(q, k, v, cu_q, cu_q, max_q, max_q, check=False, **kw)

    v = validate.check_varlen(keys_of_queries, seqlens=((100, 200), (50, 30)), heads=2, kv_heads=2,
                              head_dim=128, causal=False, dtype=torch.float16, strided=False)
    assert not v.ok


def test_input_checks_raise_before_any_launch() -> None:
    family = families()[-1]
    point = wgmma_point() if family == "wgmma" else MMA_POINT
    (kernel,) = kernels(varlen_candidates(family, [point], True))
    q = torch.randn(30, 4, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(20, 2, 128, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 5, 20], dtype=torch.int32, device="cuda")
    kernel(q, k, k, cu_q, cu_k, 20, 15)  # fine
    bad = [
        ((q, k, k, cu_q.long(), cu_k, 20, 15), "int32"),
        ((q, k, k, cu_q.cpu(), cu_k, 20, 15), "must be on"),
        ((q, k, k, cu_q[:2], cu_k, 20, 15), "batch \\+ 1"),
        ((q, k, k, torch.tensor([0, 20, 10], dtype=torch.int32, device="cuda"), cu_k, 20, 15),
         "never decrease"),
        ((q, k, k, torch.tensor([0, 10, 29], dtype=torch.int32, device="cuda"), cu_k, 20, 15),
         "end at the packed length 30"),
        ((q, k, k, cu_q, cu_k, 19, 15), "max_seqlen_q \\(19\\) is smaller"),
        ((q, k, k, cu_q, cu_k, 20, 14), "max_seqlen_k \\(14\\) is smaller"),
        ((q[None], k, k, cu_q, cu_k, 20, 15), "3-D"),
        ((q, k, k, cu_q, cu_k, 20.0, 15), "max_seqlen_q must be an int"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            kernel(*args)


def test_sdpa_fallback_passes_the_criterion() -> None:
    def fallback(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, out=None, lse=None):  # noqa: ANN001, ANN202
        out.copy_(varlen_sdpa(q, k, v, cu_q, cu_k, causal=True, scale=scale))
        return out

    v = validate.check_varlen(fallback, seqlens=RAGGED, heads=4, kv_heads=2, head_dim=64,
                              causal=True, dtype=torch.float16, with_lse=False)
    assert v.ok, v.reason


# ---- the exported module: attention_varlen, and Transformers' padding masks -----------------

VARLEN_WINNERS = [  # (family, problem, point, workload it wins); wgmma where sm_90a
    ("mma", dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True, VARLEN=True), MMA_POINT,
     VarlenWorkload(((200, 200), (57, 57)), heads=4, kv_heads=2, head_dim=64, causal=True)),
    ("wgmma", dict(HEAD_DIM=128, DTYPE="fp16", CAUSAL=True, VARLEN=True),
     wgmma_point(PINGPONG=True, PERSISTENT=True, SCHEDULER="dynamic"),
     VarlenWorkload(*parse_seqlens("random:16:128:4096:0")[:1], heads=32, kv_heads=8,
                    head_dim=128, causal=True, source="random:16:128:4096:0")),
    # The backward of the first (the tiny Llama's calls: d64 fp16 causal).
    ("mma_bwd", dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=True, VARLEN=True),
     dict(BLOCK_M=64, BLOCK_N=128, NUM_WARPS=8, STAGES=2, SWIZZLE="xor", DQ_ACCUM="atomic",
          KV_IN_REGS=False),
     VarlenBackwardWorkload(((200, 200), (57, 57)), heads=4, kv_heads=2, head_dim=64,
                            causal=True)),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from evoengine.export import export_best
    from evoengine.render import render
    from evoengine.store import Store
    from tests.test_export import import_path

    arch = gpu_arch()
    root = tmp_path_factory.mktemp("varlen-export")
    db = root / "evo.db"
    with Store(f"sqlite:///{db}") as store:
        for family, problem, point, w in VARLEN_WINNERS:
            if family not in (*families(), "mma_bwd"):
                continue
            (cand,) = varlen_candidates(family, [point], problem["CAUSAL"], problem["DTYPE"],
                                        problem["HEAD_DIM"])
            store.add_candidate(identity=cand.identity, family=cand.family,
                                template_hash=cand.template_hash, params=cand.params,
                                problem=cand.problem, source=render(cand))
            run = store.start_run(arch=arch.name, workload=w.to_dict(), workload_key=w.key(),
                                  device=torch.cuda.get_device_name(), study="gpu-test")
            store.set_elites(arch=arch.name, workload_key=w.key(),
                             entries=[(cand.identity, 100.0)], run_id=run)
    done = export_best(db, arch, output=root / "tuned_attention.py")
    return import_path(done.path, "tuned_attention_varlen_gpu")


def test_exported_attention_varlen_passes_the_criterion(exported) -> None:  # type: ignore[no-untyped-def]
    assert exported.attention.varlen_table
    for (dtype, head_dim, causal), _ in exported.attention.varlen_table.items():
        fn = functools.partial(exported.attention_varlen, causal=causal)
        for heads, kv, strided in ((8, 2, True), (4, 4, False)):
            v = validate.check_varlen(fn, seqlens=RAGGED, heads=heads, kv_heads=kv,
                                      head_dim=head_dim, causal=causal,
                                      dtype=validate_dtype(dtype), strided=strided)
            assert v.ok, f"{dtype} d{head_dim}: {v.reason}"


def test_exported_attention_varlen_without_a_kernel(exported) -> None:  # type: ignore[no-untyped-def]
    q = torch.randn(30, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    with pytest.raises(exported.NoKernelError, match="no tuned varlen kernel for torch.bfloat16"):
        exported.attention_varlen(q, q, q, cu, cu, 20, 20, causal=True)
    out = exported.attention_varlen(q, q, q, cu, cu, 20, 20, causal=True, fallback="sdpa")
    ref = varlen_sdpa(q, q, q, cu, cu, causal=True)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="max_seqlen_q \\(19\\) is smaller"):
        exported.attention_varlen(q, q, q, cu, cu, 19, 20, causal=True, fallback="sdpa")


@torch.no_grad()
def test_transformers_padding_runs_through_the_varlen_kernels(
        exported, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from tests.gpu.test_export import llamas

    assert exported.register_transformers(name="evoengine_varlen") == "evoengine_varlen"
    models = llamas("evoengine_varlen")
    launches = []
    launch = exported.CudaVarlenKernel.launch
    monkeypatch.setattr(exported.CudaVarlenKernel, "launch",
                        lambda self, *a: (launches.append(a[3].tolist()), launch(self, *a))[1])
    ids = torch.randint(0, 1000, (3, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :37] = 0  # left padding
    mask[1, 201:] = 0  # right padding
    real = mask.bool()
    logits = {name: m(ids, attention_mask=mask).logits[real] for name, m in models.items()}
    assert launches == [[0, 263, 464, 764]] * 2  # two layers, the real rows of each sequence
    ours_err = (logits["ours"].float() - logits["exact"]).abs().max().item()
    sdpa_err = (logits["sdpa"].float() - logits["exact"]).abs().max().item()
    assert ours_err <= 2 * sdpa_err + 1e-3, (ours_err, sdpa_err)


def test_transformers_padded_training_step_has_every_gradient(
        exported, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Training on padded batches: the forward through the varlen kernels, the backward
    through the varlen backward kernel, every parameter's gradient as close to the float32
    model's as SDPA's in fp16 is (the q, k, v projections' too: with an output that autograd
    cannot see through they would get none)."""
    pytest.importorskip("transformers")
    from tests.gpu.test_export import assert_training_step_matches, llamas

    name = "evoengine_varlen_train"
    assert exported.register_transformers(name=name) == name
    models = llamas(name, train=True)
    launches = []
    for cls in (exported.CudaVarlenKernel, exported.CudaVarlenBackward):
        monkeypatch.setattr(cls, "launch", lambda self, *a, launch=cls.launch, **kw: (
            launches.append(type(self).__name__), launch(self, *a, **kw))[1])
    ids = torch.randint(0, 1000, (3, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :37] = 0  # left padding
    mask[1, 201:] = 0  # right padding
    assert_training_step_matches(models, ids, attention_mask=mask,
                                 labels=ids.masked_fill(mask == 0, -100))
    # Two layers' forwards, then their backwards, through the varlen kernels.
    assert launches == ["CudaVarlenKernel"] * 2 + ["CudaVarlenBackward"] * 2


def test_exported_attention_varlen_gradients_from_the_backward_kernel(exported) -> None:  # type: ignore[no-untyped-def]
    """attention_varlen's gradients where the module has a varlen backward kernel: within the
    criterion of the float64 reference per sequence, as SDPA's per sequence are."""
    torch.manual_seed(0)
    lengths = RAGGED
    cu = [0]
    for lq, _ in lengths:
        cu.append(cu[-1] + lq)
    cu_k = [0]
    for _, lk in lengths:
        cu_k.append(cu_k[-1] + lk)
    q = torch.randn(cu[-1], 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn(cu_k[-1], 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    v = torch.randn(cu_k[-1], 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    dout = torch.randn_like(q)
    cq = torch.tensor(cu, dtype=torch.int32, device="cuda")
    ck = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    max_q, max_k = max(x for x, _ in lengths), max(x for _, x in lengths)
    out = exported.attention_varlen(q, k, v, cq, ck, max_q, max_k, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    base = torch.autograd.grad(varlen_sdpa(q, k, v, cq, ck, causal=True), (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    exact = torch.autograd.grad(varlen_sdpa(*leaves, cq, ck, causal=True), leaves,
                                dout.double())
    for name, g, b, e in zip("qkv", grads, base, exact, strict=True):
        err = (g.double() - e).abs().max().item()
        tol = validate.ERR_FACTOR * (b.double() - e).abs().max().item() + validate.GRAD_FLOOR
        assert bool(torch.isfinite(g).all()) and err <= tol, (name, err, tol)
