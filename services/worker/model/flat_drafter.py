"""The drafting pass of an MTP module or an EAGLE-3 head on the CPU, flattened as the trunk's is (flat_trunk.py).

A drafting pass runs one decoder layer over a row or a few per sequence, several times a step, so the framework
around its few dozen ops costs more than their arithmetic: through the modules, a demo-model pass measured ~450 us
where a flat trunk layer costs ~250. Here the fusion of the two inputs and the layer run as plain function calls
over weights read out of the modules once; the ops and their order are the modules' (CausalLM.mtp_forward,
Eagle3Head.forward), so the hidden states are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.engine.forward_batch import ForwardBatch
from services.worker.engine.kv_cache import KVCache
from services.worker.model.flat_trunk import (
    FlatShape, LayerWeights, Projection, attention_plan, layer_pass, layer_weights, project, quantize_layer,
)
from services.worker.model.gated_activation import gated_activation_torch
from services.worker.model.int8_linear import int8_twin
from services.worker.model.llama import CausalLM
from services.worker.model.rms_norm import rms_norm_torch

DRAFT_MODULE = 0  # the MTP module that drafts (drafting/mtp.py)


class FlatDrafter:
    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        """model: in the CPU layout, with MTP modules or an EAGLE-3 head attached; cache: the KV cache holding the
        drafter's layer."""
        head = model.eagle3
        if head is not None:
            layer, cfg = head.midlayer, head.config.layer
            self.embedding = head.embed_tokens.weight if head.embed_tokens is not None else None
            self.embed_norm, self.feature_norm = layer.input_layernorm.weight, layer.hidden_norm.weight
            self.fusion = None
            self.rotary = head.rotary
        else:
            layer, cfg = model.model.mtp_layers[DRAFT_MODULE], model.local_config
            self.embedding = None
            self.embed_norm, self.feature_norm = layer.enorm.weight, layer.hnorm.weight
            self.fusion = layer.eh_proj.weight_t  # [2 * hidden, hidden]
            self.rotary = model.rotary
        self.shape = FlatShape(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_scale,
            model.all_reduce, gated_activation_torch(cfg.activation),
        )
        self.region_len = cache.region_len
        self.target_embed = model.embed
        self.layer = layer_weights(layer, cache)
        self.quantized_layer: LayerWeights | None = None  # int8 twins (quantize)
        self.quantized_fusion: Projection | None = None

    def quantize(self) -> None:
        """Builds the int8 twins of the layer's projections and of MTP's fusion, for passes that ask for them."""
        self.quantized_layer = quantize_layer(self.layer)
        if self.fusion is not None:
            self.quantized_fusion = int8_twin(self.fusion.t()) or self.fusion

    def __call__(
        self, features: Tensor, next_ids: Tensor, positions: Tensor, batch: ForwardBatch, quantized: bool = False
    ) -> Tensor:
        """features [T, hidden] at position p - 1 (the trunk's, or the drafter's own output), next_ids and positions
        [T] of the tokens at p -> the drafter's hidden states [T, hidden]. quantized: through the int8 twins, when
        they were built."""
        quantized = quantized and self.quantized_layer is not None
        layer = self.quantized_layer if quantized else self.layer
        fusion = self.quantized_fusion if quantized else self.fusion
        embeds = self.target_embed(next_ids) if self.embedding is None else F.embedding(next_ids, self.embedding)
        eps = self.shape.eps
        fused = torch.cat(
            (rms_norm_torch(embeds, self.embed_norm, eps), rms_norm_torch(features, self.feature_norm, eps)), dim=-1
        )
        if fusion is None:  # EAGLE-3: the layer's attention reads both; its residual stream starts at g
            h, residual = fused, features
        else:  # MTP: projected back to hidden size, then an ordinary decoder layer
            residual = project(fused, fusion)
            h = rms_norm_torch(residual, layer.input_norm, eps)
        cos_sin = self.rotary(positions, batch.max_context_len)
        window, plan = attention_plan(self.shape, layer.window, self.region_len, layer.keys, batch, h.device)
        x, residual = layer_pass(h, residual, layer, self.shape, cos_sin, window, plan, batch)
        return x + residual
