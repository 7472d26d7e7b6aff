"""The trunk's serving pass on the CPU, flattened: one loop over per-layer weights read out of the modules once.

On a small CPU, a decode step is a few hundred tiny ops and the framework around each costs as much as the op,
more so because streaming the weights through the caches evicts the interpreter's and the dispatcher's own state
every step. The module tree (model/layers.py) keeps the parameters, loads checkpoints, trains, and runs on CUDA,
where CUDA graphs remove that overhead; here the same arithmetic runs as one function with no module calls, no
per-op device dispatch and no per-layer planning: the attention plan is made once per pass (plan_cpu_attention:
a few calls over runs of the slots' home regions for decode or verify rows of sequences sitting in them, one call
per sequence, or gathered), the rotary angles looked up once, the KV pools built once. The ops and their order are
the modules', so the output is the same bit for bit (tests/test_flat_trunk.py); ~10% of a demo-model decode step
on one thread (1.72 -> 1.55 ms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from services.worker.engine.forward_batch import ForwardBatch
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.kv_write import write_kv_torch
from services.worker.model.int8_linear import Int8Linear, int8_twin
from services.worker.model.llama import CausalLM
from services.worker.model.layers import DecoderLayer, normed_heads
from services.worker.model.home_pass import HomePass, attend_home_pass
from services.worker.model.paged_attention import (
    attend_gathered,
    attend_per_sequence,
    cutting_window,
    plan_cpu_attention,
)
from services.worker.model.sequence_spans import Pool
from services.worker.model.rms_norm import rms_norm_torch
from services.worker.model.rotary_apply import apply_rotary_full
from services.worker.model.gated_activation import GatedActivation, gated_activation_torch, silu_and_mul_torch


# A projection as the flat pass applies it: a weight stored transposed [in, out] (model/transposed.py), multiplied
# by, or a drafter's int8 twin of one (model/int8_linear.py), called.
Projection = Tensor | Int8Linear


def project(x: Tensor, weight: Projection) -> Tensor:
    return x @ weight if isinstance(weight, Tensor) else weight(x)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the flat pass reads them (projections transposed: model/transposed.py)."""

    input_norm: Tensor  # [hidden]
    qkv: Projection  # [hidden, (heads + 2 kv_heads) * head_dim]
    qkv_bias: Tensor | None  # [(heads + 2 kv_heads) * head_dim]: Qwen2's q/k/v biases (a quantized qkv adds its own)
    q_norm: Tensor | None  # [head_dim]: Qwen3's per-head RMSNorm of queries and keys
    k_norm: Tensor | None
    o: Projection  # [heads * head_dim, hidden]
    post_norm: Tensor  # [hidden]: the norm before the MLP
    gate_up: Projection  # [hidden, 2 * intermediate]
    down: Projection  # [intermediate, hidden]
    key_cache: Tensor  # this layer's KV cache, and the same read by position
    value_cache: Tensor
    keys: Pool
    values: Pool
    window: int | None = None  # the positions this layer attends within (Attention.window)
    sliding_rope: bool = False  # rotates with the sliding layers' rope (DecoderLayer.sliding_rope)
    attention_out_norm: Tensor | None = None  # [hidden]: Gemma's norms of the attention's and the MLP's outputs
    mlp_out_norm: Tensor | None = None


