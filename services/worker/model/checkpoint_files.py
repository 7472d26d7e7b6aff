"""A checkpoint directory's weight files and the tensor names they hold, read from the shard index or the
safetensors headers without loading a tensor."""

from __future__ import annotations

import json
from pathlib import Path

SHARD_INDEX = "model.safetensors.index.json"
# Where a causal LM's and a transformers 4 vision-language model's LM head are stored
STORED_HEADS = frozenset({"lm_head.weight", "language_model.lm_head.weight"})


class CheckpointError(ValueError):
    pass


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {model_dir}")
    return files


def tensor_names(model_dir: Path) -> set[str]:
    """The names of the tensors stored in model_dir; none where it holds no weights (a shape's config alone). A
    weight file or index that cannot be read (a Git LFS pointer left by a clone without LFS) is a CheckpointError
    naming it."""
    from safetensors import SafetensorError, safe_open  # here: the gateway reads configs too, and never a weight

    index = model_dir / SHARD_INDEX
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} cannot be read as a shard index: {exc!r}") from exc
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            # numpy's view of the file: "pt" would import torch, two seconds of every `specmesh up`
            with safe_open(str(path), framework="numpy") as weights:
                names.update(weights.keys())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from exc
    return names


def stores_head(model_dir: Path) -> bool:
    return not STORED_HEADS.isdisjoint(tensor_names(Path(model_dir)))
