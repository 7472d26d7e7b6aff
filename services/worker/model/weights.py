"""Between Hugging Face's parameter names and the model's merged projections.

Checkpoints store q/k/v and gate/up as separate matrices; the model runs each group as one matmul (one read of
the input, one launch). Loading concatenates them along the output dimension, saving splits them back, so the
files stay loadable by transformers.
"""

from __future__ import annotations

import torch

from services.worker.model.config import ModelConfig

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
ATTENTION_MERGED = "qkv_proj"
MLP_PARTS = ("gate_proj", "up_proj")
MLP_MERGED = "gate_up_proj"
_GROUPS = ((".self_attn.", ATTENTION_PARTS, ATTENTION_MERGED), (".mlp.", MLP_PARTS, MLP_MERGED))
_KINDS = ("weight", "bias")


def merge_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> merged names; other entries pass through."""
    merged = dict(state)
    for key in state:
        for infix, parts, name in _GROUPS:
            for kind in _KINDS:
                suffix = f"{infix}{parts[0]}.{kind}"
                if key.endswith(suffix):
                    prefix = key[: -len(suffix)] + infix
                    merged[f"{prefix}{name}.{kind}"] = torch.cat([merged.pop(f"{prefix}{p}.{kind}") for p in parts])
    return merged


def split_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Merged names -> HF names, the inverse of merge_projections."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    sizes = {ATTENTION_MERGED: (q_size, kv_size, kv_size), MLP_MERGED: (cfg.intermediate_size,) * 2}
    split = {}
    for key, value in state.items():
        for infix, parts, name in _GROUPS:
            head, sep, kind = key.rpartition(f"{infix}{name}.")
            if sep:
                split.update({f"{head}{infix}{p}.{kind}": t for p, t in zip(parts, value.split(sizes[name]))})
                break
        else:
            split[key] = value
    return split
