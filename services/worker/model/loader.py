"""Loads a local Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.worker.model.config import ModelConfig
from services.worker.model.llama import CausalLM
from services.worker.model.mtp_layout import MTP_PREFIX, normalize_mtp_weights
from services.worker.model.transposed import use_cpu_layout
from services.worker.model.weights import merge_projections

SHARD_INDEX = "model.safetensors.index.json"
# Buffers some exporters save although they are derived from the config.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {model_dir}")
    return files


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(model_dir):
        state.update(load_file(str(path)))
    return {k: v for k, v in state.items() if not k.endswith(_DERIVED_SUFFIXES)}


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """Builds the model from config.json and fills every parameter from the checkpoint, refusing gaps."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    state = merge_projections(normalize_mtp_weights(load_state_dict(model_dir), cfg))
    has_mtp = any(k.startswith(MTP_PREFIX) for k in state)
    if cfg.num_mtp_layers and not has_mtp:
        raise CheckpointError(f"config.json declares {cfg.num_mtp_layers} MTP layers but the checkpoint has none")
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict())
    missing = expected - set(state)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match {cfg.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)  # meta buffers are rebuilt for real
    model = model.to(device).eval()
    if model_device(model).type == "cpu":
        use_cpu_layout(model)
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
