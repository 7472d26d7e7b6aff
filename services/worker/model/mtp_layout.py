"""Maps the MTP weight layouts of published checkpoints onto specmesh's `model.mtp_layers.{i}.*` names.

Three layouts hold the same module (a fusion of the embedding of token t+1 with the hidden state at t, one
decoder block, a final norm before the shared LM head); docs/model.md lists their names:

- specmesh's own (the demo model): `model.mtp_layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}`;
- DeepSeek-V3 style: `model.layers.{num_hidden_layers + i}.{enorm,hnorm,eh_proj,shared_head.norm}`, with
  copies of the embedding and LM head that must equal the shared ones;
- MiMo style: `model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`, where
  input_proj reads [hidden, embedding] rather than [embedding, hidden]: its column halves are swapped here,
  so one module computes every layout and the same weights give the same drafts.
"""

from __future__ import annotations

import re

import torch

from services.worker.model.config import ModelConfig

MTP_PREFIX = "model.mtp_layers."
_DEEPSEEK_RENAMES = {"shared_head.norm.weight": "final_layernorm.weight"}
# DeepSeek-V3 stores the shared embedding and LM head again with each module; name -> the shared tensor.
_DEEPSEEK_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_MIMO_RENAMES = {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight"}
_MIMO_PROJ = "input_proj.weight"


class MtpLayoutError(ValueError):
    pass


def _shared(state: dict[str, torch.Tensor], name: str, cfg: ModelConfig) -> torch.Tensor:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    return state[name]


def _from_deepseek(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = re.match(r"model\.layers\.(\d+)\.(.+)", key)
        index = int(match.group(1)) - cfg.num_hidden_layers if match else -1
        if not 0 <= index < cfg.num_mtp_layers:
            out[key] = tensor
            continue
        name = match.group(2)
        if name in _DEEPSEEK_COPIES:
            if not torch.equal(tensor, _shared(state, _DEEPSEEK_COPIES[name], cfg)):
                raise MtpLayoutError(f"{key} differs from {_DEEPSEEK_COPIES[name]}: MTP modules must share them")
            continue
        out[f"{MTP_PREFIX}{index}.{_DEEPSEEK_RENAMES.get(name, name)}"] = tensor
    return out


def _from_mimo(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = re.match(r"(model\.mtp_layers\.\d+\.)(.+)", key)
        name = match.group(2) if match else None
        if name in _MIMO_RENAMES:
            out[match.group(1) + _MIMO_RENAMES[name]] = tensor
        elif name == _MIMO_PROJ:
            hidden_part, embed_part = tensor.split(cfg.hidden_size, dim=1)
            out[match.group(1) + "eh_proj.weight"] = torch.cat([embed_part, hidden_part], dim=1)
        else:
            out[key] = tensor
    return out


def normalize_mtp_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict with MTP tensors of any known layout renamed to `model.mtp_layers.{i}.*`."""
    return _from_mimo(_from_deepseek(state, cfg), cfg)
