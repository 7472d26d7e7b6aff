"""Whether a model splits evenly over a number of tensor-parallel ranks, and the shape of one rank's shard
(torch-free: the CLI checks both at start)."""

from __future__ import annotations

import dataclasses

from services.worker.model.config import ModelConfig


class ShardingError(ValueError):
    pass


def check_shardable(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuses, naming the numbers, a model that `size` ranks cannot split evenly. One rank splits nothing.
    expert_parallel: routed experts go whole to the ranks, size dividing their number."""
    if expert_parallel and not cfg.num_experts:
        raise ShardingError(f"--enable-expert-parallel: {cfg.architecture} has no routed experts to split")
    if size == 1:
        return
    counts = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    ]
    if cfg.num_experts:
        counts.append(("num_experts", cfg.num_experts) if expert_parallel
                      else ("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, count in counts:
        if count % size:
            raise ShardingError(
                f"--tensor-parallel-size {size} must divide the model's {name} ({count}): "
                + ", ".join(f"{n} {c}" for n, c in counts)
            )


def shard_config(cfg: ModelConfig, size: int, rank: int = 0, expert_parallel: bool = False) -> ModelConfig:
    """The config rank `rank`'s modules are built from: its heads, kv heads, intermediate rows and vocabulary slice
    (the last slice padded, so all are vocab_per_rank long); head_dim and hidden_size as the model's. Its routed
    experts: a slice of each one's rows, or with expert_parallel its run of whole experts."""
    check_shardable(cfg, size, expert_parallel)
    experts = {}
    if cfg.num_experts and expert_parallel:
        per_rank = cfg.num_experts // size
        experts = {"local_experts": range(rank * per_rank, (rank + 1) * per_rank)}
    elif cfg.num_experts:
        experts = {"moe_intermediate_size": cfg.moe_intermediate_size // size}
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=cfg.num_key_value_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=-(-cfg.vocab_size // size),
        **experts,
    )
