"""config.json keys that change the math are honoured or refused by name: each refused one raises
UnsupportedModelError naming the key, and the harmless spellings real checkpoints ship are accepted."""

from __future__ import annotations

import pytest

from services.worker.model.config import ModelConfig, UnsupportedModelError, context_length

LLAMA = dict(
    architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
QWEN2 = LLAMA | dict(architectures=["Qwen2ForCausalLM"])
QWEN3 = LLAMA | dict(architectures=["Qwen3ForCausalLM"], head_dim=32)
MISTRAL = LLAMA | dict(architectures=["MistralForCausalLM"])
SEED_OSS = LLAMA | dict(architectures=["SeedOssForCausalLM"])
WINDOW = 128
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


@pytest.mark.parametrize("raw,key", [
    (LLAMA | dict(hidden_act="gelu"), "hidden_act"),
    (LLAMA | dict(mlp_bias=True), "mlp_bias"),
    (LLAMA | dict(attention_bias=True), "attention_bias"),
    (LLAMA | dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (LLAMA | dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (LLAMA | dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    (LLAMA | dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}), "longrope"),
    (LLAMA | dict(rope_parameters={"rope_type": "proportional"}), "proportional"),
    (LLAMA | dict(rope_scaling={"rope_type": "linear"}), "factor"),
    (LLAMA | dict(rope_scaling={"rope_type": "dynamic", "factor": None}), "factor"),
    (LLAMA | dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}), "low_freq_factor"),
    (LLAMA | dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
    (QWEN2 | dict(layer_types=["full_attention", "chunked_attention"] * 2), "layer_types"),
    (QWEN2 | dict(hidden_act="relu"), "hidden_act"),
    (QWEN3 | dict(attention_bias=True), "attention_bias"),
    (QWEN3 | dict(layer_types=["full_attention", "chunked_attention"] * 2), "layer_types"),
    (QWEN2 | dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention"]), "layer_types"),
    (SEED_OSS | dict(attention_out_bias=True), "attention_out_bias"),
    (SEED_OSS | dict(mlp_bias=True), "mlp_bias"),
])
def test_unsupported_key_is_refused_by_name(raw: dict, key: str) -> None:
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("raw", [
    LLAMA | dict(hidden_act="silu", mlp_bias=False, attention_bias=False, pretraining_tp=1, partial_rotary_factor=1.0),
    LLAMA | dict(hidden_act="swish"),  # the same function in transformers
    QWEN2 | dict(use_sliding_window=False, sliding_window=32768, max_window_layers=2),  # every Qwen2.5 config
    QWEN2 | dict(attention_bias=False, mlp_bias=True),  # keys transformers' Qwen2 does not read
    LLAMA | dict(rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    QWEN3 | dict(attention_bias=False, mlp_bias=True, use_sliding_window=False, sliding_window=None),  # Qwen3-*B
])
def test_harmless_keys_are_accepted(raw: dict) -> None:
    cfg = ModelConfig.from_dict(raw)
    assert cfg.sliding_window is None
    cfg.check_served_length(4 * WINDOW)


@pytest.mark.parametrize("raw", [
    QWEN2 | dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    QWEN2 | dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"] * 2),
    QWEN3 | dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
])
def test_sliding_layers_are_windowed_as_transformers_derives_them(raw: dict) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = (transformers.Qwen3Config if "Qwen3ForCausalLM" in raw["architectures"] else transformers.Qwen2Config)(
        **{k: v for k, v in raw.items() if k != "architectures"})
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [
        theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types]
    assert cfg.sliding_rope_theta is None and not cfg.uses_sliding_rope(3)  # one rope for every layer
    cfg.check_served_length(4 * WINDOW)


def test_qwen3_moe_windows_every_layer_as_transformers_does() -> None:
    raw = QWEN3 | dict(architectures=["Qwen3MoeForCausalLM"], use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=2)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.attention_window == WINDOW and not cfg.layer_types  # every layer, so the engine frees old blocks
    assert ModelConfig.from_dict(raw | dict(use_sliding_window=False)).attention_window is None
    silent = {k: v for k, v in raw.items() if k != "sliding_window"}  # Qwen3MoeConfig's default window
    assert ModelConfig.from_dict(silent).attention_window == 4096


def test_a_sliding_window_config_json_leaves_out_is_qwens_default() -> None:
    raw = QWEN2 | dict(use_sliding_window=True, max_window_layers=2)
    assert [ModelConfig.from_dict(raw).layer_window(i) for i in range(4)] == [None, None, 4096, 4096]


def test_sliding_window_without_sliding_layers_is_accepted() -> None:
    raw = QWEN2 | dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=QWEN2["num_hidden_layers"])
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [None] * cfg.num_hidden_layers


def test_rope_fields_follow_transformers_precedence() -> None:
    """rope_scaling before rope_parameters, rope_type before type, the rope dict's theta before the top level's,
    a top-level original_max_position_embeddings before the rope dict's."""
    raw = LLAMA | dict(
        rope_theta=1.0, original_max_position_embeddings=32,
        rope_scaling=LLAMA3 | {"type": "linear", "rope_theta": 500000.0},
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 7.0},
    )
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.original_max_position_embeddings == 32


def test_mistral_windows_every_layer_as_transformers_does() -> None:
    assert ModelConfig.from_dict(MISTRAL).attention_window == 4096  # MistralConfig's default: the key is absent
    assert ModelConfig.from_dict(MISTRAL | dict(sliding_window=None)).attention_window is None  # Mistral-7B-v0.3
    cfg = ModelConfig.from_dict(MISTRAL | dict(sliding_window=WINDOW, attention_bias=True, mlp_bias=True))
    assert cfg.attention_window == WINDOW and cfg.sliding_window is None  # honoured, so nothing is refused
    cfg.check_served_length(4 * WINDOW)
    assert ModelConfig.from_dict(LLAMA).attention_window is None


def test_seed_oss_reads_its_configs_defaults() -> None:
    """SeedOssConfig's defaults where config.json is silent: q/k/v biases, 128-wide heads, 512k positions."""
    cfg = ModelConfig.from_dict({k: v for k, v in SEED_OSS.items() if k != "max_position_embeddings"})
    assert (cfg.attention_bias, cfg.head_dim, cfg.max_position_embeddings) == (True, 128, 524288)
    assert not ModelConfig.from_dict(SEED_OSS | dict(attention_bias=False, head_dim=16)).attention_bias
    assert ModelConfig.from_dict(SEED_OSS | dict(head_dim=None)).head_dim == 16  # null: hidden_size / heads


# google/gemma-3-1b-it's config.json as published (transformers 4.50): no layer_types (a sliding_window_pattern),
# the sliding layers' rope as rope_local_base_freq, no tie_word_embeddings (Gemma3TextConfig's default: tied)
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=None,
    bos_token_id=2, cache_implementation="hybrid", eos_token_id=[1, 106], final_logit_softcapping=None, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_size=1152, initializer_range=0.02, intermediate_size=6912,
    max_position_embeddings=32768, model_type="gemma3_text", num_attention_heads=4, num_hidden_layers=26,
    num_key_value_heads=1, pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_local_base_freq=10000,
    rope_scaling=None, rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, torch_dtype="bfloat16",
    use_cache=True, vocab_size=262144,
)


