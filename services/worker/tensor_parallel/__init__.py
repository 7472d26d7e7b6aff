"""Tensor parallelism: one engine's model split across N processes (ranks), Megatron-style (docs/model.md)."""
