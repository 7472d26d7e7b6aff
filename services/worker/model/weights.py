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
_GROUPS = ((ATTENTION_PARTS, ATTENTION_MERGED), (MLP_PARTS, MLP_MERGED))
_KINDS = ("weight", "bias")


def merge_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> merged names (a routed expert's gate/up as a dense MLP's); other entries pass through."""
    merged = dict(state)
    for key in state:
        for parts, name in _GROUPS:
            for kind in _KINDS:
                suffix = f".{parts[0]}.{kind}"
                if key.endswith(suffix):
                    prefix = key[: -len(suffix)] + "."
                    merged[f"{prefix}{name}.{kind}"] = torch.cat([merged.pop(f"{prefix}{p}.{kind}") for p in parts])
    return merged


def split_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Merged names -> HF names, the inverse of merge_projections."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    split = {}
    for key, value in state.items():
        for parts, name in _GROUPS:
            head, sep, kind = key.rpartition(f".{name}.")
            if sep:
                # gate/up halves: a dense MLP's or a routed expert's, whose intermediate size differs
                pieces = value.split((q_size, kv_size, kv_size)) if name == ATTENTION_MERGED else value.chunk(2)
                split.update({f"{head}.{p}.{kind}": t for p, t in zip(parts, pieces)})
                break
        else:
            split[key] = value
    return split
