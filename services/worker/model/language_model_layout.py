"""A vision-language checkpoint's language model, read alone.

Gemma 3 4B-27B (Gemma3ForConditionalGeneration) and Mistral Small 3.1 and 3.2 (Mistral3ForConditionalGeneration)
store their language model under `language_model.model.*` (transformers 5 writes `model.language_model.*`, its head
as `lm_head.*`) beside a vision tower and its projector. specmesh serves text, so it renames the language model's
tensors to a causal LM's and leaves the vision weights out; a request carrying an image is refused at the gateway as
for any model.
"""

from __future__ import annotations

import torch

from services.worker.model.config import VISION_LANGUAGE, ModelConfig

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# (the checkpoint's prefix, the causal LM's), tried in order
RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def language_model_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict of a vision-language checkpoint as its language model's alone; any other passes through."""
    if cfg.architecture not in VISION_LANGUAGE:
        return state
    text = {}
    for name, tensor in state.items():
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, renamed in RENAMES:
            if name.startswith(prefix):
                name = renamed + name[len(prefix):]
                break
        text[name] = tensor
    return text
