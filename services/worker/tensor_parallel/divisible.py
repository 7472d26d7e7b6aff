"""Whether a model splits evenly over a number of tensor-parallel ranks (torch-free: the CLI checks it at start)."""

from __future__ import annotations

from services.worker.model.config import ModelConfig


class ShardingError(ValueError):
    pass


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuses, naming the numbers, a model that `size` ranks cannot split evenly."""
    if cfg.num_experts:
        raise ShardingError(
            f"tensor parallelism does not split routed experts ({cfg.architecture} has {cfg.num_experts}); "
            "serve it with --tensor-parallel-size 1"
        )
    for name, count in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if count % size:
            raise ShardingError(
                f"--tensor-parallel-size {size} must divide the model's {name} ({count}): "
                f"{cfg.num_attention_heads} attention heads, {cfg.num_key_value_heads} kv heads, "
                f"intermediate size {cfg.intermediate_size}"
            )
