"""The subset of a Hugging Face config.json that a Llama-family decoder needs, validated at load time."""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from services.worker.model.checkpoint_files import stores_head

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MiMoForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "MistralForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM", "SeedOssForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
)
_MISTRAL = "MistralForCausalLM"  # a Llama whose every layer attends to a sliding window
# A Llama whose checkpoint stores q/k/v and gate/up merged (the model's own layout), with an optional window
_PHI3 = "Phi3ForCausalLM"
# transformers' Phi3Config reads these rope types as longrope, which is not implemented
_PHI3_LONGROPE_NAMES = ("longrope", "su", "yarn")
_DEFAULT_RMS_NORM_EPS = {_PHI3: 1e-5}  # where config.json is silent (Phi3Config's; the others' 1e-6)
# A Llama with four scalars (IBM Granite 3.x): embeddings, each block's output and the logits scaled, and attention's
# own softmax scale; GraniteConfig's defaults where config.json is silent
_GRANITE = "GraniteForCausalLM"
_GRANITE_DEFAULTS = dict(
    embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0,
)
_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window where config.json has no such key (null: none)
_QWEN2_FAMILY = ("Qwen2ForCausalLM", "MiMoForCausalLM")  # q/k/v biases, optional sliding-window layers
_QWEN3_FAMILY = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # RMSNorm of every query and key head (q/k_norm)
_QWEN3_MOE = "Qwen3MoeForCausalLM"  # and routed experts
# Sliding layers from max_window_layers on (or as layer_types says); Qwen3-MoE's slide all alike (_attention_window)
_SLIDING_FAMILY = (*_QWEN2_FAMILY, "Qwen3ForCausalLM")
# Qwen3MoeConfig's defaults where config.json is silent
_MOE_DEFAULTS = dict(
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
)
_QWEN3_DENSE = "Qwen3ForCausalLM"
# ByteDance's Seed-OSS: Qwen2's math, its q/k/v biases set by attention_bias (SeedOssConfig's default: on)
_SEED_OSS = "SeedOssForCausalLM"
# Qwen3Config's and SeedOssConfig's head_dim where config.json has none (not hidden_size / heads, as elsewhere,
# Qwen3-MoE included)
_DEFAULT_HEAD_DIM = {_QWEN3_DENSE: 128, _SEED_OSS: 128}
# The configs' num_key_value_heads where config.json has none (Llama's, Phi-3's and Granite's: one per query head)
_DEFAULT_KV_HEADS = {
    _MISTRAL: 8, _SEED_OSS: 8, _QWEN3_MOE: 4, _QWEN3_DENSE: 32, **{arch: 32 for arch in _QWEN2_FAMILY},
}
# Google's Gemma 3 (text): sliding-window layers beside full ones, each kind with its own rope; RMSNorm weights
# stored as offsets from 1; a norm on each sublayer's output too; a tanh-GELU-gated MLP; embeddings times
# sqrt(hidden_size); attention scaled by query_pre_attn_scalar ** -0.5. Gemma3TextConfig's defaults where
# config.json is silent:
_GEMMA3 = "Gemma3ForCausalLM"
_GEMMA3_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
    sliding_window=4096, sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh",
)
GELU_TANH_NAMES = ("gelu_pytorch_tanh",)  # Gemma's MLP activation, F.gelu(approximate="tanh")
# Gemma 3 switches that change the math and that specmesh does not implement
_GEMMA3_REFUSED = ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention",
                   "attention_bias")
