"""Load a compiled candidate on the GPU and call it on torch tensors.

Kernels are cubins built by :mod:`evoengine.compile` (NVRTC), loaded and launched by
:mod:`evoengine.launch`, the launcher that exported modules carry too: on torch's
current stream, so they order correctly with the surrounding torch work.
"""

from __future__ import annotations

from evoengine.arch import Arch
from evoengine.compile import CompileResult, compile_candidate
from evoengine.launch import LOG2E, CudaKernel, Problem, check_inputs
from evoengine.launch.varlen import CudaVarlenKernel
from evoengine.render import Candidate

__all__ = ["LOG2E", "Kernel", "NoGPUError", "Problem", "VarlenKernel", "check_inputs",
           "compiled_cubin", "gpu_arch"]


class NoGPUError(RuntimeError):
    """Raised where a CUDA GPU is needed and none is usable."""


def gpu_arch() -> Arch:
    """The target of the current CUDA device; ``NoGPUError`` when there is none."""
    import torch

    from evoengine.arch import arch_of_capability

    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA GPU is visible to torch")
    return arch_of_capability(*torch.cuda.get_device_capability())


def compiled_cubin(candidate: Candidate, compiled: CompileResult) -> bytes:
    """The candidate's cubin; ``ValueError`` with the compiler's error where there is none.
    Every launcher built from a candidate (forward, varlen, backward, decode) starts here."""
    if not compiled.ok or compiled.cubin is None:
        raise ValueError(f"{candidate.identity} did not compile: {compiled.error}")
    return compiled.cubin


def _kernel_args(candidate: Candidate, compiled: CompileResult) -> dict:
    """What the forward launchers' kernel classes take, for a compiled candidate."""
    return dict(arch=compiled.arch, cubin=compiled_cubin(candidate, compiled),
                **CudaKernel.spec_args(candidate.spec()))


class Kernel(CudaKernel):
    """One compiled candidate, loaded on the current device: ``kernel(q, k, v) -> out``."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        import torch

        super().__init__(candidate.identity, **_kernel_args(candidate, compiled))
        self.candidate = candidate
        self.compiled = compiled
        self.load(torch.cuda.current_device())  # a bad cubin fails here, not mid-measurement

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> Kernel:
        return cls(candidate, compile_candidate(candidate, arch))


class VarlenKernel(CudaVarlenKernel):
    """One candidate compiled with VARLEN, loaded on the current device: ``kernel(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> out`` on packed tensors."""

    def __init__(self, candidate: Candidate, compiled: CompileResult) -> None:
        import torch

        if not candidate.problem.get("VARLEN"):
            raise ValueError(f"{candidate.identity} is not compiled for ragged batches (VARLEN)")
        super().__init__(candidate.identity, **_kernel_args(candidate, compiled))
        self.candidate = candidate
        self.compiled = compiled
        self.load(torch.cuda.current_device())

    @classmethod
    def build(cls, candidate: Candidate, arch: Arch | str) -> VarlenKernel:
        return cls(candidate, compile_candidate(candidate, arch))
