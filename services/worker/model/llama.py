"""A Llama-family causal LM (Llama, Qwen2) with optional multi-token-prediction (MTP) modules.

Parameter names follow Hugging Face's so checkpoints load as they are. MTP modules (DeepSeek-V3 style) live
under `model.mtp_layers.{i}.*`; DeepSeek- and MiMo-style checkpoints are renamed to that at load time
(model/mtp_layout.py); see docs/model.md. One module turns the trunk's hidden state
at position i and the embedding of token i+1 into a prediction of token i+2, sharing embedding and LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.engine.forward_batch import ForwardBatch
from services.worker.model.layers import DecoderLayer, RMSNorm, Rotary
from services.worker.model.plain_module import PlainModule


class MTPLayer(DecoderLayer):
    """A decoder block fed with [enorm(embed(next token)), hnorm(previous hidden)] projected back to hidden size."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, next_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(prev_hidden)), dim=-1))


class DecoderStack(PlainModule):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # MTP blocks use the KV-cache layers after the trunk's.
        self.mtp_layers = nn.ModuleList(
            MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(cfg.num_mtp_layers)
        )


class CausalLM(PlainModule):
    # Sums a row-parallel projection's partial results over tensor-parallel ranks; None: this model is whole.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, local: ModelConfig | None = None) -> None:
        """local: the config of this process's shard of a tensor-parallel model, whose modules are built from it
        (its heads, kv heads, intermediate rows and vocabulary slice: worker/tensor_parallel/shard.py); None: the
        whole model here. `config` stays the whole model's, what the engine sees."""
        super().__init__()
        self.config = cfg
        self.local_config = cfg if local is None else local
        self.model = DecoderStack(self.local_config)
        self.rotary = Rotary(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.local_config.vocab_size, bias=False)
        self.head_weight_t: torch.Tensor | None = None  # [hidden, vocab] when the CPU layout is in use

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers + self.config.num_mtp_layers

    def _rope(self, positions: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        num_positions = batch.max_context_len if batch is not None else int(positions.max()) + 1
        return self.rotary(positions, num_positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None = None
    ) -> torch.Tensor:
        """input_ids, positions [T] packed (serving, with a batch) or [B, L] (training) -> the last layer's hidden
        states [..., hidden], before the final norm."""
        cos_sin = self._rope(positions, batch)
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos_sin, batch)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> their embeddings [..., hidden]."""
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Trunk hidden states [..., hidden] -> logits [..., vocab] in float32."""
        return self._head(self.model.norm(hidden))

    def mtp_forward(
        self,
        index: int,
        prev_hidden: torch.Tensor,  # [..., hidden] hidden state at position i (trunk's or previous module's)
        next_ids: torch.Tensor,  # [...] token i+1
        positions: torch.Tensor,  # [...] position of token i+1
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """MTP module `index` -> its hidden states [..., hidden]; its logits predict token i+2."""
        layer = self.model.mtp_layers[index]
        x = layer.fuse(self.embed(next_ids), prev_hidden)
        x, residual = layer(x, None, self._rope(positions, batch), batch)
        return x + residual

    def mtp_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(self.model.mtp_layers[index].final_layernorm(hidden))

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        logits = normed @ self.head_weight_t if self.head_weight_t is not None else normed @ self.head_weight.T
        return logits if logits.dtype == torch.float32 else logits.float()