# Vision-language checkpoints, served on text alone (model/language_model_layout.py): each language model's config
# is its text_config (the model_type named, or left out), read as the causal LM's it is. Gemma 3 4B-27B leave most
# of it to Gemma3TextConfig's defaults; Mistral Small 3.1 and 3.2 (24B) wrap a Mistral.
VISION_LANGUAGE = {
    "Gemma3ForConditionalGeneration": (_GEMMA3, "gemma3_text"),
    "Mistral3ForConditionalGeneration": (_MISTRAL, "mistral"),
}
# transformers' defaults where config.json leaves max_position_embeddings out (LlamaConfig, Qwen2Config, Qwen3Config).
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "MiMoForCausalLM": 32768, "Qwen3ForCausalLM": 32768,
    "Qwen3MoeForCausalLM": 32768, "MistralForCausalLM": 4096 * 32, "Phi3ForCausalLM": 4096,
    "GraniteForCausalLM": 2048, _SEED_OSS: 524288,
}
DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# transformers reads `rope_scaling` (older configs) before `rope_parameters` (what transformers 5 saves).
ROPE_KEYS = ("rope_scaling", "rope_parameters")
_REQUIRED_ROPE_KEYS = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
_ORIGINAL_LENGTH_TYPES = ("yarn", "llama3")  # types that read original_max_position_embeddings
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # transformers' defaults, also where the config writes 0 or null
SILU_NAMES = ("silu", "swish")  # one function under two names in transformers' ACT2FN
SILU, GELU_TANH = "silu", "gelu_tanh"  # the MLP's gate activations (ModelConfig.activation)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
_QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's default: layers from this index on slide when sliding is on
_QWEN_WINDOW = 4096  # Qwen2's, Qwen3's and Qwen3-MoE's sliding_window where config.json names none


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    """transformers' `rope_type` and the parameters it reads for that type (model/rope.py turns them into
    frequencies); "default" rescales nothing."""

    rope_type: str = "default"
    factor: float | None = None  # linear, dynamic, yarn, llama3 (yarn: None = max_position / original)
    original_max_position_embeddings: int | None = None  # yarn, llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: None = derived from factor (and mscale / mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    beta_fast: float = YARN_BETA_FAST  # yarn
    beta_slow: float = YARN_BETA_SLOW  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; specmesh serves {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @classmethod
    def from_dict(cls, params: dict, key: str, max_position_embeddings: int, original: int | None) -> "RopeScaling":
        """params: config.json's rope dict under `key`; original: a top-level original_max_position_embeddings,
        which transformers prefers to the rope dict's."""
        if any(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError(f"{key} per layer type ({', '.join(params)}) is not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{key}: rope_type {rope_type!r} is not supported; specmesh serves {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        # yarn's factor may be null (then max_position / original); every other required value must be given.
        missing = [
            name for name in _REQUIRED_ROPE_KEYS[rope_type]
            if name not in params or (params[name] is None and (rope_type, name) != ("yarn", "factor"))
        ]
        if missing:
            raise UnsupportedModelError(f"{key}: rope_type {rope_type!r} needs {', '.join(missing)}")
        if rope_type in _ORIGINAL_LENGTH_TYPES and original is None:
            original = params.get("original_max_position_embeddings", max_position_embeddings)
        return cls(
            rope_type=rope_type,
            factor=_optional_float(params.get("factor")),
            original_max_position_embeddings=original if rope_type in _ORIGINAL_LENGTH_TYPES else None,
            low_freq_factor=_optional_float(params.get("low_freq_factor")),
            high_freq_factor=_optional_float(params.get("high_freq_factor")),
            attention_factor=_optional_float(params.get("attention_factor")),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            beta_fast=float(params.get("beta_fast") or YARN_BETA_FAST),
            beta_slow=float(params.get("beta_slow") or YARN_BETA_SLOW),
            truncate=bool(params.get("truncate", True)),
        )


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


PARD_TOKEN_KEY = "pard_token"  # the config key PARD's checkpoints name their mask token with


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 and MiMo have q/k/v biases
    num_mtp_layers: int  # multi-token-prediction modules stored beside the decoder (0 = none)
    rope_scaling: RopeScaling = RopeScaling()
    # The window of the layers layer_types names sliding (Qwen2's and Qwen3's with use_sliding_window, Gemma 3's):
    # keys this far back or more are not attended to
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3: each query and key head is RMS-normalised (over head_dim) before the rotation
    # Mistral: every layer's query at position i attends to keys i - attention_window < j <= i (None: all of them)
    attention_window: int | None = None
    # Qwen3-MoE: layers whose MLP is num_experts routed experts of moe_intermediate_size, each token's output the
    # sum of its num_experts_per_tok most likely ones, weighted by their router probabilities (renormalised to sum
    # to 1 with norm_topk_prob); 0 experts: every layer dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # The routed experts this process holds (expert parallelism, tensor_parallel/divisible.py); None: all of them
    local_experts: range | None = None
    # Granite's scalars: embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before it joins the residual stream, attention's softmax scale attention_multiplier (None:
    # head_dim ** -0.5), logits divided by logits_scaling (the last two folded into weights at load, loader.py)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma: the embedding_multiplier rounded to the model's dtype before it scales (transformers keeps it in a tensor
    # of the weights' dtype); Granite's multiplies as a Python float
    embedding_multiplier_in_model_dtype: bool = False
    # Each layer's attention (FULL_ATTENTION, or SLIDING_ATTENTION over the last sliding_window positions); Gemma 3:
    # the sliding layers' own rope (None: the full ones'), RMSNorm weights stored as offsets from
    # norm_weight_offset (folded in at load, loader.py), norms on the attention's and the MLP's outputs too
    # (sandwich_norms), and the MLP's gate activation. (): every layer alike, attending within attention_window.
    layer_types: tuple[str, ...] = ()
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = SILU

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier
    # A parallel draft model's (PARD) mask token: fed after the last real token, it drafts the token after next in
    # the same pass (drafting/draft_model.py); None: an autoregressive model
    pard_token: int | None = None

    def layer_window(self, index: int) -> int | None:
        """The window decoder layer `index` attends within: its type's (Gemma 3), or every layer's (Mistral's; an
        MTP module's layer, past the trunk's, has it too). None: every earlier position."""
        if index < len(self.layer_types):
            return self.sliding_window if self.layer_types[index] == SLIDING_ATTENTION else None
        return self.attention_window

    def uses_sliding_rope(self, index: int) -> bool:
        """Whether decoder layer `index` rotates with the sliding layers' own rope (sliding_rope_config)."""
        return (self.sliding_rope_theta is not None and index < len(self.layer_types)
                and self.layer_types[index] == SLIDING_ATTENTION)

    def sliding_rope_config(self) -> "ModelConfig":
        """This config with the sliding layers' rope in place of the full layers' (for model/rope.py)."""
        return dataclasses.replace(
            self, rope_theta=self.sliding_rope_theta, rope_scaling=self.sliding_rope_scaling or RopeScaling()
        )

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has routed experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rope_position_limit(self) -> int | None:
        """Positions the rotary embedding serves as transformers does (None: any). Dynamic NTK equals the default
        rope up to max_position_embeddings; past it, transformers rescales the frequencies on every forward pass
        from that pass's longest sequence, so a cached key's rotation depends on the pass that computed it (the
        prompt's length for prompt tokens, the batch, earlier requests), which a paged cache shared by batched,
        speculative and resumed sequences does not reproduce."""
        return self.max_position_embeddings if self.rope_scaling.rope_type == "dynamic" else None

    def check_served_length(self, max_model_len: int) -> None:
        """Refuses, by the config key responsible, a served length at which the math would leave transformers'."""
        limit = self.rope_position_limit
        if limit is None and self.sliding_rope_theta is not None:  # Gemma's sliding layers' own rope
            limit = self.sliding_rope_config().rope_position_limit
        if limit is not None and max_model_len > limit:
            raise UnsupportedModelError(
                f"rope_type 'dynamic' is served up to max_position_embeddings ({limit}) positions, where it equals "
                f"the default rope; max_model_len {max_model_len} is longer. Past it transformers rescales the "
                "frequencies per forward pass from that pass's longest sequence, which a shared paged cache does "
                "not reproduce"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"specmesh serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = arch
        if arch in VISION_LANGUAGE:
            raw = _language_model_config(raw, arch)
            arch = VISION_LANGUAGE[arch][0]
        _refuse_unsupported_keys(raw, arch)
        if arch == _GEMMA3:
            return cls._gemma3(raw, architecture)
        heads = raw["num_attention_heads"]
        max_positions = raw.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
        key = next((k for k in ROPE_KEYS if raw.get(k)), ROPE_KEYS[-1])
        rope = dict(raw.get(key) or {})
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or _DEFAULT_KV_HEADS.get(arch, heads),
            head_dim=_head_dim(raw, arch),
            # The rope dict's theta wins over a top-level rope_theta, as in transformers.
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))),
            rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS.get(arch, 1e-6))),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # a Llama with attention_bias was refused above
            attention_bias=arch in _QWEN2_FAMILY or arch == _SEED_OSS and bool(raw.get("attention_bias", True)),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0)),
            rope_scaling=RopeScaling.from_dict(rope, key, max_positions, raw.get("original_max_position_embeddings")),
            **_sliding_layers(raw, arch),
            qk_norm=arch in _QWEN3_FAMILY,
            attention_window=_attention_window(raw, arch),
            pard_token=raw.get(PARD_TOKEN_KEY),
            **_experts(raw, arch),
            **_granite_scalars(raw, arch),
        )

    @classmethod
    def _gemma3(cls, raw: dict, architecture: str) -> "ModelConfig":
        window = raw.get("sliding_window", _GEMMA3_DEFAULTS["sliding_window"])  # null: sliding layers see all
        raw = {**_GEMMA3_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        max_positions = raw["max_position_embeddings"]
        heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
        layer_types = _checked_layer_types(raw.get("layer_types") or [
            SLIDING_ATTENTION if (i + 1) % raw["sliding_window_pattern"] else FULL_ATTENTION for i in range(layers)
        ], layers)
        full, sliding = _gemma3_ropes(raw, max_positions)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw["head_dim"],
            rope_theta=full[0],
            rms_norm_eps=float(raw["rms_norm_eps"]),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=False,
            num_mtp_layers=0,
            rope_scaling=full[1],
            sliding_window=None if window is None else int(window),
            qk_norm=True,
            # Gemma3TextScaledWordEmbedding's scale, a float32 tensor cast to the weights' dtype as it scales
            embedding_multiplier=torch_float32(raw["hidden_size"] ** 0.5),
            embedding_multiplier_in_model_dtype=True,
            attention_multiplier=float(raw["query_pre_attn_scalar"]) ** -0.5,
            layer_types=layer_types,
            sliding_rope_theta=sliding[0],
            sliding_rope_scaling=sliding[1],
            norm_weight_offset=1.0,
            sandwich_norms=True,
            activation=GELU_TANH,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        """config.json's model, its head untied where the checkpoint stores one (a directory without weights, a
        shape, is read as its config says: a shape of a published Mistral Small, which says nothing of tying,
        would count no head of its own)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        cfg = cls.from_dict(json.loads(path.read_text()))
        if cfg.tie_word_embeddings and stores_head(model_dir):
            # transformers 5 ties only a head the checkpoint leaves out (it keeps a stored one that differs from
            # the embeddings): Mistral Small 3.1's config says nothing, which Mistral3Config reads as tied
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        return cfg


def _head_dim(raw: dict, arch: str) -> int:
    """config.json's head_dim; where it writes none, hidden_size / heads (transformers' configs read a null so), and
    where it leaves the key out, the architecture's default (Qwen3's and Seed-OSS's 128)."""
    if raw.get("head_dim"):
        return raw["head_dim"]
    fallback = raw["hidden_size"] // raw["num_attention_heads"]
    return fallback if "head_dim" in raw else _DEFAULT_HEAD_DIM.get(arch, fallback)


