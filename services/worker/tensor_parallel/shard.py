"""How a checkpoint is cut into tensor-parallel shards (Megatron-style), and the shape of one shard.

Column-parallel (outputs split, no communication): q/k/v by heads, gate/up by intermediate rows; each rank keeps
its heads' queries, keys and values and their biases, and its slice of the gate and of the up projection.
Row-parallel (inputs split, partial sums all-reduced): o by the heads it reads, down by the intermediate rows it
reads. A routed expert is a gated MLP cut the same way, so every rank holds a slice of every expert and routes as
the others do (the router is replicated): the experts' weighted outputs are partial sums, all-reduced once for the
layer. Vocab-parallel: the embedding and the LM head by vocabulary rows. Norms, the rotary table and the MTP
module's fusion projection (eh_proj: two hidden states in, one out, a sliver of the module's work) are
replicated. The MTP module's decoder block is cut as the trunk's.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.weights import ATTENTION_MERGED, MLP_MERGED
from services.worker.tensor_parallel.divisible import ShardingError, check_shardable, shard_config

QKV = f".self_attn.{ATTENTION_MERGED}."
# a dense MLP's (.mlp.gate_up_proj) or a routed expert's (.mlp.experts.<i>.gate_up_proj)
GATE_UP = f".{MLP_MERGED}."
O_WEIGHT = ".self_attn.o_proj.weight"
DOWN_WEIGHT = ".down_proj.weight"
VOCAB_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")  # a routed expert's tensor, and its index


def _rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's equal slice of dim 0."""
    return tensor.chunk(size)[rank]


def _qkv(tensor: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """[(heads + 2 kv_heads) * head_dim, ...] -> this rank's heads of q, then of k, then of v."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    q, k, v = tensor.split((q_size, kv_size, kv_size))
    return torch.cat([_rows(part, rank, size) for part in (q, k, v)])


def _vocab_rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[vocab, hidden] -> rank's rows, the last slice padded with zero rows to the others' length."""
    per_rank = -(-tensor.shape[0] // size)
    piece = tensor[rank * per_rank : (rank + 1) * per_rank]
    if piece.shape[0] == per_rank:
        return piece
    pad = piece.new_zeros(per_rank - piece.shape[0], *piece.shape[1:])
    return torch.cat([piece, pad])


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False
) -> dict[str, torch.Tensor]:
    """The merged-name state dict (model/weights.py) of the whole model -> rank's shard of it, each tensor a copy
    (the whole model's can be freed). expert_parallel: rank's run of routed experts whole, the others left out."""
    check_shardable(cfg, size, expert_parallel)
    local = shard_config(cfg, size, rank, expert_parallel).local_experts
    shard = {}
    for name, tensor in state.items():
        expert = EXPERT.search(name)
        if expert is not None and local is not None:
            if int(expert.group(1)) in local:
                shard[name] = tensor.clone()
            continue
        if name in VOCAB_WEIGHTS:
            shard[name] = _vocab_rows(tensor, rank, size).clone()
        else:
            shard[name] = _layer_piece(name, tensor, cfg, rank, size).clone()
    return shard


def _layer_piece(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank's piece of a decoder layer's tensor (q/k/v and gate/up by rows, o and down by the rows they read); any
    other tensor whole."""
    if QKV in name:
        return _qkv(tensor, cfg, rank, size)
    if GATE_UP in name:
        gate, up = tensor.chunk(2)
        return torch.cat([_rows(gate, rank, size), _rows(up, rank, size)])
    if name.endswith((O_WEIGHT, DOWN_WEIGHT)):
        return tensor.chunk(size, dim=1)[rank]
    return tensor


def head_layer_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """An EAGLE-3 head's decoder layer on one rank, cut as a trunk layer is (shard_config); the vocabulary whole (the
    head maps its draft vocabulary onto the target's, and its own embedding, if any, is replicated)."""
    check_head_shardable(cfg, size)
    return dataclasses.replace(shard_config(cfg, size), vocab_size=cfg.vocab_size)


def check_head_shardable(cfg: ModelConfig, size: int) -> None:
    """An EAGLE-3 head's layer must split as the trunk's do (its kv heads are the target's, checked on load)."""
    for name, count in (("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size)):
        if count % size:
            raise ShardingError(f"--tensor-parallel-size {size} must divide the EAGLE-3 head's {name} ({count})")


def shard_head_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's state (Eagle3Head's names) -> rank's: its decoder layer cut as a trunk layer is (q/k/v and
    gate/up by rows, o and down by the rows they read); fc, the norms, lm_head, d2t and an own embedding whole."""
    return {name: _layer_piece(name, tensor, cfg, rank, size).clone() for name, tensor in state.items()}
