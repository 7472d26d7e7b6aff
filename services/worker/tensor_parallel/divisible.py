"""Whether a model splits evenly over a number of tensor-parallel ranks, and the shape of one rank's shard
(torch-free: the CLI checks both at start)."""

from __future__ import annotations

import dataclasses

from services.worker.model.config import ModelConfig


class ShardingError(ValueError):
    pass


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuses, naming the numbers, a model that `size` ranks cannot split evenly. One rank splits nothing."""
    if size == 1:
        return
    counts = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    ]
    if cfg.num_experts:
        counts.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, count in counts:
        if count % size:
            raise ShardingError(
                f"--tensor-parallel-size {size} must divide the model's {name} ({count}): "
                + ", ".join(f"{n} {c}" for n, c in counts)
            )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's modules are built from: its heads, kv heads, intermediate rows (a routed expert's too)
    and vocabulary slice (the last slice padded, so all are vocab_per_rank long); head_dim, hidden_size and the
    experts' number as the model's."""
    check_shardable(cfg, size)
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=cfg.num_key_value_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        vocab_size=-(-cfg.vocab_size // size),
    )
