"""Hugging Face Transformers: an ``AttentionInterface`` function around a tuned attention,
and its registration under ``attn_implementation="evoengine"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from evoengine.launch.core import FALLBACKS

# Keyword arguments of Transformers' attention calls that change the result: a kernel that
# ignored them would be silently wrong.
_HF_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def transformers_attention(attention_fn: Callable[..., Tensor], *,
                           fallback: str | None = None) -> Callable[..., tuple[Tensor, None]]:
    """A Transformers attention function (``AttentionInterface``) around
    ``attention_fn(q, k, v, causal=, scale=) -> [B, H, S, D]``.

    Mirrors Transformers' SDPA integration: causal comes from ``is_causal`` or
    ``module.is_causal``, holds only with more than one query and no mask, and a causal
    call with more keys than queries is a prefill into an empty static cache (aligned
    top-left), so the keys past the queries are dropped. Masks, dropout, sliding windows,
    soft-capping and sinks are refused, or handed to Transformers' SDPA with
    ``fallback='sdpa'``.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be None or 'sdpa', got {fallback!r}")

    def evoengine_attention(module: torch.nn.Module, query: Tensor, key: Tensor,
                            value: Tensor, attention_mask: Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None,
                            **kwargs: Any) -> tuple[Tensor, None]:
        unsupported = [name for name in _HF_UNSUPPORTED if kwargs.get(name) is not None]
        if attention_mask is not None:
            unsupported.append("an attention mask (padding or a custom pattern)")
        if dropout:
            unsupported.append(f"dropout {dropout}")
        if unsupported:
            if fallback == "sdpa":
                from transformers.integrations.sdpa_attention import sdpa_attention_forward

                return sdpa_attention_forward(module, query, key, value, attention_mask,
                                              dropout=dropout, scaling=scaling,
                                              is_causal=is_causal, **kwargs)
            raise ValueError(f"evoengine attention cannot serve {', '.join(unsupported)}; "
                             "register it with fallback='sdpa' to let SDPA serve such calls")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = q_len > 1 and bool(causal)
        if causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = attention_fn(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2), None

    return evoengine_attention


def register_hf(attention_fn: Callable[..., Tensor], name: str = "evoengine", *,
                fallback: str | None = None) -> str:
    """Register ``attention_fn`` as ``attn_implementation=name`` in Transformers.

    The mask function registered beside it is SDPA's, which builds no mask where causality
    alone describes the call and a real one where there is padding: without it Transformers
    would build no mask at all for an unknown implementation, and padding would be ignored.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(attention_fn, "supports_bshd", False):  # write straight into [B, S, H, D]
        attention_fn = functools.partial(attention_fn, bshd=True, fallback=fallback)
    AttentionInterface.register(name, transformers_attention(attention_fn, fallback=fallback))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
