"""Hugging Face Transformers: an ``AttentionInterface`` function around a tuned attention,
and its registration under ``attn_implementation="evoengine"``. A padded batch's mask is
served by unpadding it into a ragged batch for the varlen kernels (``padding_of``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from evoengine.launch.core import check_fallback

# Keyword arguments of Transformers' attention calls that change the result: a kernel that
# ignored them would be silently wrong.
_HF_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


class Padding(NamedTuple):
    """A padded batch read off its mask: which query and key positions are real, and whether
    each sequence's real queries see its real keys causally (bottom-right) or all of them."""

    valid_q: Tensor  # bool [B, Q]
    valid_k: Tensor  # bool [B, K]
    causal: bool


def padding_of(mask: Tensor, batch: int, q_len: int, kv_len: int,
               causal: bool) -> Padding | None:
    """The padding a Transformers mask describes, or None where it is not padding alone.

    Takes a 2-D [B, K] 0/1 mask (1: a real token; ``causal`` then adds the causal cut, as
    Transformers would), or the 4-D [B, 1, Q, K] mask Transformers builds (bool, True where
    a query may see a key, or additive float, 0 there). Keys are real where some query sees
    them; with Q == K queries are the same positions as keys (a padding row's output is
    then 0, not attention over the real keys as SDPA would give: such rows are padding), with
    Q < K those that see some key. The mask is padding alone when, on every real query row,
    it equals what a ragged batch of the real rows computes: every real key, or (causal) the
    real keys up to the row's diagonal, aligned bottom-right per sequence. One sync.
    """
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_len):
            return None
        allowed = mask.bool()[:, None, :].expand(batch, q_len, kv_len)
        if causal:
            rows = torch.arange(q_len, device=mask.device)[:, None]
            cols = torch.arange(kv_len, device=mask.device)[None, :]
            allowed = allowed & (cols <= rows + (kv_len - q_len))
    elif mask.dim() == 4 and tuple(mask.shape) == (batch, 1, q_len, kv_len):
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    else:
        return None
    valid_k = allowed.any(dim=1)
    valid_q = allowed.any(dim=2)
    if q_len == kv_len:
        valid_q = valid_q & valid_k
    rank_q = valid_q.cumsum(1) - 1
    rank_k = valid_k.cumsum(1) - 1
    offset = (valid_k.sum(1) - valid_q.sum(1))[:, None, None]
    seen = valid_k[:, None, :].expand(batch, q_len, kv_len)
    cut = rank_k[:, None, :] <= rank_q[:, :, None] + offset
    real = valid_q[:, :, None]
    causal_ok = ((allowed == (seen & cut)) | ~real).all()
    full_ok = ((allowed == seen) | ~real).all()
    causal_ok, full_ok = torch.stack([causal_ok, full_ok]).tolist()  # the one sync
    if causal_ok and (causal or not full_ok):
        return Padding(valid_q, valid_k, True)
    if full_ok:
        return Padding(valid_q, valid_k, False)
    return None


def unpadded_attention(varlen_fn: Callable[..., Tensor], query: Tensor, key: Tensor,
                       value: Tensor, padding: Padding, scale: float | None) -> Tensor:
    """``varlen_fn`` (``attention_varlen``'s call) on the real rows of a padded batch,
    [B, H, S, D] in, [B, S, H, D] out, padding rows 0."""
    valid_q, valid_k = padding.valid_q, padding.valid_k
    q = query.transpose(1, 2)[valid_q]  # [total_q, H, D]: a gather, packed
    k = key.transpose(1, 2)[valid_k]
    v = value.transpose(1, 2)[valid_k]
    lengths_q, lengths_k = valid_q.sum(1), valid_k.sum(1)
    cu_q = torch.nn.functional.pad(lengths_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lengths_k.cumsum(0), (1, 0)).to(torch.int32)
    max_q, max_k = torch.stack([lengths_q.max(), lengths_k.max()]).tolist()
    b, h, s, d = query.shape
    out = query.new_zeros((b, s, h, d))
    if q.shape[0]:
        out[valid_q] = varlen_fn(q, k, v, cu_q, cu_k, int(max_q), int(max_k),
                                 causal=padding.causal, scale=scale, check=False)
    return out


def window_covers(window: object, kv_len: int) -> bool:
    """Whether a causal sliding window of ``window`` keys cuts nothing from a call with
    ``kv_len`` keys: Transformers' window keeps key j for the query at position i where
    j > i - window, and a causal call's last query sits at position kv_len - 1 (bottom-right),
    so every key is kept when kv_len <= window (Transformers' own SDPA path skips the mask
    then too). Mistral-style models pass their window on every call; those within it are
    plain causal attention."""
    return (isinstance(window, int) and not isinstance(window, bool)
            and 0 < kv_len <= window)


def transformers_attention(attention_fn: Callable[..., Tensor], *,
                           fallback: str | None = None,
                           varlen_fn: Callable[..., Tensor] | None = None,
                           ) -> Callable[..., tuple[Tensor, None]]:
    """A Transformers attention function (``AttentionInterface``) around
    ``attention_fn(q, k, v, causal=, scale=) -> [B, H, S, D]``.

    Mirrors Transformers' SDPA integration: causal comes from ``is_causal`` or
    ``module.is_causal``, holds only with more than one query and no mask, and a causal
    call with more keys than queries is a prefill into an empty static cache (aligned
    top-left), so the keys past the queries are dropped. A padding mask (``padding_of``) is
    served by unpadding the batch into ``varlen_fn`` (``attention_varlen``'s call) and
    padding the result back, where one is given. A causal sliding window that covers every
    key of the call is no window (``window_covers``). Other masks, dropout, sliding windows,
    soft-capping and sinks are refused, or handed to Transformers' SDPA with
    ``fallback='sdpa'``.
    """
    check_fallback(fallback)

    def evoengine_attention(module: torch.nn.Module, query: Tensor, key: Tensor,
                            value: Tensor, attention_mask: Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None,
                            **kwargs: Any) -> tuple[Tensor, None]:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]
        unsupported = [name for name in _HF_UNSUPPORTED if kwargs.get(name) is not None
                       and not (name == "sliding_window" and causal
                                and window_covers(kwargs[name], kv_len))]
        padding = None
        if attention_mask is not None:
            if varlen_fn is not None:
                padding = padding_of(attention_mask, query.shape[0], q_len, kv_len,
                                     q_len > 1 and bool(causal))
            if padding is None:
                unsupported.append("an attention mask other than padding" if varlen_fn
                                   else "an attention mask (padding or a custom pattern)")
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
        if padding is not None:
            assert varlen_fn is not None
            return unpadded_attention(varlen_fn, query, key, value, padding, scaling), None
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
    A ``TunedAttention`` with varlen kernels serves padding masks through them.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    varlen_fn = None
    if getattr(attention_fn, "varlen_table", None):  # padding masks: unpad, ragged kernels
        varlen_fn = functools.partial(attention_fn.varlen, fallback=fallback)  # type: ignore[attr-defined]
    if getattr(attention_fn, "supports_bshd", False):  # write straight into [B, S, H, D]
        attention_fn = functools.partial(attention_fn, bshd=True, fallback=fallback)
    AttentionInterface.register(name, transformers_attention(attention_fn, fallback=fallback,
                                                             varlen_fn=varlen_fn))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
