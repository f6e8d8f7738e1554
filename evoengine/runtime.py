"""Load a compiled candidate on the GPU and call it on torch tensors.

Kernels are cubins built by :mod:`evoengine.compile` (NVRTC), loaded and launched by
:mod:`evoengine.launch`, the launcher that exported modules carry too: on torch's
current stream, so they order correctly with the surrounding torch work.
"""

from __future__ import annotations

from typing import Self

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.launch import LOG2E, CudaKernel, Problem, check_inputs
from evoengine.launch.varlen import CudaVarlenKernel
from evoengine.render import Candidate

__all__ = ["LOG2E", "FromCandidate", "Kernel", "NoGPUError", "Problem", "VarlenKernel",
           "check_inputs", "gpu_arch"]


class NoGPUError(RuntimeError):
    """Raised where a CUDA GPU is needed and none is usable."""


def gpu_arch() -> Arch:
    """The target of the current CUDA device; ``NoGPUError`` when there is none."""
    import torch

    from evoengine.arch import arch_of_capability

    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA GPU is visible to torch")
    return arch_of_capability(*torch.cuda.get_device_capability())


class FromCandidate:
    """What every launcher built from a compiled candidate shares (forward, varlen, backward,
    decode), mixed in before the launcher class of ``evoengine.launch`` it builds: the candidate
    checked against the class's kind (``refusal``) and for a cubin (a one-line ``ValueError``
    with the compiler's error where there is none), the launcher given its cubin and spec, the
    candidate and its compile result kept, ``build`` from a candidate and a target. A new kind
    of kernel is ``class XKernel(FromCandidate, CudaX)`` and its ``refusal``."""

    load_at_once = False  # load the cubin in the constructor: a bad one fails there

    @classmethod
    def refusal(cls, candidate: Candidate) -> str | None:
        """Why ``candidate`` is not of this class's kind (the end of a one-line error), or None."""
        return None

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        why = self.refusal(candidate)
        if why:
            raise ValueError(f"{candidate.identity} {why}")
        if not compiled.ok or compiled.cubin is None:
            raise ValueError(f"{candidate.identity} did not compile: {compiled.error}")
        super().__init__(candidate.identity, arch=compiled.arch,  # type: ignore[call-arg]
                         cubin=compiled.cubin,
                         **self.spec_args(candidate.spec()))  # type: ignore[attr-defined]
        self.candidate = candidate
        self.compiled = compiled
        if self.load_at_once:
            import torch

            self.load(torch.cuda.current_device())  # type: ignore[attr-defined]

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> Self:
        return cls(candidate, compile_candidate(candidate, arch))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.candidate.identity!r})"


class Kernel(FromCandidate, CudaKernel):
    """One compiled candidate, loaded on the current device: ``kernel(q, k, v) -> out``."""

    load_at_once = True  # not mid-measurement


class VarlenKernel(FromCandidate, CudaVarlenKernel):
    """One candidate compiled with VARLEN, loaded on the current device: ``kernel(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> out`` on packed tensors."""

    load_at_once = True

    @classmethod
    def refusal(cls, candidate: Candidate) -> str | None:
        return (None if candidate.problem.get("VARLEN")
                else "is not compiled for ragged batches (VARLEN)")