def _granite_scalars(raw: dict, arch: str) -> dict:
    if arch != _GRANITE:
        return {}
    return {key: float(raw[key] if raw.get(key) is not None else default) for key, default in _GRANITE_DEFAULTS.items()}


def _attention_window(raw: dict, arch: str) -> int | None:
    """The window every layer attends to: Mistral's (MistralConfig's default where config.json is silent), Phi-3's
    (none unless config.json names one), Qwen3-MoE's with use_sliding_window."""
    if arch == _MISTRAL:
        return raw.get("sliding_window", _MISTRAL_WINDOW)
    if arch == _PHI3:
        return raw.get("sliding_window")
    if arch == _QWEN3_MOE and raw.get("use_sliding_window"):
        # transformers' Qwen3-MoE windows every layer, whatever max_window_layers says
        return raw.get("sliding_window", _QWEN_WINDOW)
    return None


def _language_model_config(raw: dict, arch: str) -> dict:
    """A vision-language config's language model, as transformers builds it: text_config alone (no top-level key
    reaches it), tied as the top level says (transformers 5 ties by the top-level config, default true); the
    top-level quantization_config is carried along to be refused with the rest, and a language model of another type
    is refused by its model_type."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{arch}: config.json has no text_config")
    model_type = VISION_LANGUAGE[arch][1]
    if text.get("model_type", model_type) != model_type:
        raise UnsupportedModelError(f"{arch}: text_config model_type {text['model_type']!r} is not supported; "
                                    f"specmesh serves its {model_type!r} language model")
    return {**text, "architectures": [arch], "tie_word_embeddings": raw.get("tie_word_embeddings", True),
            "quantization_config": raw.get("quantization_config")}


def context_length(raw: dict) -> int | None:
    """The model's trained context as specmesh reads config.json: max_position_embeddings (under text_config for a
    vision-language checkpoint, the architecture's default where the file is silent), or for a config specmesh
    does not serve the top-level key if any."""
    try:
        return ModelConfig.from_dict(raw).max_position_embeddings
    except (KeyError, TypeError, ValueError):  # UnsupportedModelError among the last
        value = raw.get("max_position_embeddings")
        return value if isinstance(value, int) else None


def torch_float32(value: float) -> float:
    """value rounded to float32, as a scalar transformers keeps in a float32 tensor is."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _gemma3_ropes(raw: dict, max_positions: int) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling]]:
    """(theta, scaling) of the full layers' rope, then of the sliding layers': from rope_parameters keyed by layer
    type (what transformers 5 saves), else from rope_theta and rope_scaling (the full layers') and
    rope_local_base_freq (the sliding layers', unscaled), as published configs write them."""
    per_type = raw.get("rope_parameters")
    if isinstance(per_type, dict) and FULL_ATTENTION in per_type:
        unknown = set(per_type) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise UnsupportedModelError(f"rope_parameters for {sorted(unknown)} are not supported")
        full = dict(per_type[FULL_ATTENTION] or {})
        sliding = dict(per_type.get(SLIDING_ATTENTION) or {})
    else:
        full = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        sliding = {}
    full.setdefault("rope_theta", raw["rope_theta"])
    sliding.setdefault("rope_theta", raw["rope_local_base_freq"])
    ropes = []
    for params in (full, sliding):
        scaling = RopeScaling.from_dict(params, "rope_parameters", max_positions, None)
        ropes.append((float(params["rope_theta"]), scaling))
    return ropes[0], ropes[1]


