"""Tests of evoengine.workload: parsing, validation, the key and the FLOP count."""

from __future__ import annotations

import pytest

from evoengine.workload import DTYPES, Workload


def test_parse_shape() -> None:
    w = Workload.parse("2,16,4096,128")
    assert (w.batch, w.heads, w.seq_q, w.head_dim) == (2, 16, 4096, 128)
    assert w.kv_heads == 16 and w.seq_k == 4096
    assert w.causal is False and w.dtype == "fp16"
    assert Workload.parse(" 1, 2 ,3,4") == Workload(1, 2, 3, 4)


def test_parse_passes_keywords() -> None:
    w = Workload.parse("1,8,100,64", kv_heads=2, seq_k=300, causal=True, dtype="bf16")
    assert (w.kv_heads, w.seq_k, w.causal, w.dtype) == (2, 300, True, "bf16")


@pytest.mark.parametrize("shape", ["1,2,3", "1,2,3,4,5", "a,b,c,d", "", "1.5,2,3,4",
                                   "1;2;3;4", "1,2,,4"])
def test_parse_refuses_bad_shapes(shape: str) -> None:
    with pytest.raises(ValueError, match="shape must be B,H,S,D") as info:
        Workload.parse(shape)
    assert repr(shape) in str(info.value)


@pytest.mark.parametrize(("shape", "name", "value"),
                         [("0,2,3,4", "batch", 0), ("1,-2,3,4", "heads", -2),
                          ("1,2,0,4", "seq_q", 0), ("1,2,3,0", "head_dim", 0)])