@pytest.mark.parametrize("raw", [GEMMA3_1B, GEMMA3_1B | dict(rope_scaling={"rope_type": "linear", "factor": 8.0},
                                                             num_hidden_layers=8, sliding_window_pattern=4)])
def test_gemma3_reads_a_published_config_as_transformers_does(raw: dict) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Gemma3TextConfig.from_dict(raw)
    cfg = ModelConfig.from_dict(raw)
    assert list(cfg.layer_types) == theirs.layer_types
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [
        theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types]
    full, sliding = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (
        full["rope_theta"], full["rope_type"], full.get("factor"))
    assert (cfg.sliding_rope_theta, cfg.sliding_rope_scaling.rope_type) == (sliding["rope_theta"], sliding["rope_type"])
    assert cfg.tie_word_embeddings is theirs.tie_word_embeddings is True
    assert cfg.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert (cfg.head_dim, cfg.max_position_embeddings) == (theirs.head_dim, theirs.max_position_embeddings)
    cfg.check_served_length(cfg.max_position_embeddings)  # the window applies per layer: served at any length
    assert cfg.uses_sliding_rope(0) and not cfg.uses_sliding_rope(raw["sliding_window_pattern"] - 1)


@pytest.mark.parametrize("key,value", [
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("use_bidirectional_attention", True),
    ("attention_bias", True), ("hidden_activation", "gelu"), ("partial_rotary_factor", 0.5),
    ("rope_parameters", {"full_attention": {"rope_type": "default"}, "chunked_attention": {"rope_type": "default"}}),
    ("layer_types", ["sliding_attention", "chunked_attention"] * 13),
])
def test_gemma3_switches_it_does_not_implement_are_refused_by_name(key: str, value) -> None:
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_dict(GEMMA3_1B | {key: value})


