"""Qwen3-MoE's sparse MLP: a router picks each token's num_experts_per_tok most likely experts, and the token's
output is their outputs weighted by the router's probabilities (renormalised over the chosen ones with
norm_topk_prob), as transformers' Qwen3MoeSparseMoeBlock computes it.

Computed grouped by expert: the (token, expert) pairs are sorted by expert, and each expert used in the pass runs
once over all its tokens, so a step loops over experts (at most num_experts), never over tokens. Under expert
parallelism a rank holds a run of whole experts (cfg.local_experts) and adds up their outputs only: the tensor-parallel
all-reduce after the block sums every rank's. Each expert is an
ordinary gated MLP (layers.MLP), so checkpoints load, the CPU stores its projections transposed and dummy weights
are drawn as for a dense layer.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.plain_module import PlainModule


class SparseMoE(PlainModule):
    def __init__(self, cfg: ModelConfig, expert: type[nn.Module]) -> None:
        """expert: the gated MLP class, built with (cfg, moe_intermediate_size)."""
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        held = range(cfg.num_experts) if cfg.local_experts is None else cfg.local_experts
        # Keyed by their index in the checkpoint, so that their parameters keep its names (a run of them, split)
        self.experts = nn.ModuleDict({str(i): expert(cfg, cfg.moe_intermediate_size) for i in held})
        self.first_expert = held.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, hidden]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        by_expert = chosen.flatten().argsort(stable=True)  # (token, choice) pairs, expert after expert
        tokens = by_expert // self.top_k
        pair_weights = weights.flatten()[by_expert]
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).tolist()  # one host copy a layer
        out = torch.zeros_like(x)
        start = sum(counts[: self.first_expert])  # the pairs of the experts before this rank's
        for expert, count in zip(self.experts.values(), counts[self.first_expert :]):
            if count:
                rows = tokens[start : start + count]
                out.index_add_(0, rows, expert(x[rows]) * pair_weights[start : start + count, None])
                start += count
        return out.view(shape)