def test_parse_refuses_non_positive_dims(shape: str, name: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got {value}"):
        Workload.parse(shape)


def test_kv_heads_and_seq_k_default_to_q() -> None:
    w = Workload(batch=1, heads=12, seq_q=77, head_dim=64)
    assert w.kv_heads == 12
    assert w.seq_k == 77
    w = Workload(batch=1, heads=12, seq_q=77, head_dim=64, kv_heads=3, seq_k=5)
    assert (w.kv_heads, w.seq_k) == (3, 5)


@pytest.mark.parametrize(("field", "value"), [("kv_heads", 0), ("seq_k", -1), ("batch", 2.0),
                                              ("head_dim", "64")])
def test_fields_must_be_positive_integers(field: str, value: object) -> None:
    kw: dict[str, object] = dict(batch=1, heads=4, seq_q=8, head_dim=64)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be a positive integer"):
        Workload(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("heads", "kv_heads", "ok"),
                         [(8, 2, True), (8, 1, True), (8, 8, True), (8, 3, False), (4, 8, False)])
def test_gqa_divisibility(heads: int, kv_heads: int, ok: bool) -> None:
    if ok:
        assert Workload(1, heads, 16, 64, kv_heads=kv_heads).kv_heads == kv_heads
    else:
        with pytest.raises(ValueError,
                           match=rf"query heads \({heads}\) must be a multiple of kv heads "
                                 rf"\({kv_heads}\)"):
            Workload(1, heads, 16, 64, kv_heads=kv_heads)


def test_dtype_check() -> None:
    assert DTYPES == ("fp16", "bf16")
    assert Workload(1, 1, 1, 64, dtype="bf16").dtype == "bf16"
    for bad in ("fp32", "float16", "FP16", ""):
        with pytest.raises(ValueError, match=r"dtype must be one of \('fp16', 'bf16'\)"):
            Workload(1, 1, 1, 64, dtype=bad)


@pytest.mark.parametrize(("kw", "name"), [({"causal": "false"}, "causal"),
                                          ({"causal": 1}, "causal"),
                                          ({"batch": True}, "batch"),
                                          ({"seq_k": False}, "seq_k")])
def test_types_are_checked(kw: dict, name: str) -> None:
    # causal="false" is truthy: accepting it would make a causal workload.
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        Workload(**{"batch": 1, "heads": 2, "seq_q": 8, "head_dim": 64, **kw})


def test_key_format() -> None:
    w = Workload.parse("2,16,4096,128", causal=True)
    assert w.key() == "b2-h16-kv16-sq4096-sk4096-d128-causal-fp16"
    w = Workload(1, 8, 100, 64, kv_heads=2, seq_k=300, dtype="bf16")
    assert w.key() == "b1-h8-kv2-sq100-sk300-d64-full-bf16"


def test_key_differs_for_every_field() -> None:
    base = Workload(2, 8, 64, 64, kv_heads=4, seq_k=128)
    variants = [Workload(3, 8, 64, 64, kv_heads=4, seq_k=128),
                Workload(2, 16, 64, 64, kv_heads=4, seq_k=128),
                Workload(2, 8, 65, 64, kv_heads=4, seq_k=128),
                Workload(2, 8, 64, 128, kv_heads=4, seq_k=128),
                Workload(2, 8, 64, 64, kv_heads=2, seq_k=128),
                Workload(2, 8, 64, 64, kv_heads=4, seq_k=129),
                Workload(2, 8, 64, 64, kv_heads=4, seq_k=128, causal=True),
                Workload(2, 8, 64, 64, kv_heads=4, seq_k=128, dtype="bf16")]
    keys = {w.key() for w in [base, *variants]}
    assert len(keys) == 1 + len(variants)


def test_problem_is_what_the_kernel_compiles_in() -> None:
    w = Workload(1, 8, 100, 128, causal=True, dtype="bf16")
    problem = w.problem()
    assert problem == {"HEAD_DIM": 128, "DTYPE": "bf16", "CAUSAL": True}
    assert list(problem) == ["HEAD_DIM", "DTYPE", "CAUSAL"]  # the spaces' declared order


def test_flops_full() -> None:
    w = Workload(2, 16, 1000, 128, seq_k=3000)
    assert w.flops() == 4 * 2 * 16 * 1000 * 3000 * 128


@pytest.mark.parametrize("s", [1, 2, 7, 128, 4096])
def test_flops_causal_square_is_about_half(s: int) -> None:
    w = Workload(2, 16, s, 128, causal=True)
    assert w.flops() == 4 * 2 * 16 * 128 * s * (s + 1) / 2
    full = Workload(2, 16, s, 128).flops()
    assert w.flops() == pytest.approx(full * (s + 1) / (2 * s))


def test_flops_causal_bottom_right() -> None:
    # seq_q 8 > seq_k 4: rows 0..3 see nothing, rows 4..7 see 1..4 keys.
    assert Workload(1, 1, 8, 64, seq_k=4, causal=True).flops() == 4 * 64 * (1 + 2 + 3 + 4)
    # seq_q 4 < seq_k 8: rows see 5..8 keys.
    assert Workload(1, 1, 4, 64, seq_k=8, causal=True).flops() == 4 * 64 * (5 + 6 + 7 + 8)
    # one query (decoding) sees every key.
    assert Workload(1, 1, 1, 64, seq_k=500, causal=True).flops() == 4 * 64 * 500


def test_flops_scale_with_heads_not_kv_heads() -> None:
    a = Workload(1, 8, 64, 64)
    b = Workload(1, 8, 64, 64, kv_heads=1)
    assert a.flops() == b.flops()


def test_to_dict_round_trips() -> None:
    w = Workload(2, 8, 100, 64, kv_heads=2, seq_k=50, causal=True, dtype="bf16")
    d = w.to_dict()
    assert d == {"kind": "fwd", "batch": 2, "heads": 8, "seq_q": 100, "head_dim": 64,
                 "kv_heads": 2, "seq_k": 50, "causal": True, "dtype": "bf16"}
    assert Workload.from_dict(d) == w


def test_parse_spec_reads_the_benchmarks_workload_lists() -> None:
    assert Workload.parse_spec("2,32,8192,128") == Workload(2, 32, 8192, 128)
    assert Workload.parse_spec("16,16,2048,64,causal", dtype="bf16") == Workload(
        16, 16, 2048, 64, causal=True, dtype="bf16")
    assert Workload.parse_spec("8,16,2048,64,kv1,causal") == Workload(
        8, 16, 2048, 64, kv_heads=1, causal=True)
    with pytest.raises(ValueError, match="B,H,S,D"):
        Workload.parse_spec("16,16,2048")
    with pytest.raises(ValueError, match="neither 'causal' nor kvN"):
        Workload.parse_spec("16,16,2048,64,casual")
