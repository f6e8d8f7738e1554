"""Timing on the GPU, the way careful benchmarks do it.

CUDA events around each call, after a warm-up; the median over many repetitions, with the
spread (interquartile range) kept; inputs rotated among enough copies that they don't sit
in L2; and, for calls short enough that launch gaps would dominate, a CUDA graph of many
calls replayed and divided by its length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from evoengine.workload import Workload

# Inputs are rotated until the bytes touched exceed this (H100: 50 MB of L2, H200: 60 MB).
L2_FLUSH_BYTES = 256 * 1024 * 1024
GRAPH_BELOW_US = 50.0  # calls shorter than this are timed by graph replay
# A search decides once per workload, so every contender (candidates, SDPA's backends) is
# timed the same way: graph replay below this many FLOPs (~50 us at 300 TFLOP/s). Deciding
# per call would time SDPA eagerly (its host overhead alone passes 50 us) and us by graph.
GRAPH_BELOW_FLOPS = 15e9
# Seconds of a contender's own calls before its timed ones. The clocks of a GPU that has just
# been idle or lightly loaded (between candidates: loading, validation on small shapes) stay
# above their sustained level for a while under full load, so a short burst reads fast
# (docs/NOTES.md, "Settling the clocks"). Every contender gets the same settling.
SETTLE_S = 0.1
WARMUP_CALLS = 10
REPS = 50
GRAPH_CALLS = 64  # calls captured in one graph; a replay's time is divided by this

# The method field of result files, in words made from the constants above, so it changes
# with them: how every timing is taken; which calls graph replay times when the workload
# decides (``graph_for``, as the search does); how the inputs stay out of L2; all three.
TIMING = (f"CUDA events, {WARMUP_CALLS} warm-up calls and {SETTLE_S:g} s of calls untimed, "
          f"median of {REPS}")
GRAPH_RULE = (f"graph replay of {GRAPH_CALLS} calls, for every contender, when the workload is "
              f"under {GRAPH_BELOW_FLOPS / 1e9:g} GFLOP")
INPUTS = f"inputs rotated over >={L2_FLUSH_BYTES >> 20} MB"
METHOD = f"{TIMING} ({GRAPH_RULE}), {INPUTS}"


@dataclass(frozen=True)
class Timing:
    median_us: float
    spread_us: float  # interquartile range
    reps: int
    graph: bool

    def to_dict(self) -> dict[str, Any]:
        return {"median_us": self.median_us, "spread_us": self.spread_us, "reps": self.reps,
                "graph": self.graph}


def copies_needed(bytes_per_set: int) -> int:
    """How many input sets to rotate so consecutive calls miss in L2."""
    return max(2, min(64, -(-L2_FLUSH_BYTES // max(1, bytes_per_set))))


def time_calls(fn: Callable[[int], None], n_sets: int, *, reps: int = REPS,
               warmup: int = WARMUP_CALLS, graph: bool | None = None,
               settle_s: float | None = None) -> Timing:
    """Time ``fn(i)``, which runs the call on input set ``i % n_sets``.

    At least ``warmup`` calls, and calls for at least ``settle_s`` seconds (default
    ``SETTLE_S``), run untimed first. ``graph=None`` picks graph replay when one eager call
    takes under ``GRAPH_BELOW_US``.
    """
    settle(fn, n_sets, warmup, SETTLE_S if settle_s is None else settle_s)
    eager = _time_eager(fn, n_sets, reps)
    if graph is False or (graph is None and eager.median_us >= GRAPH_BELOW_US):
        return eager
    return _time_graph(fn, n_sets, reps)


def settle(fn: Callable[[int], None], n_sets: int, calls: int, seconds: float) -> int:
    """Run ``fn`` at least ``calls`` times and for at least ``seconds``; returns the count.

    The device is kept busy in batches (one synchronisation per batch, each batch sized from
    the previous one's rate) so the load stays continuous, as it is while timing."""
    import torch

    done, batch = 0, max(1, calls)
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            fn(done % n_sets)
            done += 1
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if done >= calls and elapsed >= seconds:
            return done
        per_call = elapsed / done
        batch = max(1, min(10_000, int((seconds - elapsed) / per_call) + 1))


def _time_eager(fn: Callable[[int], None], n_sets: int, reps: int) -> Timing:
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)], False)


