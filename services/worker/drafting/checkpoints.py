"""Where a target's shipped drafters lie: the directories beside its checkpoint with these suffixes (torch-free,
so that the CLI can size a worker's KV cache before anything starts)."""

from __future__ import annotations

from pathlib import Path

DRAFT_SUFFIX = "-draft"  # method draft_model's default draft model
EAGLE3_SUFFIX = "-eagle3"  # method eagle3's default head


def default_draft_dir(model_dir: Path) -> Path:
    return Path(f"{Path(model_dir)}{DRAFT_SUFFIX}")


def default_eagle3_dir(model_dir: Path) -> Path:
    return Path(f"{Path(model_dir)}{EAGLE3_SUFFIX}")
