"""The subset of a Hugging Face config.json that a Llama-family decoder needs, validated at load time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MiMoForCausalLM")
_QWEN2_FAMILY = ("Qwen2ForCausalLM", "MiMoForCausalLM")  # q/k/v biases


class UnsupportedModelError(ValueError):
    pass


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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
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
        if raw.get("rope_scaling"):
            raise UnsupportedModelError(f"rope_scaling {raw['rope_scaling']!r} is not supported yet")
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch in _QWEN2_FAMILY or bool(raw.get("attention_bias", False)),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))