# google/gemma-3-4b-it's config.json as published: the language model's keys under text_config, most of them left to
# Gemma3TextConfig's defaults
GEMMA3_4B = dict(
    architectures=["Gemma3ForConditionalGeneration"], boi_token_index=255999, eoi_token_index=256000,
    eos_token_id=[1, 106], image_token_index=262144, initializer_range=0.02, mm_tokens_per_image=256,
    model_type="gemma3", torch_dtype="bfloat16", text_config=dict(
        hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024,
    ),
    vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304, model_type="siglip_vision_model",
                       num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False),
)


def test_a_vision_language_gemma3_is_read_as_its_language_model() -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Gemma3Config.from_dict(GEMMA3_4B).text_config
    cfg = ModelConfig.from_dict(GEMMA3_4B)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size, theirs.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.max_position_embeddings)
    assert list(cfg.layer_types) == theirs.layer_types
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [
        theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types]
    full = theirs.rope_parameters["full_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (
        full["rope_theta"], full["rope_type"], full["factor"])
    assert cfg.sliding_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert cfg.tie_word_embeddings and cfg.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert context_length(GEMMA3_4B) == theirs.max_position_embeddings  # what max_model_len defaults to
    assert context_length(GEMMA3_1B) == GEMMA3_1B["max_position_embeddings"]
    with pytest.raises(UnsupportedModelError, match="text_config"):
        ModelConfig.from_dict({k: v for k, v in GEMMA3_4B.items() if k != "text_config"})
    # No top-level key reaches the language model, as in transformers; the top level says whether the head is tied
    stray = ModelConfig.from_dict(GEMMA3_4B | dict(vocab_size=262144, rms_norm_eps=1e-5, tie_word_embeddings=False))
    assert (stray.vocab_size, stray.rms_norm_eps, stray.tie_word_embeddings) == (theirs.vocab_size, 1e-6, False)
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        ModelConfig.from_dict(GEMMA3_4B | dict(quantization_config={"quant_method": "awq"}))
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        ModelConfig.from_dict(GEMMA3_4B | dict(text_config=GEMMA3_4B["text_config"] | {"final_logit_softcapping": 30}))


def test_a_dynamic_rope_of_the_sliding_layers_bounds_the_served_length() -> None:
    ropes = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    cfg = ModelConfig.from_dict(GEMMA3_1B | dict(rope_parameters=ropes))
    cfg.check_served_length(cfg.max_position_embeddings)
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        cfg.check_served_length(cfg.max_position_embeddings + 1)


@pytest.mark.parametrize("architecture, config_class", [
    ("MistralForCausalLM", "MistralConfig"), ("LlamaForCausalLM", "LlamaConfig"), ("Qwen2ForCausalLM", "Qwen2Config"),
    ("Qwen3ForCausalLM", "Qwen3Config"), ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), ("SeedOssForCausalLM", "SeedOssConfig"),
    ("Phi3ForCausalLM", "Phi3Config"), ("GraniteForCausalLM", "GraniteConfig"),
])
def test_key_value_heads_config_json_leaves_out_are_the_configs_default(architecture: str, config_class: str) -> None:
    """Mistral's 8, Qwen3-MoE's 4, Qwen2's 32..., not one per query head as a Llama's."""
    transformers = pytest.importorskip("transformers")
    raw = {"vocab_size": 64, "hidden_size": 2048, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 32}
    expected = getattr(transformers, config_class)(**raw).num_key_value_heads
    assert ModelConfig.from_dict(raw | {"architectures": [architecture]}).num_key_value_heads == expected
