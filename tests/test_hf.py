"""Tests of the Transformers integration without a GPU.

The adapter is driven with a plain torch attention function (the launcher's SDPA with the
kernels' semantics), so its handling of causality, caches, GQA, layouts and masks is
checked on the CPU; tests/gpu/test_export.py runs the tuned kernels in a model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from evoengine import hf
from evoengine.launch import sdpa_attention


class Recorder:
    """An attention function that records how it was called."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: float | None) -> torch.Tensor:
        self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal,
                           "scale": scale})
        return sdpa_attention(q, k, v, causal=causal, scale=scale)


class Attn(torch.nn.Module):
    is_causal = True


def qkv(sq: int, sk: int, heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, heads, sq, 16), torch.randn(2, kv_heads, sk, 16),
            torch.randn(2, kv_heads, sk, 16))


def test_prefill_is_causal_and_the_output_is_bshd() -> None:
    rec = Recorder()
    q, k, v = qkv(5, 5)
    out, weights = hf.transformers_attention(rec)(Attn(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 5, 4, 16)
    assert rec.calls == [{"q": (2, 4, 5, 16), "k": (2, 2, 5, 16), "causal": True, "scale": 0.3}]
    torch.testing.assert_close(out, sdpa_attention(q, k, v, causal=True, scale=0.3)
                               .transpose(1, 2), rtol=0, atol=0)


def test_one_query_sees_every_key() -> None:
    rec = Recorder()
    hf.transformers_attention(rec)(Attn(), *qkv(1, 9), None)
    assert rec.calls[0]["causal"] is False and rec.calls[0]["k"] == (2, 2, 9, 16)


def test_prefill_into_an_empty_static_cache_drops_the_unused_keys() -> None:
    rec = Recorder()
    hf.transformers_attention(rec)(Attn(), *qkv(5, 12), None)
    assert rec.calls[0]["causal"] is True and rec.calls[0]["k"] == (2, 2, 5, 16)


def test_is_causal_argument_and_module_flag() -> None:
    rec = Recorder()
    encoder = Attn()
    encoder.is_causal = False
    hf.transformers_attention(rec)(encoder, *qkv(5, 5), None)
    hf.transformers_attention(rec)(Attn(), *qkv(5, 5), None, is_causal=False)
    assert [c["causal"] for c in rec.calls] == [False, False]


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"attention_mask": torch.ones(2, 1, 5, 5, dtype=torch.bool)}, "an attention mask"),
    ({"dropout": 0.1}, "dropout 0.1"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"softcap": 30.0}, "softcap"),
    ({"s_aux": torch.zeros(4)}, "s_aux"),
])
def test_what_the_kernels_cannot_do_is_refused(kwargs: dict, named: str) -> None:
    rec = Recorder()
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(ValueError, match=f"cannot serve {named}.*fallback='sdpa'"):
        hf.transformers_attention(rec)(Attn(), *qkv(5, 5), mask, **kwargs)
    assert rec.calls == []


@pytest.mark.parametrize(("sq", "sk"), [(5, 5), (1, 9), (3, 8)])
def test_a_sliding_window_over_every_key_is_plain_causal_attention(sq: int, sk: int) -> None:
    """Mistral-style models pass their window on every call: within it (keys <= window)
    nothing is cut, so the call is served as it is; one key past it, it is refused."""
    rec = Recorder()
    q, k, v = qkv(sq, sk)
    out, _ = hf.transformers_attention(rec)(Attn(), q, k, v, None, sliding_window=sk)
    plain, _ = hf.transformers_attention(Recorder())(Attn(), q, k, v, None)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert len(rec.calls) == 1
    with pytest.raises(ValueError, match="cannot serve sliding_window"):
        hf.transformers_attention(rec)(Attn(), q, k, v, None, sliding_window=sk - 1)


