"""A model's attention geometry, read from its Transformers ``config.json``, and the calls a
user of that model makes: what ``evoengine tune`` searches kernels for.

The geometry is what every attention call of the model shares (query heads, key/value
heads, head dim, dtype, causal) plus the longest sequence it sees. The calls are prefills
on a log ladder of lengths, each batched to about ``TOKENS_PER_CALL`` tokens:

- lengths ``256, 512, 1K, 2K, 4K, ...`` (from ``LADDER_START`` or ``--min-seq``) up to
  the model's maximum (``max_position_embeddings``, capped at ``DEFAULT_MAX_SEQ`` or
  ``--max-seq``), and the maximum itself where it is off the ladder: an exported module's
  nearest-length dispatch then serves any call between two rungs with a kernel tuned
  within a factor sqrt(2) of its length;
- batch ``max(1, TOKENS_PER_CALL // length)``: a call carries about 16K tokens, the size of
  a serving engine's prefill chunk or a training micro-batch, so short sequences come
  batched (256: batch 64) and long ones alone (16K: batch 1). The time per call is then
  roughly proportional to the length, as it is in the model;
- the forward's **latency calls**: one sequence at each ladder length up to
  ``LATENCY_MAX_SEQ`` (``--latency-seq``; 0: none) whose ladder call is batched. Such a call
  has too few query rows to fill a GPU of ~100 SMs a few times over, so the tile that wins
  at 16K tokens (192 rows, long causal rows per block) can leave SMs idle there; the
  exported dispatch sends a call at those lengths to the entry tuned nearest its
  batch x heads (``launch.dispatch.nearest``), so calls of a few sequences get these
  entries, larger ones the ladder's.

Contract: ``from_config`` and ``ModelGeometry`` raise a one-line ``ValueError`` naming the
field or flag for bad input; nothing here touches a GPU or the network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evoengine.workload import DTYPES

LADDER_START = 256
TOKENS_PER_CALL = 16384
DEFAULT_MAX_SEQ = 16384
LATENCY_MAX_SEQ = 1024

# torch_dtype / dtype values of configs -> the dtype a kernel is tuned in.
_DTYPES = {"float16": "fp16", "half": "fp16", "fp16": "fp16",
           "bfloat16": "bf16", "bf16": "bf16"}
_WIDE = {"float32", "float", "fp32", "float64", "double"}
# Architecture suffixes of decoder-only (causal) and encoder (bidirectional) models.
_DECODER = ("ForCausalLM", "LMHeadModel")
_ENCODER = ("ForMaskedLM", "ForTokenClassification", "ForQuestionAnswering",
            "ForMultipleChoice", "ForImageClassification")
# Model types whose configs may name a sliding window without layer_types, though only some
# layers use it (Transformers derives the pattern in the config class).
_HYBRID_TYPES = {"gemma2", "gemma3", "gemma3_text", "cohere2", "gpt_oss", "llama4",
                 "llama4_text"}
_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert",
                  "albert", "electra", "camembert", "mpnet", "modernbert", "vit", "dinov2",
                  "clip_vision_model", "siglip_vision_model", "esm"}


@dataclass(frozen=True)
class ModelGeometry:
    """What a model's attention calls share; ``notes`` say how each was decided."""

    heads: int
    head_dim: int
    kv_heads: int | None = None  # None: heads (multi-head attention)
    dtype: str = "bf16"
    causal: bool = True
    max_seq: int = DEFAULT_MAX_SEQ
    min_seq: int = LADDER_START  # the ladder's first rung (--min-seq)
    latency_max_seq: int = LATENCY_MAX_SEQ  # latency calls up to this length (0: none)
    name: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        for what, value in (("query heads", self.heads), ("key/value heads", self.kv_heads),
                            ("head dim", self.head_dim), ("max seq", self.max_seq),
                            ("min seq", self.min_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{what} must be a positive integer, got {value!r}")
        if (isinstance(self.latency_max_seq, bool) or not isinstance(self.latency_max_seq, int)
                or self.latency_max_seq < 0):
            raise ValueError("latency seq must be a non-negative integer (0: no latency "
                             f"calls), got {self.latency_max_seq!r}")
        if self.heads % self.kv_heads:  # type: ignore[operator]
            raise ValueError(f"query heads ({self.heads}) must be a multiple of key/value "
                             f"heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def describe(self) -> str:
        gqa = f"{self.heads} query heads, {self.kv_heads} key/value heads"
        return (f"{gqa}, head dim {self.head_dim}, {self.dtype}, "
                f"{'causal' if self.causal else 'non-causal'}, up to {self.max_seq} tokens")

    def prefill_lengths(self) -> list[int]:
        """The ladder of sequence lengths (module docstring)."""
        lengths = []
        n = self.min_seq
        while n <= self.max_seq:
            lengths.append(n)
            n *= 2
        if not lengths or lengths[-1] != self.max_seq:
            lengths.append(self.max_seq)
        return lengths

    @staticmethod
    def batch_for(seq: int) -> int:
        """The batch of a call of length ``seq``: about ``TOKENS_PER_CALL`` tokens."""
        return max(1, TOKENS_PER_CALL // seq)

    def prefill_calls(self) -> list[dict[str, Any]]:
        """One call per ladder length, as the fields of a forward-shaped workload (its
        ``to_dict()`` without the kind): batch, heads, kv_heads, lengths, head dim..."""
        return [{"batch": self.batch_for(s), "heads": self.heads, "kv_heads": self.kv_heads,
                 "seq_q": s, "seq_k": s, "head_dim": self.head_dim, "causal": self.causal,
                 "dtype": self.dtype} for s in self.prefill_lengths()]

    def latency_calls(self) -> list[dict[str, Any]]:
        """One sequence at each ladder length up to ``latency_max_seq`` whose ladder call is
        batched (module docstring), as ``prefill_calls`` gives calls."""
        return [{**call, "batch": 1} for call in self.prefill_calls()
                if call["batch"] > 1 and call["seq_q"] <= self.latency_max_seq]

    def is_latency_call(self, batch: int, seq: int) -> bool:
        """Whether a call of ``batch`` sequences of ``seq`` tokens is one of
        ``latency_calls`` (not the ladder's call at that length)."""
        return batch == 1 and self.batch_for(seq) > 1 and seq <= self.latency_max_seq


def default_name(path: str | Path) -> str:
    """A tune's default name for a config file: its stem, or its folder's name where the
    file is the usual ``config.json`` (``Llama-3-8B/config.json`` -> ``Llama-3-8B``), or the
    folder's name where given a folder."""
    p = Path(path)
    if p.is_dir():
        return p.resolve().name
    if p.stem == "config" and p.resolve().parent.name:
        return p.resolve().parent.name
    return p.stem


def from_config(path: str | Path, *, max_seq: int | None = None, min_seq: int | None = None,
                latency_max_seq: int | None = None, dtype: str | None = None,
                causal: bool | None = None, heads: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None) -> ModelGeometry:
    """The geometry of the Transformers config at ``path``; the keywords, where given,
    override what the file says (the CLI's flags)."""
    p = Path(path)
    if p.is_dir():  # a model's folder, as Transformers takes it
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} is a folder without a config.json: pass the model's "
                             "config.json")
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config file {p}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not a JSON config: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} is not a Transformers config (a JSON object)")
    return geometry_of(data, where=str(p), max_seq=max_seq, dtype=dtype, causal=causal,
                       heads=heads, kv_heads=kv_heads, head_dim=head_dim, min_seq=min_seq,
                       latency_max_seq=latency_max_seq, name=default_name(p))


def geometry_of(config: Mapping[str, Any], *, where: str = "the config",
                max_seq: int | None = None, min_seq: int | None = None,
                latency_max_seq: int | None = None,
                dtype: str | None = None, causal: bool | None = None,
                heads: int | None = None, kv_heads: int | None = None,
                head_dim: int | None = None, name: str = "") -> ModelGeometry:
    """The geometry of a config's fields (``from_config`` reads them from a file)."""
    notes: list[str] = []
    cfg: Mapping[str, Any] = config
    if _first(cfg, "num_attention_heads", "n_head", "num_heads") is None and isinstance(
            config.get("text_config"), Mapping):
        cfg = {**config, **config["text_config"]}  # multimodal: the language model's
        notes.append("geometry of text_config (the language model)")
    if heads is None:
        heads = _int(cfg, where, "num_attention_heads", "n_head", "num_heads")
        if heads is None:
            raise ValueError(f"{where} has no num_attention_heads (pass --q-heads)")
    if kv_heads is None:
        kv_heads = _int(cfg, where, "num_key_value_heads", "num_kv_heads", "n_head_kv")
        if kv_heads is None and cfg.get("multi_query") is True:
            kv_heads = 1
    if head_dim is None:
        head_dim = _int(cfg, where, "head_dim")
        if head_dim is None:
            hidden = _int(cfg, where, "hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise ValueError(f"{where} has neither head_dim nor hidden_size (pass "
                                 "--head-dim)")
            if hidden % heads:
                raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of "
                                 f"num_attention_heads {heads} (pass --head-dim)")
            head_dim = hidden // heads
            notes.append(f"head dim {head_dim} = hidden_size {hidden} / {heads} heads")
    if dtype is None:
        dtype = _dtype(cfg, notes)
    if causal is None:
        causal = _causal(cfg, notes)
    longest = _int(cfg, where, "max_position_embeddings", "n_positions", "max_sequence_length",
                   "seq_length")
    cap = DEFAULT_MAX_SEQ if max_seq is None else max_seq
    if longest is None:
        longest = cap
        notes.append(f"no max_position_embeddings: up to {cap} tokens (--max-seq)")
    elif longest > cap:
        notes.append(f"max_position_embeddings {longest} capped at {cap} (--max-seq)")
        longest = cap
    window = _window(cfg, notes)
    if window is not None and window < longest and max_seq is None:
        notes.append(f"the ladder stops at the window, {window} tokens (--max-seq to go on)")
        longest = window
    _softcap(cfg, notes)
    return ModelGeometry(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         causal=causal, max_seq=longest,
                         min_seq=LADDER_START if min_seq is None else min_seq,
                         latency_max_seq=(LATENCY_MAX_SEQ if latency_max_seq is None
                                          else latency_max_seq),
                         name=name, notes=tuple(notes))


def _window(cfg: Mapping[str, Any], notes: list[str]) -> int | None:
    """The sliding window where every attention layer has one (Mistral), else None; a note
    either way it matters. The exported module serves a windowed call whose keys fit the
    window (nothing is cut: plain causal attention) and refuses a longer one, or hands it to
    SDPA with ``fallback='sdpa'`` (``launch.transformers.window_covers``)."""
    window = cfg.get("sliding_window")
    if (cfg.get("use_sliding_window") is False or isinstance(window, bool)
            or not isinstance(window, int) or window <= 0):
        return None
    types = cfg.get("layer_types")
    windowed = (sum(t == "sliding_attention" for t in types) if isinstance(types, list)
                else None)
    if windowed == 0:
        return None
    refused = (f"calls past {window} keys are refused (fallback='sdpa': SDPA serves them), "
               "shorter ones are plain causal attention")
    if windowed is not None and windowed < len(types):
        notes.append(f"sliding_window {window} on {windowed} of {len(types)} layers: their "
                     f"{refused}; the other layers' calls are served at every length")
        return None
    if windowed is None and (cfg.get("model_type") in _HYBRID_TYPES or any(
            k in cfg for k in ("sliding_window_pattern", "_sliding_window_pattern"))):
        notes.append(f"sliding_window {window} on some layers (model_type "
                     f"{cfg.get('model_type')!r} mixes windowed and full layers): their "
                     f"{refused}; the full layers' calls are served at every length")
        return None
    notes.append(f"sliding_window {window} on every layer: {refused}")
    return window


def _softcap(cfg: Mapping[str, Any], notes: list[str]) -> None:
    """A note where the model soft-caps its attention logits, which no kernel here does."""
    cap = cfg.get("attn_logit_softcapping")
    if cap is not None:
        notes.append(f"attn_logit_softcapping {cap}: the kernels do not soft-cap, so the "
                     "exported module refuses this model's calls (fallback='sdpa': SDPA "
                     "serves them)")


def _first(cfg: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


def _int(cfg: Mapping[str, Any], where: str, *names: str) -> int | None:
    value = _first(cfg, *names)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        name = next(n for n in names if cfg.get(n) is not None)
        raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def _dtype(cfg: Mapping[str, Any], notes: list[str]) -> str:
    """fp16 or bf16 from ``torch_dtype`` (or ``dtype``); a wider or missing dtype runs in
    bf16, the dtype such models are usually served and trained in (fp16 overflows where
    their activations grew in fp32)."""
    raw = _first(cfg, "torch_dtype", "dtype")
    text = str(raw).removeprefix("torch.").lower() if raw is not None else None
    if text in _DTYPES:
        return _DTYPES[text]
    if text in _WIDE:
        notes.append(f"torch_dtype {raw} -> bf16 (kernels run in fp16 or bf16; --dtype fp16 "
                     "for the other)")
    else:
        notes.append(f"{'no torch_dtype' if raw is None else f'torch_dtype {raw!r}'} -> bf16 "
                     "(--dtype to choose)")
    return "bf16"


def _causal(cfg: Mapping[str, Any], notes: list[str]) -> bool:
    """Causal for decoders: an architecture named ``...ForCausalLM``/``...LMHeadModel`` or
    ``is_decoder``; non-causal for encoders (``...ForMaskedLM`` and the like, or a known
    encoder ``model_type``); a config that says neither is taken for a decoder, the models
    people tune attention for today, with a note."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    if cfg.get("is_decoder") is True or any(a.endswith(_DECODER) for a in archs):
        why = next((a for a in archs if a.endswith(_DECODER)), "is_decoder")
        notes.append(f"causal: a decoder ({why})")
        return True
    model_type = str(cfg.get("model_type", ""))
    if any(a.endswith(_ENCODER) for a in archs) or model_type in _ENCODER_TYPES:
        why = next((a for a in archs if a.endswith(_ENCODER)), f"model_type {model_type}")
        notes.append(f"non-causal: an encoder ({why})")
        return False
    notes.append("causal assumed: the config names no decoder or encoder architecture "
                 "(--no-causal for bidirectional attention)")
    return True