def _refuse_gemma3_keys(raw: dict) -> None:
    for key in _GEMMA3_REFUSED:
        if raw.get(key):
            raise UnsupportedModelError(f"{key} {raw[key]!r} is not supported for Gemma 3")
    factor = raw.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} is not supported: rope rotates whole heads")
    act = raw.get("hidden_activation") or _GEMMA3_DEFAULTS["hidden_activation"]
    if act not in GELU_TANH_NAMES:
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported; Gemma 3's MLP is "
                                    "'gelu_pytorch_tanh'-gated")


def _refuse_unsupported_keys(raw: dict, arch: str) -> None:
    """Config keys that change the math in transformers' Llama or Qwen2 and that specmesh does not implement."""
    if raw.get("quantization_config"):
        raise UnsupportedModelError("quantization_config: quantized checkpoints are not supported")
    if arch == _GEMMA3:
        _refuse_gemma3_keys(raw)
        return
    act = raw.get("hidden_act", SILU_NAMES[0])
    if act not in SILU_NAMES:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; specmesh's MLP is SiLU-gated ('silu')")
    rope_dicts = [raw[key] for key in ROPE_KEYS if isinstance(raw.get(key), dict)]
    for factor in [raw.get("partial_rotary_factor")] + [d.get("partial_rotary_factor") for d in rope_dicts]:
        if factor is not None and float(factor) != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {factor} is not supported: rope rotates whole heads")
    if arch == _PHI3 and any((d.get("rope_type") or d.get("type")) in _PHI3_LONGROPE_NAMES for d in rope_dicts):
        raise UnsupportedModelError(
            "rope_scaling of Phi-3 (longrope, or su and yarn, which Phi3Config reads as longrope) is not supported"
        )
    if arch in _QWEN2_FAMILY:
        return  # transformers' Qwen2 reads neither attention_bias (q/k/v always have one) nor mlp_bias
    if arch == _SEED_OSS:
        for key in ("attention_out_bias", "mlp_bias"):
            if raw.get(key):
                raise UnsupportedModelError(f"{key} true is not supported for Seed-OSS: its o_proj and MLP "
                                            "projections have no bias here")
        return
    if raw.get("attention_bias") and arch in _QWEN3_FAMILY:
        raise UnsupportedModelError(
            "attention_bias true is not supported for Qwen3: its o_proj bias (beside the q/k/v ones) is not implemented"
        )
    if arch in _QWEN3_FAMILY or arch in (_MISTRAL, _PHI3):
        # transformers' Qwen3, Mistral and Phi-3 MLPs have no bias whatever mlp_bias says, nor the last two's attention
        return
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias true is not supported: specmesh's MLP projections have no bias")
    if raw.get("attention_bias"):
        raise UnsupportedModelError(
            "attention_bias true is not supported for Llama: its o_proj bias (beside the q/k/v ones) is not implemented"
        )


