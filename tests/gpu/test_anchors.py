"""Decode's anchors on a real GPU (issue #18): SDPA's cuDNN and flash backends always, FA4 and
FlashInfer where they import (skipped otherwise). Every anchor that runs times a small row of
each layout and q_len (GQA 32/8, a last page partly filled), the two library anchors after
their output passed the check against SDPA; and that check refuses a call that is not
attention (its K and V swapped), so a misread layout is never timed."""

from __future__ import annotations

import functools
import math

import pytest

from evoengine.problems import decode as dec

TIMING = dict(reps=5, warmup=2, settle_s=0.0)


def workload(q_len: int, layout: str) -> dec.DecodeWorkload:
    return dec.DecodeWorkload(batch=3, q_len=q_len, q_heads=32, kv_heads=8, head_dim=128,
                              cache_len=1000, layout=layout, page_size=64, dtype="fp16")


def imports(anchor: str) -> bool:
    if anchor == "fa4":
        return dec.fa4_decode() is not None
    if anchor == "flashinfer":
        return dec.flashinfer_module() is not None
    return True


@pytest.mark.parametrize("anchor", ["cudnn", "flash", "fa4", "flashinfer"])
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_each_anchor_that_imports_times_a_row(anchor: str, layout: str, q_len: int) -> None:
    if not imports(anchor):
        pytest.skip(f"{anchor} does not import here")
    w = workload(q_len, layout)
    sets = dec.Decode().inputs(w)
    t = dec.Decode().time_anchor(anchor, w, sets, **TIMING)
    assert t is not None, (anchor, w.key())
    assert math.isfinite(t.median_us) and 0 < t.median_us < 1e5, t


@pytest.mark.parametrize("anchor", ["fa4", "flashinfer"])
def test_the_check_refuses_an_anchor_that_is_not_attention(
        anchor: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    if not imports(anchor):
        pytest.skip(f"{anchor} does not import here")
    w = workload(4, "paged")
    sets = dec.Decode().inputs(w)
    swapped = [(q, v, k, lens, table, out) for q, k, v, lens, table, out in sets]
    if anchor == "flashinfer":
        # Its plan and call on the swapped cache; the check compares with the true one.
        real = dec.flashinfer_calls
        monkeypatch.setattr(dec, "flashinfer_calls",
                            lambda fi, w_, s: real(fi, w_, swapped))
    else:
        fn = dec.fa4_decode()

        @functools.wraps(fn)  # the same signature, which picks the call's keywords
        def swapped_fa4(q, k, v, **kw):
            return fn(q, v, k, **kw)
        monkeypatch.setattr(dec, "fa4_decode", lambda: swapped_fa4)
    assert dec.Decode().time_anchor(anchor, w, sets, **TIMING) is None
    assert "is off by" in capsys.readouterr().err
