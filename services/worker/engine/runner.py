"""Runs the model over packed batches against the block-paged KV cache. All model tensor code of the engine
lives here; the engine hands it token rows and gets hidden states back, one row per token."""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import ParamSpec, TypeVar

import torch

from services.worker.engine.cuda_graph import GraphRunner
from services.worker.engine.forward_batch import ForwardBatch, InputBuffers, pack, pack_host, to_device
from services.worker.engine.kv_cache import KVCache
from services.worker.model.flat_drafter import DRAFT_MODULE, FlatDrafter
from services.worker.model.flat_trunk import FlatTrunk
from services.worker.model.int8_linear import int8_twin
from services.worker.model.llama import CausalLM

P = ParamSpec("P")
R = TypeVar("R")


def inference(method: Callable[P, R]) -> Callable[P, R]:
    """The method under torch.inference_mode, entered only when the caller is not in it already: the engine loop
    runs in it, and entering it again costs a CPU decode step ~10 us a call."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return run


# An MTP module's entry at position p pairs the hidden state at p-1 with token p, so position 0 has none.
MTP_FIRST_POSITION = 1


class ModelRunner:
    # The leader of a tensor-parallel group records what the engine does to its cache, for its followers.
    cache_type: type[KVCache] = KVCache
    # Ready when a process that this runner's passes need dies (a tensor-parallel follower): the engine loop waits
    # on them beside its inbox, so that the death ends an idle engine too (check_alive says which).
    sentinels: tuple[int, ...] = ()

    def __init__(
        self,
        model: CausalLM,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        graph_query_lens: Seq[int] = (),
    ) -> None:
        """graph_query_lens: the rows per sequence of the passes captured as CUDA graphs (1 for decode, 1 + drafts
        for verify; services/worker/engine/cuda_graph.py); empty runs every pass eagerly."""
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.max_model_len = max_model_len
        self.buffers = InputBuffers(self.device)
        self.cache = self.cache_type(
            model.num_cache_layers, max_num_seqs, max_model_len, model.local_config.num_key_value_heads, cfg.head_dim,
            param.dtype, param.device, block_size, num_blocks,
            hidden_size=model.draft_feature_size,
        )
        # Routed experts are grouped by counts read on the host (model/moe.py), which a captured graph cannot do.
        self.graphs = (
            GraphRunner(model.forward, self.cache, max_num_seqs, graph_query_lens, capture=True)
            if graph_query_lens and not cfg.num_experts else None
        )
        # The CPU runs a dense trunk as one flat loop (model/flat_trunk.py); other devices, and routed experts, run
        # the modules.
        flat = self.device.type == "cpu" and not cfg.num_experts
        self.trunk = FlatTrunk(model, self.cache) if flat else model
        # The drafting layer (MTP module 0, or the EAGLE-3 head's) flattened the same way.
        drafts = cfg.num_mtp_layers or model.eagle3 is not None
        self.drafter = FlatDrafter(model, self.cache) if flat and drafts else None

    def check_alive(self) -> None:
        """Raises when a process this runner needs has died (tensor_parallel/errors.py: RankFailed)."""

    def pack(self, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int], first_position: int = 0) -> ForwardBatch:
        return pack(self.cache, rows, starts, slots, self.buffers, first_position)

    def quantize_drafting(self, whole_model: bool = False) -> None:
        """Builds the int8 twins (model/int8_linear.py) that drafting passes of greedy requests may ask for: the
        drafting layer's and its LM head's (MTP module or EAGLE-3 head), or, for a draft model (whole_model), every
        layer's and the LM head's. Only where the flat CPU passes run; the float weights stay."""
        model = self.model
        if whole_model:
            if isinstance(self.trunk, FlatTrunk):
                self.trunk.quantize()
            model.int8_head = int8_twin(model.head_weight_t.t()) if model.head_weight_t is not None else None
            return
        if self.drafter is not None:
            self.drafter.quantize()
        if model.eagle3 is not None:
            model.eagle3.int8_lm_head = int8_twin(model.eagle3.lm_head.weight_t.t())  # the CPU layout's
        elif model.head_weight_t is not None:
            model.int8_head = int8_twin(model.head_weight_t.t())

    @property
    def kv_position_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of one position of the whole model's cache: what a KV handoff carries, whatever the
        ranks it is split over here."""
        return self.cache.position_shape

    @inference
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks of the cache, every rank's heads: [blocks, layers, 2, block_size, kv_heads, head_dim]
        (KVCache.read_blocks' layout)."""
        return self.cache.read_blocks(blocks)

    @inference
    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Blocks read by read_blocks, here or on a worker split over another number of ranks, into these blocks."""
        self.cache.write_blocks(blocks, data)

    @inference
    def forward(
        self, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int], quantized: bool = False
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Feeds rows[b] at positions starts[b].. of slot slots[b]; returns the hidden states [T, hidden] of every
        token, packed (sequence b's rows are batch.host_query_starts[b]..), and the batch. quantized: through the
        flat trunk's int8 twins (a draft model's chain passes, quantize_drafting)."""
        host = pack_host(self.cache, rows, starts, slots)
        shape = self.graphs.shape_for(host) if self.graphs is not None else None
        if shape is not None:
            return self.graphs.run(host, shape)
        batch = to_device(self.cache, host, self.buffers)
        if isinstance(self.trunk, FlatTrunk):
            return self.trunk(batch.input_ids, batch.positions, batch, quantized), batch
        return self.trunk(batch.input_ids, batch.positions, batch), batch

    @inference
    def logits(self, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        return self.model.logits(hidden, quantized)

    @inference
    def draft_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """A trunk pass's rows -> what the MTP module or EAGLE-3 head pairs with the next token [T, feature]."""
        return self.model.draft_features(hidden)

    @inference
    def mtp_forward(
        self, index: int, prev_hidden: torch.Tensor, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int],
        quantized: bool = False,
    ) -> torch.Tensor:
        """MTP module `index` (or the EAGLE-3 head) over rows[b] at positions starts[b].., each token paired with its
        row of prev_hidden [T, feature] (the drafter's feature at the position before it, packed like the tokens);
        returns the module's hidden states [T, feature]. quantized: through the flat drafter's int8 twins (a chain
        pass of greedy requests, quantize_drafting)."""
        batch = self.pack(rows, starts, slots, first_position=MTP_FIRST_POSITION)
        if self.drafter is not None and index == DRAFT_MODULE:
            return self.drafter(prev_hidden, batch.input_ids, batch.positions, batch, quantized)
        return self.model.mtp_forward(index, prev_hidden, batch.input_ids, batch.positions, batch)

    @inference
    def mtp_logits(self, index: int, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        return self.model.mtp_logits(index, hidden, quantized)
