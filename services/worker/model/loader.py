"""Loads a local Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not), or builds the
model from its config.json alone with random weights (load format "dummy", model/dummy.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.worker.model.checkpoint_files import CheckpointError, shard_files
from services.worker.model.config import ModelConfig
from services.worker.model.dummy import dummy_state_dict
from services.worker.model.language_model_layout import language_model_weights
from services.worker.model.llama import CausalLM
from services.worker.model.mtp_layout import MTP_PREFIX, normalize_mtp_weights
from services.worker.model.transposed import use_cpu_layout
from services.worker.model.weights import merge_projections

LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's safetensors; dummy: random weights from config.json
# Buffers some exporters save although they are derived from the config.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


TRUNK_PREFIX = "model.layers."
RESIDUAL_OUTPUTS = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")
FINAL_NORM = "model.norm.weight"
NORM_WEIGHT = "norm.weight"  # every RMSNorm's: each layer's (`..._layernorm`, q_norm, k_norm) and the final one

def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in shard_files(model_dir):
        state.update(load_file(str(path)))
    return {k: v for k, v in state.items() if not k.endswith(_DERIVED_SUFFIXES)}


REVISION_SAMPLE_BYTES = 1 << 20  # read from each end of each weight file for model_revision


def model_revision(model_dir: Path, dtype: str, load_format: str) -> str:
    """A name for the weights a worker serves, for the prefix cache's block names (shared/prefix_hash.py): a hash of
    config.json, the dtype and load format, and each weight file's size and first and last MiB (its header, which
    names every tensor, and weights that any retraining changes). Stable across restarts and machines, and read
    in milliseconds where hashing a 15 GB checkpoint whole would take seconds."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{dtype}/{load_format}/".encode())
    digest.update((model_dir / "config.json").read_bytes())
    if load_format != "dummy":
        for path in shard_files(model_dir):
            size = path.stat().st_size
            digest.update(size.to_bytes(8, "little"))
            with path.open("rb") as weights:
                digest.update(weights.read(REVISION_SAMPLE_BYTES))
                weights.seek(max(size - REVISION_SAMPLE_BYTES, 0))
                digest.update(weights.read(REVISION_SAMPLE_BYTES))
    return digest.hexdigest()


def load_model(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_format: str = "auto",
    max_model_len: int | None = None,
) -> CausalLM:
    """Builds the model from config.json and fills every parameter from the checkpoint, refusing gaps, or with
    random weights made on `device` (load_format "dummy"). A max_model_len the config cannot serve as transformers
    would is refused before any weight is read."""
    model_dir = Path(model_dir)
    cfg = served_config(model_dir, load_format, max_model_len)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if load_format == "dummy":
        state = dummy_state_dict(model, dtype, device)
    else:
        state = checkpoint_state(model_dir, cfg, set(model.state_dict()), dtype)
    model = place(model, state, device, max_model_len)
    model.freeze_lookups()
    return model


def served_config(model_dir: Path, load_format: str, max_model_len: int | None) -> ModelConfig:
    """config.json's model, refused when the load format is unknown or max_model_len cannot be served."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cfg = ModelConfig.from_dir(Path(model_dir))
    if max_model_len is not None:
        cfg.check_served_length(max_model_len)
    return cfg


def place(model: CausalLM, state: dict[str, torch.Tensor], device: str, max_model_len: int | None) -> CausalLM:
    """A model built on the meta device, filled with `state` on `device`, in the device's layout (lookups not
    yet frozen: the caller may still swap modules)."""
    model.load_state_dict(state, assign=True)
    model.rotary = type(model.rotary)(model.config, max_model_len, device)  # meta buffers are rebuilt for real
    if model.sliding_rotary is not None:
        model.sliding_rotary = type(model.rotary)(model.config.sliding_rope_config(), max_model_len, device)
    model = model.to(device).eval()
    if model_device(model).type == "cpu":
        use_cpu_layout(model)
    return model


def checkpoint_state(
    model_dir: Path, cfg: ModelConfig, expected: set[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's parameter names, in dtype, refusing gaps and extras."""
    state = merge_projections(normalize_mtp_weights(language_model_weights(load_state_dict(model_dir), cfg), cfg))
    has_mtp = any(k.startswith(MTP_PREFIX) for k in state)
    if cfg.num_mtp_layers and not has_mtp:
        raise CheckpointError(f"config.json declares {cfg.num_mtp_layers} MTP layers but the checkpoint has none")
    missing = expected - set(state)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match {cfg.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return {k: folded_scalar(k, v, cfg).to(dtype) for k, v in state.items()}


def folded_scalar(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A tensor with the scalar its output is multiplied by folded in (Granite's): residual_multiplier into each
    block's o and down projections (their outputs are all it scales), 1 / logits_scaling into the final norm's weight
    (whose output only the LM head reads), so no pass pays for them; and a norm weight stored as an offset (Gemma's)
    made the factor it stands for."""
    if cfg.residual_multiplier != 1.0 and name.startswith(TRUNK_PREFIX) and name.endswith(RESIDUAL_OUTPUTS):
        return tensor.float() * cfg.residual_multiplier
    if cfg.logits_scaling != 1.0 and name == FINAL_NORM:
        return tensor.float() / cfg.logits_scaling
    if cfg.norm_weight_offset and name.endswith(NORM_WEIGHT):
        # Gemma's RMSNorm scales by (offset + weight), summed in float32 (exact where the model is float32)
        return tensor.float() + cfg.norm_weight_offset
    return tensor


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