@pytest.mark.parametrize("window", [True, 4.0, (8, 8), 0])
def test_a_window_that_is_no_key_count_is_refused(window: object) -> None:
    with pytest.raises(ValueError, match="cannot serve sliding_window"):
        hf.transformers_attention(Recorder())(Attn(), *qkv(3, 3), None, sliding_window=window)


def test_a_bidirectional_window_is_refused() -> None:
    """Only a causal window's reach is known here (an encoder's may look both ways)."""
    encoder = Attn()
    encoder.is_causal = False
    with pytest.raises(ValueError, match="cannot serve sliding_window"):
        hf.transformers_attention(Recorder())(encoder, *qkv(5, 5), None, sliding_window=64)


def test_unknown_fallback_is_refused() -> None:
    with pytest.raises(ValueError, match="fallback must be None or 'sdpa'"):
        hf.transformers_attention(Recorder(), fallback="eager")


def tiny_llama(attn_implementation: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, Recorder]:
    pytest.importorskip("transformers")
    rec = Recorder()
    assert hf.register(rec, name="evoengine_cpu_test") == "evoengine_cpu_test"
    torch.manual_seed(0)
    ref = tiny_llama("sdpa").eval()
    ours = tiny_llama("evoengine_cpu_test").eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours, rec


@torch.no_grad()
def test_a_llama_runs_through_the_registered_function(models: tuple) -> None:
    ref, ours, rec = models
    rec.calls.clear()
    ids = torch.randint(0, 128, (2, 37))
    a, b = ref(ids, use_cache=True), ours(ids, use_cache=True)
    torch.testing.assert_close(b.logits, a.logits)
    assert [c["causal"] for c in rec.calls] == [True, True]  # two layers, prefill
    assert rec.calls[0]["q"] == (2, 4, 37, 64) and rec.calls[0]["k"] == (2, 2, 37, 64)
    token = torch.randint(0, 128, (2, 1))
    a2 = ref(token, past_key_values=a.past_key_values)
    b2 = ours(token, past_key_values=b.past_key_values)
    torch.testing.assert_close(b2.logits, a2.logits)
    assert rec.calls[-1] == {"q": (2, 4, 1, 64), "k": (2, 2, 38, 64), "causal": False,
                             "scale": 0.125}


@torch.no_grad()
def test_padding_is_refused_or_served_by_sdpa(models: tuple) -> None:
    ref, ours, _ = models
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :6] = 0  # left padding: Transformers builds a real mask for it
    with pytest.raises(ValueError, match="cannot serve an attention mask"):
        ours(ids, attention_mask=mask)
    hf.register(Recorder(), name="evoengine_cpu_test", fallback="sdpa")
    try:
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits,
                                   ref(ids, attention_mask=mask).logits)
    finally:
        hf.register(models[2], name="evoengine_cpu_test")


# ---- padding masks: unpadded into ragged batches -------------------------------------------


