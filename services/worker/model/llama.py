"""A Llama-family causal LM (Llama, Qwen2) with optional multi-token-prediction (MTP) modules or an EAGLE-3 head.

Parameter names follow Hugging Face's so checkpoints load as they are. MTP modules (DeepSeek-V3 style) live
under `model.mtp_layers.{i}.*`; DeepSeek- and MiMo-style checkpoints are renamed to that at load time
(model/mtp_layout.py); see docs/model.md. One module turns the trunk's hidden state
at position i and the embedding of token i+1 into a prediction of token i+2, sharing embedding and LM head.
An EAGLE-3 head (model/eagle3.py), attached after loading, drafts the same way from features the trunk's pass
collects at three depths: with one attached, the pass returns them beside its last hidden state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.engine.forward_batch import ForwardBatch
from services.worker.model.eagle3 import Eagle3Head
from services.worker.model.layers import DecoderLayer, RMSNorm, Rotary, TokenEmbedding
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
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.hidden_size)
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
        # Gemma 3's sliding layers rotate with their own rope (DecoderLayer.sliding_rope); None: every layer alike
        self.sliding_rotary = Rotary(cfg.sliding_rope_config()) if cfg.sliding_rope_theta is not None else None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.local_config.vocab_size, bias=False)
        self.head_weight_t: torch.Tensor | None = None  # [hidden, vocab] when the CPU layout is in use
        # The LM head's int8 twin (model/int8_linear.py), which drafting logits may ask for: a draft model's, or the
        # one MTP modules draft with. The target's own logits never read it.
        self.int8_head: nn.Module | None = None
        # The EAGLE-3 head drafting for this model, and the layers whose inputs its features are made of, in order.
        self.eagle3: Eagle3Head | None = None
        self.feature_layers: tuple[int, ...] = ()

    @property
    def num_cache_layers(self) -> int:
        """The trunk's layers, then the MTP modules', then an EAGLE-3 head's."""
        return self.config.num_hidden_layers + self.config.num_mtp_layers + (self.eagle3 is not None)

    @property
    def eagle3_cache_layer(self) -> int:
        return self.config.num_hidden_layers + self.config.num_mtp_layers

    def attach_eagle3(self, head: Eagle3Head) -> None:
        """From now on every trunk pass also returns the head's input features (forward)."""
        self.eagle3 = head
        self.feature_layers = head.config.feature_layers
        self.freeze_lookups()

    @property
    def draft_feature_size(self) -> int | None:
        """The width of what a hidden-state drafter reads of the trunk (None: this model has no such drafter)."""
        if self.eagle3 is not None:
            return self.eagle3.config.layer.hidden_size
        return self.config.hidden_size if self.config.num_mtp_layers else None

    def _rope(self, positions: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        return self.rotary(positions, _num_positions(positions, batch))

    def ropes(self, positions: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at positions for (the full layers, the sliding layers), looked up once per pass."""
        cos_sin = self.rotary(positions, num_positions)
        return cos_sin, cos_sin if self.sliding_rotary is None else self.sliding_rotary(positions, num_positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] packed (serving, with a batch) or [B, L] (training) -> the last layer's hidden
        states [..., hidden], before the final norm; with an EAGLE-3 head attached, followed by the inputs of its
        feature layers: [..., 4 * hidden] (logits and draft_features read their parts). attention_mask: training
        only, [L, L] bool, which positions each row sees (None: causal; a parallel draft model's training rows)."""
        ropes = self.ropes(positions, _num_positions(positions, batch))
        x, residual = self.embed(input_ids), None
        layer_inputs = {}
        for index, layer in enumerate(self.model.layers):
            if index in self.feature_layers:
                layer_inputs[index] = x if residual is None else x + residual
            x, residual = layer(x, residual, ropes[layer.sliding_rope], batch, attention_mask)
        if not self.feature_layers:
            return x + residual
        return torch.cat([x + residual, *(layer_inputs[i] for i in self.feature_layers)], dim=-1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> their embeddings [..., hidden] (times Granite's embedding_multiplier)."""
        return scaled_embedding(F.embedding(input_ids, self.model.embed_tokens.weight), self.config)

    def logits(self, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        """Trunk hidden states [..., hidden] (or forward's wider rows) -> logits [..., vocab] in float32 (quantized: a
        draft model's, through the head's int8 twin when it has one)."""
        width = self.config.hidden_size
        if hidden.shape[-1] != width:
            hidden = hidden[..., :width].contiguous()
        return self._head(self.model.norm(hidden), quantized)

    def draft_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Trunk rows as forward returns them -> what a hidden-state drafter pairs with the next token: the last
        hidden state for MTP, the EAGLE-3 head's features g [..., head hidden]."""
        if self.eagle3 is None:
            return hidden
        return self.eagle3.features(hidden[..., self.config.hidden_size :])

    def mtp_forward(
        self,
        index: int,
        prev_hidden: torch.Tensor,  # [..., hidden] hidden state at position i (trunk's or previous module's)
        next_ids: torch.Tensor,  # [...] token i+1
        positions: torch.Tensor,  # [...] position of token i+1
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """MTP module `index` (or the EAGLE-3 head) -> its hidden states [..., hidden]; its logits predict token i+2."""
        if self.eagle3 is not None:
            own = self.eagle3.embed_tokens
            embeds = F.embedding(next_ids, own.weight) if own is not None else self.embed(next_ids)
            return self.eagle3(prev_hidden, embeds, positions, batch)
        layer = self.model.mtp_layers[index]
        x = layer.fuse(self.embed(next_ids), prev_hidden)
        x, residual = layer(x, None, self._rope(positions, batch), batch)
        return x + residual

    def mtp_logits(self, index: int, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        if self.eagle3 is not None:
            return self.eagle3.logits(hidden, quantized)
        return self._head(self.model.mtp_layers[index].final_layernorm(hidden), quantized)

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def _head(self, normed: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        if quantized and self.int8_head is not None:
            logits = self.int8_head(normed)
        elif self.head_weight_t is not None:
            logits = normed @ self.head_weight_t
        else:
            logits = normed @ self.head_weight.T
        return logits if logits.dtype == torch.float32 else logits.float()


def _num_positions(positions: torch.Tensor, batch: ForwardBatch | None) -> int:
    """The rope table's rows a pass reads: a serving batch's longest context, or a training batch's last position."""
    return batch.max_context_len if batch is not None else int(positions.max()) + 1


def scaled_embedding(embeds: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Looked-up embeddings times the config's embedding_multiplier (Granite's, Gemma's sqrt(hidden_size); 1
    elsewhere, where nothing is paid). Not folded into the table: a tied LM head reads it unscaled."""
    if cfg.embedding_multiplier == 1.0:
        return embeds
    if cfg.embedding_multiplier_in_model_dtype:
        return embeds * _in_dtype(cfg.embedding_multiplier, embeds.dtype)
    return embeds * cfg.embedding_multiplier


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype: a scalar transformers holds in a tensor of the model's dtype (34.0 for Gemma 3 1B's
    sqrt(1152) in bfloat16), as a Python float, which scales as that tensor does."""
    return float(torch.tensor(value, dtype=dtype))