def _time_graph(fn: Callable[[int], None], n_sets: int, reps: int,
                per_graph: int = GRAPH_CALLS) -> Timing:
    """Capture ``per_graph`` calls cycling over the sets; time each replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm up on the capture stream
            fn(i % n_sets)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            fn(i % n_sets)
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(5, reps // 4)):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per_graph)
    return _summary(samples, True)


def _summary(samples_us: Sequence[float], graph: bool) -> Timing:
    q = statistics.quantiles(samples_us, n=4) if len(samples_us) >= 4 else [0.0, 0.0, 0.0]
    return Timing(statistics.median(samples_us), q[2] - q[0], len(samples_us), graph)


def graph_for(workload: Workload) -> bool:
    """Whether calls on ``workload`` are timed by CUDA-graph replay."""
    return workload.flops() < GRAPH_BELOW_FLOPS


def workload_inputs(workload: Workload, device: str | int = "cuda",
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Enough (q, k, v, out) sets of random data, [B, H, S, D], to rotate past L2."""
    import torch

    from evoengine.launch import KERNEL_DTYPES

    dtype = KERNEL_DTYPES[workload.dtype]
    w = workload
    per_set = 2 * w.batch * w.head_dim * (w.heads * w.seq_q + 2 * w.kv_heads * w.seq_k)  # type: ignore[operator]
    sets = []
    for _ in range(copies_needed(per_set)):
        q = torch.randn(w.batch, w.heads, w.seq_q, w.head_dim, device=device, dtype=dtype)
        k = torch.randn(w.batch, w.kv_heads, w.seq_k, w.head_dim, device=device, dtype=dtype)  # type: ignore[arg-type]
        v = torch.randn_like(k)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


SDPA_BACKENDS = ("flash", "cudnn")


def kernel_call(kernel: Any, sets: Sequence[tuple[torch.Tensor, ...]],
                scale: float) -> Callable[[int], None]:
    """``fn(i)`` for ``time_calls``: ``kernel`` (a loaded ``runtime.Kernel``) on input set
    ``i``, writing its out tensor, no log-sum-exp; the inputs are checked once, here."""
    from evoengine.runtime import check_inputs

    problem = check_inputs(*sets[0][:3], head_dim=kernel.head_dim, dtype=kernel.dtype)

    def call(i: int) -> None:
        q, k, v, o = sets[i]
        kernel.launch(q, k, v, o, None, problem, scale)
    return call


def sdpa_call(workload: Workload, sets: Sequence[tuple[torch.Tensor, ...]]
              ) -> Callable[[int], None]:
    """``fn(i)`` for ``time_calls``: torch SDPA on input set ``i`` (run it under
    ``sdpa_backend`` to pin a backend)."""
    import torch

    gqa = workload.kv_heads != workload.heads

    def call(i: int) -> None:
        q, k, v = sets[i][:3]
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=workload.causal,
                                                         enable_gqa=gqa)
    return call


def sdpa_backend(backend: str) -> Any:
    """A context manager that restricts SDPA to ``backend`` (``flash`` or ``cudnn``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]])


def time_sdpa(workload: Workload, sets: Sequence[tuple[torch.Tensor, ...]], backend: str,
              **kw: Any) -> Timing | None:
    """Time torch SDPA restricted to one backend (``flash`` or ``cudnn``) on the sets;
    None when that backend cannot run the workload here."""
    if workload.causal and workload.seq_q != workload.seq_k:
        return None  # SDPA's is_causal aligns top-left; ours is bottom-right: not comparable
    try:
        with sdpa_backend(backend):
            return time_calls(sdpa_call(workload, sets), len(sets), **kw)
    except RuntimeError:
        return None


# ---- FlashAttention-4 (CuTe DSL), where it imports ------------------------------------------
# Not a dependency: it is timed as an anchor when ``flash_attn.cute`` imports (a GPU box that
# installed it, e.g. through ../shared/device/fa4.sh) and skipped, once said, when it does not.

_FA4_MISSING: list[str] = []


def fa4_attention() -> Callable[..., Any] | None:
    """FlashAttention-4's ``flash_attn_func`` (BSHD tensors, ``causal=``, bottom-right like
    ours), or None, saying why once on stderr."""
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any failure to import means "not here"
        if not _FA4_MISSING:
            import sys

            _FA4_MISSING.append(f"{type(e).__name__}: {e}")
            print(f"evoengine: FlashAttention-4 not timed ({_FA4_MISSING[0]})", file=sys.stderr)
        return None
    return flash_attn_func


def fa4_output(result: Any) -> Any:
    """The output tensor of a ``flash_attn_func`` call (some versions return (out, lse))."""
    return result[0] if isinstance(result, tuple) else result


def time_fa4(workload: Workload, sets: Sequence[tuple[torch.Tensor, ...]],
             **kw: Any) -> Timing | None:
    """Time FlashAttention-4's forward on the sets (q, k, v as BSHD views of our BHSD
    tensors: a transpose, no copy); None where it does not import or cannot run the workload.
    Never by graph replay: its JIT-compiled launches are not known to capture."""
    fn = fa4_attention()
    if fn is None or kw.get("graph"):
        return None
    kw["graph"] = False
    causal = workload.causal

    def call(i: int) -> None:
        q, k, v = (x.transpose(1, 2) for x in sets[i][:3])
        fn(q, k, v, causal=causal)
    try:
        call(0)  # the first call compiles
        return time_calls(call, len(sets), **kw)
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        import sys

        print(f"evoengine: FlashAttention-4 cannot run {workload.key()}: {e}", file=sys.stderr)
        return None