def causal_padding_mask(valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """The 4-D bool mask Transformers' sdpa_mask builds: causal on positions, padding keys out."""
    kv_len = valid.shape[1]
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    cols = torch.arange(kv_len)[None, :]
    return ((cols <= rows)[None] & valid[:, None, :])[:, None]


def test_padding_masks_are_read_as_ragged_batches() -> None:
    from evoengine.launch.transformers import padding_of

    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[1, 7:] = False  # right padding
    for mask in (valid.long(), causal_padding_mask(valid, 10)):
        p = padding_of(mask, 3, 10, 10, True)
        assert p is not None and p.causal
        assert p.valid_q.equal(valid) and p.valid_k.equal(valid)
    additive = torch.zeros(3, 1, 10, 10).masked_fill(~causal_padding_mask(valid, 10), -1e9)
    p = padding_of(additive, 3, 10, 10, True)
    assert p is not None and p.causal and p.valid_q.equal(valid) and p.valid_k.equal(valid)
    full = padding_of(valid.long(), 3, 10, 10, False)
    assert full is not None and not full.causal
    # Decoding two tokens over left-padded keys: bottom-right per sequence.
    left = torch.ones(2, 9, dtype=torch.bool)
    left[1, :3] = False
    p = padding_of(causal_padding_mask(left, 2), 2, 2, 9, True)
    assert p is not None and p.causal and p.valid_q.all() and p.valid_k.equal(left)


def test_masks_that_are_not_padding_alone_are_not_unpadded() -> None:
    from evoengine.launch.transformers import padding_of

    valid = torch.ones(2, 8, dtype=torch.bool)
    window = causal_padding_mask(valid, 8) & (torch.arange(8)[None, :] > torch.arange(8)[:, None]
                                              - 3)[None, None]
    assert padding_of(window, 2, 8, 8, True) is None  # a sliding window
    assert padding_of(torch.ones(2, 2, 8, 8, dtype=torch.bool), 2, 8, 8, False) is None  # per head
    assert padding_of(valid.long(), 3, 8, 8, True) is None  # another batch
    right = valid.clone()
    right[0, 5:] = False  # decoding after right padding: queries past the real keys
    assert padding_of(causal_padding_mask(right, 2), 2, 2, 8, True) is None


class RaggedRecorder(Recorder):
    """A ``TunedAttention`` stand-in with varlen kernels: SDPA per sequence on the CPU."""

    varlen_table = {("fp32", 64, True): ()}

    def __init__(self) -> None:
        super().__init__()
        self.varlen_calls: list[dict[str, Any]] = []

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool = False,
               scale: float | None = None, *, fallback: str | None = None,
               check: bool = True) -> torch.Tensor:
        from evoengine.launch.varlen import check_cu_values, varlen_sdpa

        check_cu_values("cu_seqlens_q", cu_q.tolist(), q.shape[0], max_q)
        check_cu_values("cu_seqlens_k", cu_k.tolist(), k.shape[0], max_k)
        self.varlen_calls.append({"q": tuple(q.shape), "cu_q": cu_q.tolist(), "causal": causal})
        return varlen_sdpa(q, k, v, cu_q, cu_k, causal=causal, scale=scale)


@torch.no_grad()
def test_padding_is_unpadded_into_the_varlen_kernels(models: tuple) -> None:
    ref, ours, rec = models
    ragged = RaggedRecorder()
    hf.register(ragged, name="evoengine_cpu_test")
    try:
        ids = torch.randint(0, 128, (3, 20))
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[0, :6] = 0  # left padding
        mask[1, 15:] = 0  # right padding
        real = mask.bool()
        got, want = ours(ids, attention_mask=mask), ref(ids, attention_mask=mask)
        torch.testing.assert_close(got.logits[real], want.logits[real])
        assert ragged.varlen_calls[0] == {"q": (14 + 15 + 20, 4, 64),
                                          "cu_q": [0, 14, 29, 49], "causal": True}
        assert ragged.calls == []  # every layer went through the ragged path
    finally:
        hf.register(rec, name="evoengine_cpu_test")


@torch.no_grad()
def test_a_mistral_within_its_window_runs_through_the_registered_function() -> None:
    """A model that passes sliding_window on every call (Mistral): prompts up to the window
    are served and match SDPA; a longer one is refused in one line (SDPA's with fallback)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, MistralConfig

    rec = Recorder()
    name = hf.register(rec, name="evoengine_cpu_test_window")

    def mistral(attn_implementation: str) -> torch.nn.Module:  # a config each: models read it
        config = MistralConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                               sliding_window=40)
        return AutoModelForCausalLM.from_config(config,
                                                attn_implementation=attn_implementation).eval()

    torch.manual_seed(0)
    ref, ours = mistral("sdpa"), mistral(name)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (2, 37))
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits)
    assert [c["causal"] for c in rec.calls] == [True, True]  # two layers, ours only
    with pytest.raises(ValueError, match="cannot serve sliding_window"):
        ours(torch.randint(0, 128, (2, 41)))
