"""Tests of evoengine.geometry: a model's attention geometry from the configs these tests
write (nothing downloaded), and the prefill ladder of calls it makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evoengine.geometry import (
    DEFAULT_MAX_SEQ,
    TOKENS_PER_CALL,
    ModelGeometry,
    default_name,
    from_config,
    geometry_of,
)

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8,
         "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def write(folder: Path, config: dict, name: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(config))
    return path


def test_a_decoder_config_gives_its_geometry(tmp_path: Path) -> None:
    g = from_config(write(tmp_path / "Llama-3-8B", LLAMA))
    assert (g.heads, g.kv_heads, g.head_dim, g.dtype, g.causal) == (32, 8, 128, "bf16", True)
    assert g.max_seq == DEFAULT_MAX_SEQ  # 131072 capped
    assert g.name == "Llama-3-8B"
    assert any("capped" in n for n in g.notes) and any("LlamaForCausalLM" in n for n in g.notes)


@pytest.mark.parametrize(("name", "geometry"), [
    ("llama3-8b", (32, 8, 128, "bf16", True, 8192)),
    ("qwen2.5-7b", (28, 4, 128, "bf16", True, DEFAULT_MAX_SEQ)),  # its window is off
    ("llama3.2-1b", (32, 8, 64, "bf16", True, DEFAULT_MAX_SEQ)),
])
def test_the_benchmark_configs_give_the_geometry_their_checks_report(name: str,
                                                                     geometry: tuple) -> None:
    g = from_config(Path(__file__).parents[1] / "benchmarks" / "configs" / f"{name}.json")
    assert (g.heads, g.kv_heads, g.head_dim, g.dtype, g.causal, g.max_seq) == geometry
    assert g.name == name and not any("sliding" in n for n in g.notes)


def test_flags_override_the_config_and_cap_the_length(tmp_path: Path) -> None:
    g = from_config(write(tmp_path, LLAMA), max_seq=4096, dtype="fp16", causal=False,
                    kv_heads=4)
    assert (g.kv_heads, g.dtype, g.causal, g.max_seq) == (4, "fp16", False, 4096)


def test_head_dim_is_read_before_it_is_derived() -> None:
    g = geometry_of({**LLAMA, "head_dim": 256, "hidden_size": 3072, "num_attention_heads": 8})
    assert g.head_dim == 256


def test_a_window_on_every_layer_ends_the_ladder_there_and_says_what_is_served() -> None:
    mistral = {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
               "sliding_window": 4096, "max_position_embeddings": 32768}
    g = geometry_of(mistral)
    assert g.max_seq == 4096 and g.prefill_lengths()[-1] == 4096
    assert any("sliding_window 4096 on every layer" in n and "refused" in n for n in g.notes)
    assert geometry_of(mistral, max_seq=8192).max_seq == 8192  # the flag wins
    # Listed layer types say how many layers have it.
    all_sliding = geometry_of({**mistral, "layer_types": ["sliding_attention"] * 4})
    assert all_sliding.max_seq == 4096


@pytest.mark.parametrize("extra", [
    {"layer_types": ["sliding_attention", "full_attention"]},
    {"model_type": "gemma2"},  # older configs: the pattern lives in the config class
    {"sliding_window_pattern": 6},
])
def test_a_window_on_some_layers_keeps_the_ladder_with_a_note(extra: dict) -> None:
    g = geometry_of({**LLAMA, "sliding_window": 4096, **extra})
    assert g.max_seq == DEFAULT_MAX_SEQ
    assert any("sliding_window 4096 on" in n and "every length" in n for n in g.notes)


@pytest.mark.parametrize("extra", [
    {"sliding_window": None}, {"sliding_window": 32768, "use_sliding_window": False},
    {"sliding_window": 4096, "layer_types": ["full_attention"] * 4},
])
def test_a_window_that_no_layer_uses_changes_nothing(extra: dict) -> None:
    g = geometry_of({**LLAMA, **extra})
    assert g.max_seq == DEFAULT_MAX_SEQ and not any("sliding" in n for n in g.notes)


def test_soft_capped_logits_are_named_as_refused() -> None:
    g = geometry_of({**LLAMA, "attn_logit_softcapping": 50.0})
    assert any("attn_logit_softcapping 50.0" in n and "refuses" in n for n in g.notes)
    assert not any("softcapping" in n for n in geometry_of(
        {**LLAMA, "attn_logit_softcapping": None}).notes)


def test_kv_heads_default_to_the_query_heads() -> None:
    g = geometry_of({"num_attention_heads": 12, "hidden_size": 768, "architectures":
                     ["GPT2LMHeadModel"], "n_positions": 1024, "torch_dtype": "float16"})
    assert (g.kv_heads, g.head_dim, g.dtype, g.causal, g.max_seq) == (12, 64, "fp16", True, 1024)


@pytest.mark.parametrize("dtype", ["float32", None])
def test_a_wide_or_missing_dtype_runs_in_bf16_with_a_note(dtype: str | None) -> None:
    g = geometry_of({**LLAMA, "torch_dtype": dtype})
    assert g.dtype == "bf16" and any("bf16" in n for n in g.notes)


def test_the_newer_dtype_field_is_read_too() -> None:
    config = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert geometry_of({**config, "dtype": "float16"}).dtype == "fp16"


@pytest.mark.parametrize("config", [
    {"architectures": ["BertForMaskedLM"], "model_type": "bert"},
    {"architectures": ["SomethingModel"], "model_type": "roberta"},
])
def test_encoders_are_not_causal(config: dict) -> None:
    g = geometry_of({"num_attention_heads": 12, "hidden_size": 768, **config})
    assert not g.causal and any("encoder" in n for n in g.notes)


def test_a_config_that_says_nothing_is_taken_for_a_decoder_and_says_so() -> None:
    g = geometry_of({"num_attention_heads": 16, "hidden_size": 2048})
    assert g.causal and any("assumed" in n for n in g.notes)


def test_a_multimodal_config_reads_its_language_model() -> None:
    g = geometry_of({"architectures": ["LlavaForConditionalGeneration"],
                     "text_config": {**LLAMA, "num_key_value_heads": 4}})
    assert (g.heads, g.kv_heads, g.causal) == (32, 4, True)


@pytest.mark.parametrize("config, says", [
    ({"hidden_size": 4096}, "num_attention_heads"),
    ({"num_attention_heads": 32}, "hidden_size"),
    ({"num_attention_heads": 32, "hidden_size": 1000}, "not a multiple"),
    ({"num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 64}, "multiple"),
    ({"num_attention_heads": 0, "head_dim": 64}, "positive"),
    ({"num_attention_heads": 32, "head_dim": 64, "max_position_embeddings": "long"}, "positive"),
])
def test_bad_configs_are_refused_in_one_line(config: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says) as e:
        geometry_of(config)
    assert "\n" not in str(e.value)


def test_missing_and_broken_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config file"):
        from_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        from_config(tmp_path / "bad.json")


def test_default_name_is_the_folder_of_a_config_json_else_the_stem(tmp_path: Path) -> None:
    assert default_name(write(tmp_path / "Qwen2-7B", LLAMA)) == "Qwen2-7B"
    assert default_name(write(tmp_path, LLAMA, "mistral.json")) == "mistral"


@pytest.mark.parametrize("max_seq, lengths", [
    (16384, [256, 512, 1024, 2048, 4096, 8192, 16384]),
    (3000, [256, 512, 1024, 2048, 3000]),
    (300, [256, 300]),
    (256, [256]),
    (200, [200]),
])
def test_the_ladder_doubles_from_256_and_ends_at_the_maximum(max_seq: int,
                                                             lengths: list[int]) -> None:
    assert ModelGeometry(heads=8, head_dim=64, max_seq=max_seq).prefill_lengths() == lengths


def test_each_call_carries_about_16k_tokens() -> None:
    g = ModelGeometry(heads=8, kv_heads=2, head_dim=64, max_seq=16384, causal=False,
                      dtype="fp16")
    calls = g.prefill_calls()
    assert [c["batch"] for c in calls] == [64, 32, 16, 8, 4, 2, 1]
    assert all(c["batch"] * c["seq_q"] == TOKENS_PER_CALL for c in calls)
    assert ModelGeometry.batch_for(100_000) == 1
    assert {(c["heads"], c["kv_heads"], c["head_dim"], c["causal"], c["dtype"])
            for c in calls} == {(8, 2, 64, False, "fp16")}


@pytest.mark.parametrize(("min_seq", "max_seq", "latency", "lengths"), [
    (256, 16384, 1024, [256, 512, 1024]),
    (256, 16384, 0, []),
    (256, 16384, 700, [256, 512]),
    (300, 16384, 1024, [300, 600]),
    (8192, 16384, 16384, [8192]),  # 16384 is one sequence already: the ladder's own call
    (256, 512, 1024, [256, 512]),
])
def test_latency_calls_are_one_sequence_at_the_short_rungs(min_seq: int, max_seq: int,
                                                           latency: int,
                                                           lengths: list[int]) -> None:
    g = ModelGeometry(heads=8, head_dim=64, max_seq=max_seq, min_seq=min_seq,
                      latency_max_seq=latency)
    calls = g.latency_calls()
    assert [c["seq_q"] for c in calls] == lengths and {c["batch"] for c in calls} <= {1}
    assert all(g.is_latency_call(1, n) for n in lengths)
    assert not any(g.is_latency_call(c["batch"], c["seq_q"]) for c in g.prefill_calls())


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1024"])
def test_a_bad_latency_length_is_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="latency seq must be a non-negative integer"):
        ModelGeometry(heads=8, head_dim=64, latency_max_seq=bad)  # type: ignore[arg-type]