@dataclass(frozen=True)
class FlatShape:
    """What a flat layer pass needs besides its weights: its heads (a tensor-parallel rank's), norm epsilon and the
    sum over ranks after o and down (None: the model is whole here)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention's softmax scale (ModelConfig.attention_scale)
    all_reduce: Callable[[Tensor], Tensor] | None = None
    act_and_mul: GatedActivation = silu_and_mul_torch  # the MLP's (ModelConfig.activation)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def layer_weights(layer: DecoderLayer, cache: KVCache) -> LayerWeights:
    """A decoder layer's tensors in the CPU layout, and its KV-cache layer."""
    index = layer.self_attn.layer_index
    sandwich = getattr(layer, "sandwich_norms", False)  # an EAGLE-3 head's layer is a Llama's
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=layer.self_attn.qkv_proj.weight_t,
        qkv_bias=layer.self_attn.qkv_proj.bias,
        q_norm=layer.self_attn.q_norm.weight if layer.self_attn.qk_norm else None,
        k_norm=layer.self_attn.k_norm.weight if layer.self_attn.qk_norm else None,
        o=layer.self_attn.o_proj.weight_t,
        post_norm=layer.pre_feedforward_layernorm.weight if sandwich else layer.post_attention_layernorm.weight,
        gate_up=layer.mlp.gate_up_proj.weight_t,
        down=layer.mlp.down_proj.weight_t,
        key_cache=cache.keys[index],
        value_cache=cache.values[index],
        keys=Pool(cache.keys[index], cache.block_size),
        values=Pool(cache.values[index], cache.block_size),
        window=layer.self_attn.window,
        sliding_rope=getattr(layer, "sliding_rope", False),
        attention_out_norm=layer.post_attention_layernorm.weight if sandwich else None,
        mlp_out_norm=layer.post_feedforward_layernorm.weight if sandwich else None,
    )


def quantize_layer(layer: LayerWeights) -> LayerWeights:
    """A float layer with its projections' int8 twins (model/int8_linear.py) where the kernel takes their widths;
    the same norms and cache."""

    def twin(weight: Tensor, bias: Tensor | None = None) -> Projection:
        quantized = int8_twin(weight.t(), bias)
        return weight if quantized is None else quantized

    qkv = twin(layer.qkv, layer.qkv_bias)
    return dataclasses.replace(
        layer, qkv=qkv, qkv_bias=layer.qkv_bias if isinstance(qkv, Tensor) else None, o=twin(layer.o),
        gate_up=twin(layer.gate_up), down=twin(layer.down),
    )


def attention_plan(
    shape: FlatShape, window: int | None, region_len: int | None, pool: Pool, batch: ForwardBatch, device: torch.device
) -> tuple[int | None, HomePass | list | None]:
    """A pass's attention plan, made once for all its layers: (the window when it cuts a context, the plan)."""
    # A window that cuts any context: the batched call, whose mask takes its lower bound (paged_attention_torch).
    window = cutting_window(window, batch.max_context_len)
    plan = None if window is not None else plan_cpu_attention(
        batch.num_seqs, batch.max_query_len, batch.max_context_len, batch.attention_spans, shape.group, region_len,
        pool, device,
    )
    return window, plan


def layer_pass(
    h: Tensor, residual: Tensor, layer: LayerWeights, shape: FlatShape, cos_sin: Tensor, window: int | None,
    plan: HomePass | list | None, batch: ForwardBatch,
) -> tuple[Tensor, Tensor]:
    """One decoder layer from its normed input h [T, in] and the residual stream [T, hidden]: (the MLP's output,
    the residual), whose sum is the layer's hidden state."""
    num_tokens = h.shape[0]
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    rotated = heads + kv_heads
    qkv = project(h, layer.qkv) if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, h, layer.qkv)
    qkv = qkv.view(num_tokens, rotated + kv_heads, head_dim)
    qk = qkv.narrow(1, 0, rotated)
    if layer.q_norm is not None:
        qk = normed_heads(qk, heads, layer.q_norm, layer.k_norm, shape.eps, norm=rms_norm_torch)
    qk = apply_rotary_full(qk, cos_sin)
    q, k, v = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), qkv.narrow(1, rotated, kv_heads)
    write_kv_torch(layer.key_cache, layer.value_cache, batch.slot_mapping, k, v)
    if isinstance(plan, HomePass):
        attended = attend_home_pass(q, layer.keys, layer.values, plan, shape.scale)
    elif plan is not None:
        attended = attend_per_sequence(q, layer.keys, layer.values, plan, shape.scale)
    else:
        attended = attend_gathered(
            q, layer.keys, layer.values, batch.block_tables, batch.query_starts, batch.context_lens, shape.scale,
            batch.max_query_len, batch.max_context_len, batch.first_position, window,
        )
    h = project(attended.view(num_tokens, -1), layer.o)
    if shape.all_reduce is not None:
        h = shape.all_reduce(h)
    if layer.attention_out_norm is not None:
        h = rms_norm_torch(h, layer.attention_out_norm, shape.eps)
    h, residual = rms_norm_torch(h, layer.post_norm, shape.eps, residual)
    x = project(shape.act_and_mul(project(h, layer.gate_up)), layer.down)
    if shape.all_reduce is not None:
        x = shape.all_reduce(x)
    if layer.mlp_out_norm is not None:
        x = rms_norm_torch(x, layer.mlp_out_norm, shape.eps)
    return x, residual


