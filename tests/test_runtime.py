"""Tests of evoengine.runtime that need no GPU: input checks and the target lookup.

``check_inputs`` first refuses tensors that are not on a CUDA device. To reach the checks
after that on a CPU-only machine, the tests wrap CPU tensors in a subclass that reports
``is_cuda`` as True; everything else the function reads (shape, dtype, strides, pointer) is
the real CPU tensor's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evoengine.runtime import NoGPUError, Problem, check_inputs, gpu_arch

F16 = torch.float16


class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def cuda_like(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(FakeCuda)


def t(*shape: int, dtype: torch.dtype = F16) -> torch.Tensor:
    return cuda_like(torch.zeros(*shape, dtype=dtype))


def test_cpu_tensors_are_refused_naming_cuda() -> None:
    q = torch.zeros(1, 2, 16, 64, dtype=F16)
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor, got device cpu"):
        check_inputs(q, q, q)


def test_the_first_cpu_tensor_is_named() -> None:
    with pytest.raises(ValueError, match=r"^k must be a CUDA tensor"):
        check_inputs(t(1, 2, 16, 64), torch.zeros(1, 2, 16, 64, dtype=F16), t(1, 2, 16, 64))


@pytest.mark.parametrize("bad", [np.zeros((1, 2, 16, 64), dtype=np.float16), [[1.0]], None])
def test_non_tensors_are_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=rf"q must be a torch.Tensor, got {type(bad).__name__}"):
        check_inputs(bad, bad, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^v must be a torch.Tensor"):
        check_inputs(t(1, 2, 16, 64), t(1, 2, 16, 64), bad)  # type: ignore[arg-type]


def test_good_inputs_give_the_problem() -> None:
    p = check_inputs(t(2, 8, 33, 64), t(2, 2, 17, 64), t(2, 2, 17, 64), head_dim=64,
                     dtype="fp16")
    assert p == Problem(batch=2, heads=8, kv_heads=2, seq_q=33, seq_k=17, head_dim=64)
    bf = check_inputs(t(1, 1, 1, 128, dtype=torch.bfloat16), t(1, 1, 5, 128, dtype=torch.bfloat16),
                      t(1, 1, 5, 128, dtype=torch.bfloat16), dtype="bf16")
    assert (bf.seq_q, bf.seq_k, bf.head_dim) == (1, 5, 128)


def test_strided_views_of_bshd_storage_are_accepted() -> None:
    q = cuda_like(torch.zeros(2, 33, 4, 64, dtype=F16)).transpose(1, 2)
    assert not q.is_contiguous()
    assert check_inputs(q, q, q).seq_q == 33


def aligned_misses() -> list[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor], str]]:
    good = t(1, 2, 16, 64)
    padded = cuda_like(torch.zeros(1, 2, 16, 68, dtype=F16))[..., :64]  # row stride 68
    offset = cuda_like(torch.zeros(1 + 2 * 16 * 64, dtype=F16)[1:].view(1, 2, 16, 64))
    return [
        ("3-D", (t(2, 16, 64), good, good), r"q must be 4-D \[batch, heads, seq, head_dim\]"),
        ("float32", (good, t(1, 2, 16, 64, dtype=torch.float32), good),
         r"k must be float16 or bfloat16, got torch.float32"),
        ("empty", (t(1, 2, 0, 64), good, good), r"q is empty: shape \(1, 2, 0, 64\)"),
        ("last dim strided", (good, good, cuda_like(torch.zeros(1, 2, 64, 16, dtype=F16)).mT),
         r"v must have a contiguous last dim"),
        ("row stride not x8", (padded, good, good), r"q must be 16-byte aligned"),
        ("pointer misaligned", (offset, good, good), r"q must be 16-byte aligned"),
        ("dtypes differ", (good, t(1, 2, 16, 64, dtype=torch.bfloat16),
                           t(1, 2, 16, 64, dtype=torch.bfloat16)), r"q, k, v must share a dtype"),
        ("k v shapes differ", (good, good, t(1, 2, 8, 64)), r"k and v must have one shape"),
        ("batch differs", (good, t(2, 2, 16, 64), t(2, 2, 16, 64)),
         r"k, v must be \[1, kv_heads, seq_k, 64\] to match q"),
        ("head dim differs", (good, t(1, 2, 16, 128), t(1, 2, 16, 128)),
         r"k, v must be \[1, kv_heads, seq_k, 64\] to match q"),
        ("heads not a multiple", (t(1, 3, 16, 64), good, good),
         r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ]


@pytest.mark.parametrize(("case", "args", "message"), aligned_misses(),
                         ids=[c[0] for c in aligned_misses()])
def test_bad_inputs_are_named(case: str, args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_inputs(*args)


def test_kernel_specific_head_dim_and_dtype() -> None:
    q = t(1, 2, 16, 64)
    with pytest.raises(ValueError, match="this kernel takes head_dim 128, got 64"):
        check_inputs(q, q, q, head_dim=128)
    with pytest.raises(ValueError, match="this kernel takes bf16, got torch.float16"):
        check_inputs(q, q, q, dtype="bf16")
    assert check_inputs(q, q, q, head_dim=64, dtype="fp16").heads == 2


def test_gpu_arch_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGPUError, match="no CUDA GPU"):
        gpu_arch()
    assert issubclass(NoGPUError, RuntimeError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_gpu_arch_raises_here() -> None:
    with pytest.raises(NoGPUError):
        gpu_arch()


@pytest.mark.parametrize(("capability", "name"),
                         [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"),
                          ((9, 0), "sm_90a")])
def test_gpu_arch_maps_the_capability(monkeypatch: pytest.MonkeyPatch,
                                      capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert gpu_arch().name == name


def test_gpu_arch_refuses_an_unknown_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(ValueError, match="unknown arch 'sm_75'"):
        gpu_arch()
