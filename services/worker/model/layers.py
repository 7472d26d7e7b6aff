"""The building blocks of a Llama-family decoder layer, numerically matching Hugging Face's definitions.

Serving runs packed: x is [T, hidden], every sequence's new tokens one after another (services/worker/
forward_batch.py), and attention reads the paged KV cache in place. Training (no ForwardBatch) runs [B, L, hidden]
with causal self-attention. q/k/v and gate/up are single matmuls (HF's separate weights are merged at load:
model/weights.py), and the residual add is folded into the next RMSNorm, as fused serving stacks do, so a layer
is a handful of ops. The elementwise ones (norm, rotary, activation, KV write) dispatch to fused Triton kernels on
CUDA and run their torch twins elsewhere (model/rms_norm.py, rotary_apply.py, gated_activation.py,
worker/engine/kv_write.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.forward_batch import ForwardBatch
from services.worker.model.config import ModelConfig, UnsupportedModelError
from services.worker.model.moe import SparseMoE
from services.worker.model.paged_attention import paged_attention
from services.worker.model.plain_module import PlainModule
from services.worker.model.rms_norm import rms_norm
from services.worker.model.rope import rope_frequencies
from services.worker.model.rotary_apply import apply_rotary
from services.worker.model.gated_activation import gated_activation


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that leaves a weight on the meta device unfilled. The loader builds models there and assigns
    the checkpoint's tensors; torch fills a meta weight through its Python reference of normal_, whose first call
    imports torch._dynamo: a second of every worker's start, for noise nobody reads."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(PlainModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual), the sum being the new residual."""
        return rms_norm(x, self.weight, self.eps, residual)


class Rotary(PlainModule):
    """Rotary position embedding in the half-split layout Hugging Face uses for Llama and Qwen2.

    cos and sin of every position are computed once (and again only when a longer context shows up), so a step
    looks them up instead of recomputing them per layer. The frequencies and the scale of cos and sin follow the
    config's rope type (model/rope.py).

    The table starts with num_positions rows (default: max_position_embeddings): an engine passes its
    max_model_len, the most it serves, since a Llama-3.x table of 131,072 positions is 64 MB of float32. It is
    built on `device` as transformers builds its cos and sin, from inverse frequencies computed on the host, in
    the layout the device's rotation reads (model/rotary_apply.py): half width for the CUDA kernel, full width
    with the sign of sin folded in elsewhere, so that a CPU rotation is four torch ops.
    """

    def __init__(
        self, cfg: ModelConfig, num_positions: int | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(cfg)  # [head_dim / 2], a factor on cos and sin
        self.position_limit = cfg.rope_position_limit
        device = torch.empty(0).device if device is None else device  # the default, `with torch.device` included
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.full_width = self.inv_freq.device.type != "cuda"
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        if not self.inv_freq.is_meta:  # a model built on the meta device gets its table where its weights land
            self._grow(cfg.max_position_embeddings if num_positions is None else num_positions)

    def _grow(self, num_positions: int) -> None:
        freqs = torch.arange(num_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        if self.full_width:  # [positions, 2, 1, head_dim]: cos|cos and -sin|sin
            self.cos_sin = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)[:, :, None]
        else:  # [positions, 2, head_dim / 2]
            self.cos_sin = torch.stack((cos, sin), dim=1)

    def forward(self, positions: torch.Tensor, num_positions: int) -> torch.Tensor:
        """cos and sin at positions (all below num_positions): [..., 2, head_dim / 2], or [..., 2, 1, head_dim]
        when full width."""
        if num_positions > self.cos_sin.shape[0]:
            if self.position_limit is not None and num_positions > self.position_limit:
                raise UnsupportedModelError(
                    f"rope_type 'dynamic' is served up to {self.position_limit} positions, not {num_positions}"
                )
            self._grow(max(num_positions, 2 * self.cos_sin.shape[0]))
        return self.cos_sin[positions]


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool: query i sees keys i - window < j <= i (a causal mask when window >= length)."""
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)
    return (distance >= 0) & (distance < window)


def normed_heads(
    qk: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, norm=rms_norm
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of queries and keys: qk [..., heads + kv_heads, head_dim] -> the same, normed, new.
    Every head is a row of head_dim, as the fused kernel normalises rows (norm: rms_norm, or its twin)."""
    q, k = qk.narrow(-2, 0, num_heads), qk.narrow(-2, num_heads, qk.shape[-2] - num_heads)
    head_dim = qk.shape[-1]
    q = norm(q.reshape(-1, head_dim), q_weight, eps).view(q.shape)
    k = norm(k.reshape(-1, head_dim), k_weight, eps).view(k.shape)
    return torch.cat((q, k), dim=-2)


class Attention(PlainModule):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.window = cfg.layer_window(layer_index)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, batch: ForwardBatch | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """attention_mask: training only, [L, L] bool, which keys each query sees (None: causal)."""
        qkv = self.qkv_proj(x).view(*x.shape[:-1], -1, self.head_dim)  # [..., heads + 2 kv_heads, head_dim]
        rotated = self.num_heads + self.num_kv_heads
        qk = qkv.narrow(-2, 0, rotated)
        if self.qk_norm:
            qk = normed_heads(qk, self.num_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos_sin)  # q and k rotate together (in place on CUDA)
        q, k = qk.narrow(-2, 0, self.num_heads), qk.narrow(-2, self.num_heads, self.num_kv_heads)
        v = qkv.narrow(-2, rotated, self.num_kv_heads)
        if batch is None:  # training: [B, L, heads, head_dim], each sequence attends to itself causally
            if attention_mask is None and self.window is not None:
                attention_mask = window_mask(q.shape[-3], self.window, q.device)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=attention_mask is None,
                attn_mask=attention_mask, enable_gqa=True, scale=self.scale,
            ).transpose(1, 2)
        else:  # serving: [T, heads, head_dim] against the paged cache
            batch.cache.write(self.layer_index, batch.slot_mapping, k, v)
            out = paged_attention(
                q, batch.cache.keys[self.layer_index], batch.cache.values[self.layer_index], batch.block_tables,
                batch.query_starts, batch.context_lens, self.scale, batch.max_query_len, batch.max_context_len,
                batch.first_position, batch.cache.block_size, batch.attention_spans, batch.cache.region_len,
                self.window,
            )
        return self.o_proj(out.flatten(-2))


class MLP(PlainModule):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """intermediate_size: the config's (None), or a routed expert's."""
        super().__init__()
        size = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)
        self.act_and_mul = gated_activation(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(PlainModule):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        # Llama's norm before the MLP; with sandwich norms (Gemma's), the norm of the attention's output, and
        # pre_feedforward_layernorm the one before the MLP
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, MLP) if cfg.is_sparse_layer(layer_index) else MLP(cfg)
        self.sandwich_norms = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding_rope = cfg.uses_sliding_rope(layer_index)  # rotates with CausalLM's sliding_rotary

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, batch: ForwardBatch | None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): their sum is the layer's hidden state.
        attention_mask: training only (Attention.forward)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, batch, attention_mask)
        if not self.sandwich_norms:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual
