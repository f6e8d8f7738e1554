"""The device primitives that replace a hardware instruction, checked on the GPU against
float64 over their whole domain, edge values included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evoengine import paths

KERNEL = r"""
extern "C" __global__ void run_poly_exp2(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = poly_exp2(x[i]);
}
"""


@pytest.fixture(scope="module")
def poly_exp2():
    import cupy

    source = (paths.TEMPLATES / "common" / "primitives.cuh").read_text() + KERNEL
    fn = cupy.RawModule(code=source, options=("--std=c++17",)).get_function("run_poly_exp2")

    def run(x: np.ndarray) -> np.ndarray:
        xs = torch.from_numpy(x.astype(np.float32)).cuda()
        ys = torch.full_like(xs, float("nan"))
        n = xs.numel()
        fn(((n + 255) // 256,), (256,), (xs.data_ptr(), ys.data_ptr(), np.int32(n)))
        torch.cuda.synchronize()
        return ys.cpu().numpy()
    return run


def test_poly_exp2_matches_exp2_where_the_result_is_normal(poly_exp2) -> None:
    rng = np.random.default_rng()
    x = np.concatenate([np.linspace(-126.0, 0.0, 1_000_003), rng.uniform(-126, 0, 1_000_000),
                        -rng.exponential(1.0, 1_000_000), [0.0, -0.0, -0.5, -1.5, -125.5]])
    x = x.astype(np.float32)
    y = poly_exp2(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(y / ref - 1.0)
    assert np.isfinite(y).all()
    assert rel.max() < 7.6e-5, (float(rel.max()), float(x[np.argmax(rel)]))


def test_poly_exp2_underflow_infinity_and_nan(poly_exp2) -> None:
    x = np.array([-127.0, -127.5, -200.0, -3e38, -math.inf, math.nan, -126.9, -126.5],
                 dtype=np.float32)
    y = poly_exp2(x)
    assert (y[:5] == 0.0).all() and not np.signbit(y[:5]).any(), y  # +0, as ex2.approx.ftz
    assert math.isnan(y[5])
    # Between -127 and -126 the result is at most a subnormal of the right size or zero.
    assert (y[6:] >= 0).all() and (y[6:] < 2.0 ** -125).all(), y


def test_poly_exp2_tiny_positive_arguments(poly_exp2) -> None:
    """The softmax's x = s * scale - max * scale can round a hair above zero."""
    x = np.array([1e-7, 6e-8, 1e-30], dtype=np.float32)
    assert np.abs(poly_exp2(x) - 1.0).max() < 1e-4
