"""The building blocks of a Llama-family decoder layer, numerically matching Hugging Face's definitions.

Serving runs packed: x is [T, hidden], every sequence's new tokens one after another (services/worker/
forward_batch.py), and attention reads the paged KV cache in place. Training (no ForwardBatch) runs [B, L, hidden]
with causal self-attention. q/k/v and gate/up are single matmuls (HF's separate weights are merged at load:
model/weights.py), and the residual add is folded into the next RMSNorm, as fused serving stacks do, so a layer
is a handful of ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.forward_batch import ForwardBatch
from services.worker.model.config import ModelConfig
from services.worker.model.paged_attention import paged_attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual), the sum being the new residual."""
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        if dtype == torch.float32:
            normed = F.rms_norm(x, self.weight.shape, eps=self.eps) * self.weight
        else:  # HF normalises in float32 and scales in the model's dtype
            xf = x.float()
            normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return normed if residual is None else (normed, residual)


class Rotary(nn.Module):
    """Rotary position embedding in the half-split layout Hugging Face uses for Llama and Qwen2.

    cos and sin of every position are computed once (and again only when a longer context shows up), so a step
    looks them up instead of recomputing them per layer.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int = 0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin", torch.empty(0, 2, head_dim // 2), persistent=False)
        self._grow(max_positions)

    def _grow(self, num_positions: int) -> None:
        freqs = torch.arange(num_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        self.cos_sin = torch.stack((freqs.cos(), freqs.sin()), dim=1)  # [positions, 2, head_dim / 2]

    def forward(self, positions: torch.Tensor, num_positions: int) -> torch.Tensor:
        """cos and sin [..., 2, head_dim / 2] at positions (all below num_positions)."""
        if num_positions > self.cos_sin.shape[0]:
            self._grow(max(num_positions, 2 * self.cos_sin.shape[0]))
        return self.cos_sin[positions]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos_sin [..., 2, head_dim / 2] for the same leading dims."""
    cos, sin = cos_sin[..., None, 0, :], cos_sin[..., None, 1, :]
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))  # [..., heads + 2 kv_heads, head_dim]
        rotated = self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[..., :rotated, :], cos_sin)  # q and k rotate together: one set of ops
        q, k, v = qk[..., : self.num_heads, :], qk[..., self.num_heads :, :], qkv[..., rotated:, :]
        if batch is None:  # training: [B, L, heads, head_dim], each sequence attends to itself causally
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        else:  # serving: [T, heads, head_dim] against the paged cache
            batch.cache.write(self.layer_index, batch.slot_mapping, k, v)
            out = paged_attention(
                q, batch.cache.keys[self.layer_index], batch.cache.values[self.layer_index], batch.block_tables,
                batch.query_starts, batch.context_lens, self.scale, batch.max_query_len, batch.max_context_len,
                batch.first_position,
            )
        return self.o_proj(out.flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, batch: ForwardBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): their sum is the layer's hidden state."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
