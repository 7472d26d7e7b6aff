"""Reasoning models' thinking set apart from their answers on chat (`--reasoning-parser`), whole or streamed."""
