"""Runs the model over a ragged batch against the block-paged KV cache. All tensor code of the engine lives here."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from services.worker.kv_cache import KVCache
from services.worker.model.layers import AttentionBatch
from services.worker.model.llama import CausalLM

# An MTP module's entry at position p pairs the hidden state at p-1 with token p, so position 0 has none.
MTP_FIRST_POSITION = 1


class ModelRunner:
    def __init__(
        self, model: CausalLM, max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.max_model_len = max_model_len
        self.cache = KVCache(
            model.num_cache_layers, max_num_seqs, max_model_len, cfg.num_key_value_heads, cfg.head_dim,
            param.dtype, param.device, block_size, num_blocks,
        )

    def _batch(
        self, tokens: Seq[Seq[int]], starts: Seq[int], slots: Seq[int], first_position: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Padded ids and positions [B, L] and where they live in the cache.

        Padding tokens repeat the row's last position and write to the cache's padding slot, so they never
        disturb a live sequence. Keys before first_position are masked out.
        """
        batch_size, length = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(batch_size, length, dtype=torch.long)
        positions = torch.zeros(batch_size, length, dtype=torch.long)
        write_slots = torch.full((batch_size, length), self.cache.padding_slot, dtype=torch.long)
        for b, (row, start, slot) in enumerate(zip(tokens, starts, slots)):
            n = len(row)
            ids[b, :n] = torch.tensor(row)
            positions[b, :n] = torch.arange(start, start + n)
            positions[b, n:] = start + n - 1
            write_slots[b, :n] = slot
        context_len = int(positions.max()) + 1
        if context_len > self.max_model_len:
            raise ValueError(f"position {context_len - 1} is past max_model_len {self.max_model_len}")
        keys = torch.arange(context_len)[None, None, None, :]
        mask = (keys <= positions[:, None, :, None]) & (keys >= first_position)  # [B, 1, L, C]
        ids, positions, write_slots, mask = (t.to(self.device) for t in (ids, positions, write_slots, mask))
        batch = AttentionBatch(
            self.cache, write_slots, positions, torch.tensor(list(slots), device=self.device), mask, context_len
        )
        return ids, positions, batch

    @torch.inference_mode()
    def forward(self, tokens: Seq[Seq[int]], starts: Seq[int], slots: Seq[int]) -> torch.Tensor:
        """Feeds tokens[b] at positions starts[b].. of slot slots[b]; returns hidden states [B, L, hidden].

        Rows are padded to the longest; callers read only real rows.
        """
        ids, positions, batch = self._batch(tokens, starts, slots)
        return self.model(ids, positions, batch)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @torch.inference_mode()
    def mtp_forward(
        self, index: int, prev_hidden: torch.Tensor, tokens: Seq[Seq[int]], starts: Seq[int], slots: Seq[int]
    ) -> torch.Tensor:
        """MTP module `index` over tokens[b] at positions starts[b].., each paired with prev_hidden[b, j], the
        hidden state at the position before it; returns the module's hidden states [B, L, hidden].

        prev_hidden is [B, L', hidden] with L' >= the longest row; its rows past a row's length are ignored.
        """
        ids, positions, batch = self._batch(tokens, starts, slots, first_position=MTP_FIRST_POSITION)
        return self.model.mtp_forward(index, prev_hidden[:, : ids.shape[1]], ids, positions, batch)

    @torch.inference_mode()
    def mtp_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_logits(index, hidden)
