"""The forward pass: ``out = softmax(q k^T * scale) v`` (and its log-sum-exp), one call.

The workload is ``evoengine.workload.Workload`` (Q [B, H, Sq, D], K and V [B, KV, Sk, D],
causal aligned bottom-right, fp16 or bf16); the criterion is ``validate.check_workload``;
kernels are ``runtime.Kernel``; the anchors are SDPA's flash and cuDNN backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from evoengine.argtypes import positive_int
from evoengine.geometry import TOKENS_PER_CALL
from evoengine.problems.base import Problem, TimedCall
from evoengine.workload import DTYPES, Workload

if TYPE_CHECKING:
    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict


class Forward(Problem):
    kind = "fwd"
    summary = "attention forward: out (and log-sum-exp) from q, k, v"
    anchors = ("flash", "cudnn", "fa4")  # SDPA's backends; FlashAttention-4 where it imports

    def method(self) -> str:
        from evoengine import measure

        return (f"{measure.METHOD}; elites re-timed interleaved with SDPA flash and cuDNN "
                "(and FlashAttention-4's flash_attn_func on BSHD views, eager, where it "
                "imports), median of the rounds' medians")

    def workload_from_dict(self, data: Mapping[str, Any]) -> Workload:
        return Workload.from_dict(dict(data))

    def workload_from_key(self, key: str) -> Workload:
        return Workload.from_key(key)

    def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
        parser.add_argument("--shape", metavar="B,H,S,D",
                            help="batch, query heads, query length, head dim (B,H,S,D)")
        parser.add_argument("--kv-heads", type=positive_int, metavar="N", help="key/value heads "
                            "(default: H; a divisor of H for GQA/MQA)")
        parser.add_argument("--seq-k", type=positive_int, metavar="S",
                            help="key length (default: S)")
        parser.add_argument("--causal", action="store_true",
                            help="causal mask, aligned bottom-right")
        parser.add_argument("--dtype", choices=DTYPES, default="fp16")

    def workload_from_arguments(self, args: argparse.Namespace) -> Workload:
        if args.shape is None:
            raise ValueError("--shape B,H,S,D is required")
        return Workload.parse(args.shape, kv_heads=args.kv_heads, seq_k=args.seq_k,
                              causal=args.causal, dtype=args.dtype)

    def tune_workloads(self, geometry: ModelGeometry) -> list[Workload]:
        """The prefill ladder, then its latency calls (one sequence at the short lengths:
        ``ModelGeometry.latency_calls``), which the exported dispatch gives calls of a few
        sequences."""
        calls = [*geometry.prefill_calls(), *geometry.latency_calls()]
        return [self.workload_from_dict(call) for call in calls]

    def cell_workloads(self, workload: Any) -> list[Workload]:
        """A quarter octave below and above the workload's lengths (the middle of each half
        of the cell [S/sqrt 2, S sqrt 2] the exported module's nearest-length dispatch gives
        its entry), odd so that no tile divides them, each at about the workload's tokens
        per call and at a quarter of them: an entry serves smaller batches than the one it
        was tuned at. A single sequence under a quarter of a ladder call's tokens (a latency
        call) takes 4 sequences instead of a quarter: its entry serves calls of a few."""
        out = []
        for step in (-0.25, 0.25):
            f = 2.0 ** step
            seq_q = max(1, round(workload.seq_q * f)) | 1
            seq_k = max(seq_q if workload.causal else 1, round(workload.seq_k * f) | 1)
            batch = max(1, round(workload.batch * workload.seq_q / seq_q))
            few = (4 if workload.batch == 1 and 4 * workload.seq_q <= TOKENS_PER_CALL
                   else max(1, round(batch / 4)))
            for b in dict.fromkeys((batch, few)):
                out.append(dataclasses.replace(workload, batch=b, seq_q=seq_q, seq_k=seq_k))
        return out

    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        from evoengine.runtime import Kernel

        return Kernel(candidate, compiled)

    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        from evoengine import validate

        return validate.check_workload(kernel, workload, device=device)

    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        from evoengine import measure

        return measure.workload_inputs(workload, device)

    def timed_call(self, kernel: Any, workload: Any,
                   sets: Sequence[tuple[Any, ...]]) -> TimedCall:
        from evoengine import measure

        return measure.kernel_call(kernel, sets, 1.0 / math.sqrt(workload.head_dim))

    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        from evoengine import measure

        if anchor == "fa4":
            return measure.time_fa4(workload, sets, **timing)
        return measure.time_sdpa(workload, sets, anchor, **timing)