class FlatTrunk:
    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        """model: loaded on the CPU in its CPU layout (whole, or a tensor-parallel shard); cache: the KV cache its
        passes write and read."""
        if model.head_weight_t is None:
            raise ValueError("the flat trunk reads the CPU layout's transposed projections (model/transposed.py)")
        cfg = model.local_config  # a tensor-parallel rank's heads, kv heads and intermediate rows
        # o and down sum over a tensor-parallel group's ranks
        self.shape = FlatShape(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_scale,
            model.all_reduce, gated_activation_torch(cfg.activation),
        )
        self.embed = model.embed  # vocab-parallel on a tensor-parallel rank
        self.region_len = cache.region_len
        self.ropes = model.ropes
        self.feature_layers = model.feature_layers  # an EAGLE-3 head's (CausalLM.forward)
        self.layers = [layer_weights(layer, cache) for layer in model.model.layers]
        self.windows = frozenset(layer.window for layer in self.layers)  # Gemma's sliding and full layers: two
        self.quantized_layers: list[LayerWeights] | None = None  # a draft model's int8 twins (quantize)

    def quantize(self) -> None:
        """Builds the int8 twins of every layer's projections, for passes that ask for them (a draft model's)."""
        self.quantized_layers = [quantize_layer(layer) for layer in self.layers]

    def __call__(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch, quantized: bool = False) -> Tensor:
        """input_ids, positions [T] packed -> the last layer's hidden states [T, hidden], before the final norm, and
        an EAGLE-3 head's layer inputs after them when one is attached: CausalLM.forward's result for the same
        batch. quantized: through the int8 twins, when they were built."""
        x = self.embed(input_ids)  # [T, hidden]
        if input_ids.shape[0] == 0:
            return x.new_zeros(0, x.shape[1] * (1 + len(self.feature_layers)))
        ropes = self.ropes(positions, batch.max_context_len)  # (full layers', sliding layers') [T, 2, 1, head_dim]
        shape, eps = self.shape, self.shape.eps
        # Each layer's window's plan, made once for every window that cuts the contexts differently
        by_cut: dict[int | None, tuple[int | None, HomePass | list | None]] = {}
        plans = {}
        for window in self.windows:
            cut = cutting_window(window, batch.max_context_len)
            if cut not in by_cut:
                by_cut[cut] = attention_plan(shape, cut, self.region_len, self.layers[0].keys, batch, x.device)
            plans[window] = by_cut[cut]
        residual = None
        feature_layers, layer_inputs = self.feature_layers, {}
        layers = self.quantized_layers if quantized and self.quantized_layers is not None else self.layers
        for index, layer in enumerate(layers):
            if index in feature_layers:
                layer_inputs[index] = x if residual is None else x + residual
            if residual is None:
                residual = x
                h = rms_norm_torch(x, layer.input_norm, eps)
            else:
                h, residual = rms_norm_torch(x, layer.input_norm, eps, residual)
            window, plan = plans[layer.window]
            x, residual = layer_pass(h, residual, layer, shape, ropes[layer.sliding_rope], window, plan, batch)
        if not feature_layers:
            return x + residual
        return torch.cat([x + residual, *(layer_inputs[i] for i in feature_layers)], dim=-1)