def _experts(raw: dict, arch: str) -> dict:
    """Qwen3-MoE's expert keys, with Qwen3MoeConfig's defaults."""
    if arch != _QWEN3_MOE:
        return {}
    # Published configs say num_experts; transformers 5 saves it as num_local_experts.
    raw = {"num_experts": raw.get("num_local_experts"), **{k: v for k, v in raw.items() if v is not None}}
    keys = {key: raw.get(key) if raw.get(key) is not None else default for key, default in _MOE_DEFAULTS.items()}
    if not 0 < keys["num_experts_per_tok"] <= keys["num_experts"]:
        raise UnsupportedModelError(
            f"num_experts_per_tok {keys['num_experts_per_tok']} must be between 1 and num_experts {keys['num_experts']}"
        )
    return dict(
        num_experts=int(keys["num_experts"]), num_experts_per_tok=int(keys["num_experts_per_tok"]),
        moe_intermediate_size=int(keys["moe_intermediate_size"]), norm_topk_prob=bool(keys["norm_topk_prob"]),
        decoder_sparse_step=int(keys["decoder_sparse_step"]), mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
    )


def _checked_layer_types(layer_types: list[str] | tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """config.json's layer_types, one known type per layer, or refused by the key."""
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported")
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(layer_types)


def _sliding_layers(raw: dict, arch: str) -> dict:
    """Qwen2's or Qwen3's sliding_window and layer_types where some layer slides: config.json's layer types, else
    those from max_window_layers on sliding, as transformers derives them; none where no layer slides
    (transformers drops the window unless use_sliding_window is set, and Llama has none)."""
    if arch not in _SLIDING_FAMILY:
        return {}
    given = raw.get("layer_types")
    unknown = set(given or ()) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:  # refused whether or not a window applies
        raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported")
    window = raw.get("sliding_window", _QWEN_WINDOW)
    if not raw.get("use_sliding_window") or window is None:
        return {}
    num_layers = raw["num_hidden_layers"]
    if given:
        layer_types = _checked_layer_types(given, num_layers)
    else:
        first_sliding = raw.get("max_window_layers", _QWEN2_MAX_WINDOW_LAYERS)
        layer_types = tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers))
    if SLIDING_ATTENTION not in layer_types:
        return {}
    return {"sliding_window": window, "layer_types": layer_types}
