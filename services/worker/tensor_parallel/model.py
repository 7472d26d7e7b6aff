"""One rank's shard of a tensor-parallel model: the model's modules at the shard's sizes (shard.py), with the
group's collectives where the split needs them.

The modules run unchanged on their slices: attention over this rank's heads against this rank's KV cache (its kv
heads), the MLP (and each routed expert) over its intermediate rows. What changes: o and down (or a layer of
experts as a whole) are wrapped to all-reduce their partial sums, the embedding looks up this rank's vocabulary
slice and all-reduces, and the LM head computes this rank's slice of the logits, gathered whole on the leader.
The CPU's flat trunk (model/flat_trunk.py) reads the same weights and the model's embed and all_reduce, so it
runs sharded too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.dummy import dummy_state_dict
from services.worker.model.llama import CausalLM, scaled_embedding
from services.worker.model.loader import checkpoint_state, place, served_config
from services.worker.model.moe import SparseMoE
from services.worker.model.plain_module import PlainModule
from services.worker.tensor_parallel.group import TensorParallelGroup
from services.worker.tensor_parallel.divisible import shard_config
from services.worker.tensor_parallel.shard import shard_state


class RowParallel(PlainModule):
    """A projection whose input is split over the ranks, or a block of experts each split so: its partial results
    are summed across them."""

    def __init__(self, projection: torch.nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.projection = projection
        self.group = group

    @property
    def weight_t(self) -> torch.Tensor:
        """The projection's [in / ranks, out] weight, which the flat trunk multiplies by itself."""
        return self.projection.weight_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.projection(x))


class ShardedCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, group: TensorParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__(cfg, shard_config(cfg, group.size, group.rank, expert_parallel))
        self.group = group

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.group.embed(input_ids, self.model.embed_tokens.weight), self.config)

    def _head(self, normed: torch.Tensor, quantized: bool = False) -> torch.Tensor | None:
        """-> the whole [..., vocab] logits in float32 on the leader; None on the other ranks."""
        weight_t = self.head_weight_t if self.head_weight_t is not None else self.head_weight.T
        logits = self.group.gather_vocab(normed @ weight_t)  # [..., vocab]
        return None if logits is None else logits.float()

    def wrap_row_parallel(self) -> None:
        """o and down of every decoder block (trunk and MTP) sum their partial results over the group; a layer of
        routed experts sums its weighted experts' outputs once, not once an expert."""
        for layer in (*self.model.layers, *self.model.mtp_layers):
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, self.group)
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp = RowParallel(layer.mlp, self.group)
            else:
                layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, self.group)


def load_shard(
    model_dir: Path, dtype: torch.dtype, device: str, load_format: str, max_model_len: int | None,
    group: TensorParallelGroup, expert_parallel: bool = False,
) -> ShardedCausalLM:
    """This rank's shard of the checkpoint's model on `device`; with load_format "dummy", random weights drawn
    for the shard alone (noise either way: only speed means anything with them). expert_parallel: its routed
    experts whole, a run of them."""
    model_dir = Path(model_dir)
    cfg = served_config(model_dir, load_format, max_model_len)
    with torch.device("meta"):
        model = ShardedCausalLM(cfg, group, expert_parallel)
    if load_format == "dummy":
        state = dummy_state_dict(model, dtype, device)
    else:
        with torch.device("meta"):
            names = set(CausalLM(cfg).state_dict())
        state = shard_state(
            checkpoint_state(model_dir, cfg, names, dtype), cfg, group.rank, group.size, expert_parallel
        )
    model = place(model, state, device, max_model_len)
    model.wrap_row_parallel()
    model.freeze_lookups()
    return model
