"""eagle3: an EAGLE-3 head (model/eagle3.py) drafts from the target's features. Loading it, and its place.

The head is read from its own directory (the speculative config's `model`, or `<model>-eagle3` beside the target,
where `specmesh demo-model` ships the demo model's) and attached to the target model, whose trunk passes then return
the head's features too. Drafting itself is the MTP drafter's (drafting/mtp.py): the head pairs a feature at p-1
with the token at p exactly as an MTP module pairs a hidden state, keeps its KV entries in a cache layer of its own
with the target's block tables, and draws each draft from its q under the request's sampling.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from services.worker.drafting.checkpoints import default_eagle3_dir
from services.worker.model.dummy import dummy_state_dict
from services.worker.model.eagle3 import D2T, T2D, Eagle3Config, Eagle3Head
from services.worker.model.layers import Rotary
from services.worker.model.llama import CausalLM
from services.worker.model.loader import CheckpointError, load_state_dict
from services.worker.model.transposed import transpose_projections
from services.worker.model.weights import merge_projections
from services.worker.tensor_parallel.model import RowParallel
from services.worker.tensor_parallel.shard import head_layer_config, shard_head_state
from shared.config import EngineConfig

OWN_EMBEDDING = "embed_tokens.weight"  # present when the head does not read the target's embedding
# Some exporters (vLLM-style) name the decoder layer as a model's first layer.
_LAYER_ALIASES = ("model.layers.0.", "layers.0.")
_LAYER = "midlayer."


def _published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's tensors under Eagle3Head's names: the layer as `midlayer.`, q/k/v and gate/up merged, t2d (a
    trainer's table) dropped, a `model.` prefix on the rest removed."""
    named = {}
    for key, tensor in state.items():
        if key == T2D:
            continue
        for alias in _LAYER_ALIASES:
            if key.startswith(alias):
                key = _LAYER + key[len(alias) :]
        named[key.removeprefix("model.")] = tensor
    return merge_projections(named)


def load_eagle3_head(head_dir: Path, target: CausalLM, dtype: torch.dtype, load_format: str,
                     max_model_len: int | None) -> Eagle3Head:
    """The head in head_dir for `target`, on the target's device and in its layout; every tensor checked. For a
    target split over tensor-parallel ranks, this rank's shard of the head (tensor_parallel/shard.py)."""
    head_dir = Path(head_dir)
    cfg = Eagle3Config.from_dir(head_dir, target.config)
    state = _published_names(load_state_dict(head_dir)) if load_format != "dummy" else {}
    device = next(target.parameters()).device
    group = getattr(target, "group", None)
    if group is not None:
        state = shard_head_state(state, cfg.layer, group.rank, group.size)
        cfg = dataclasses.replace(cfg, layer=head_layer_config(cfg.layer, group.size))
    with torch.device("meta"):
        head = Eagle3Head(cfg, target.eagle3_cache_layer, own_embedding=OWN_EMBEDDING in state)
    if load_format == "dummy":
        state = dummy_state_dict(head, dtype, device) | {D2T: torch.zeros(cfg.draft_vocab_size, dtype=torch.long)}
    expected = set(head.state_dict())
    if cfg.draft_vocab_size == cfg.layer.vocab_size:
        state.setdefault(D2T, torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # the identity map
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"EAGLE-3 head {head_dir}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if state[D2T].shape != (cfg.draft_vocab_size,):
        raise CheckpointError(f"d2t has shape {tuple(state[D2T].shape)}, draft_vocab_size is {cfg.draft_vocab_size}")
    state = {k: v.to(torch.long) if k == D2T else v.to(dtype) for k, v in state.items()}
    head.load_state_dict(state, assign=True)
    head.rotary = Rotary(cfg.layer, max_model_len, device)
    head = head.to(device).eval()
    if device.type == "cpu":
        transpose_projections(head)
    if group is not None:  # o and down read this rank's heads and rows: their partial sums add up over the group
        attention, mlp = head.midlayer.self_attn, head.midlayer.mlp
        attention.o_proj, mlp.down_proj = RowParallel(attention.o_proj, group), RowParallel(mlp.down_proj, group)
    head.map_vocabulary()
    head.freeze_lookups()
    return head


def attach_eagle3(config: EngineConfig, target: CausalLM) -> None:
    """Under method eagle3, loads its head (the speculative config's `model`, or the one shipped beside the target)
    onto `target` (whole, or this rank's shard), before its runner sizes the KV cache (the head has a layer of its
    own); under any other method, nothing."""
    if config.speculative.method != "eagle3":
        return
    path = config.speculative.model or default_eagle3_dir(config.model)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f'speculative method "eagle3" needs an EAGLE-3 head: {path} has none (name one with "model" in '
            "--speculative-config)"
        )
    head = load_eagle3_head(path, target, getattr(torch, config.dtype), config.load_format, config.max_model_len)
    target.attach_eagle3(head)
