"""Hugging Face Transformers: run tuned kernels as ``attn_implementation="evoengine"``.

    import evoengine, evoengine.hf
    attention = evoengine.load("runs/evoengine.db")
    evoengine.hf.register(attention)            # or attention.register_transformers()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="evoengine")

Calls the kernels cannot serve exactly (a padding or custom mask, dropout, sliding window,
soft-capping, sinks) raise, or go to Transformers' own SDPA with ``fallback="sdpa"``. The
code lives in the launcher so that exported modules carry it too.
"""

from __future__ import annotations

from evoengine.launch import register_hf as register
from evoengine.launch import transformers_attention

__all__ = ["register", "transformers_attention"]
