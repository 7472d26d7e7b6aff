"""Start-up options checked before anything starts: a model directory that is not one, a checkpoint the engine
cannot serve, speculative-config JSON that does not parse, or a length the model was not trained for ends the
command with one line naming the culprit and exit status 2 (cli.py), never with a traceback from a child."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pydantic import ValidationError

from services.worker.engine.kv_budget import check_budget
from services.worker.model.checkpoint_files import CheckpointError
from services.worker.model.config import ModelConfig, UnsupportedModelError
from services.worker.model.config import context_length as model_context_length
from services.worker.tensor_parallel.divisible import ShardingError, check_shardable
from shared.config import EngineConfig, SpeculativeConfig
from shared.tokenizer import TOKENIZER_FILE

MODEL_CONFIG_FILE = "config.json"
CONTEXT_LENGTH_KEY = "max_position_embeddings"
MAX_MODEL_LEN_FLAG = "--max-model-len"


class UsageError(ValueError):
    """An option that cannot be honoured; cli.py prints it as one line and exits with status 2."""


def check_model_dir(model: Path) -> None:
    """--model must be an existing directory holding a Hugging Face config.json."""
    if not Path(model).is_dir():
        raise UsageError(f"--model {model}: no such directory")
    if not (Path(model) / MODEL_CONFIG_FILE).is_file():
        raise UsageError(f"--model {model}: no {MODEL_CONFIG_FILE} there, so not a Hugging Face checkpoint directory")


def check_tokenizer_dir(model: Path) -> None:
    """--model of a service that encodes or decodes text: a checkpoint directory with its tokenizer."""
    check_model_dir(model)
    if not (Path(model) / TOKENIZER_FILE).is_file():
        raise UsageError(f"--model {model}: no {TOKENIZER_FILE} there, which the gateway and the detokenizer need")


def speculative_config(text: str) -> str:
    """argparse type of --speculative-config: JSON that SpeculativeConfig accepts, passed on as the same text."""
    try:
        SpeculativeConfig.from_json(text)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "the JSON"
        raise argparse.ArgumentTypeError(f"{where}: {first['msg']}") from exc
    except ValueError as exc:  # orjson.JSONDecodeError
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from exc
    return text


def context_length(model: Path) -> int | None:
    """The model's trained context (config.json max_position_embeddings, or its architecture's default), when known."""
    check_model_dir(model)
    try:
        raw = json.loads((Path(model) / MODEL_CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {Path(model) / MODEL_CONFIG_FILE}: {exc}") from exc
    return model_context_length(raw) if isinstance(raw, dict) else None


def resolve_max_model_len(requested: int | None, limit: int | None, model: Path) -> int:
    """--max-model-len as given, or the model's context length when not given; never past that length."""
    if requested is None:
        if limit is None:
            raise UsageError(f"{model}/{MODEL_CONFIG_FILE} names no {CONTEXT_LENGTH_KEY}: give {MAX_MODEL_LEN_FLAG}")
        return limit
    if limit is not None and requested > limit:
        raise UsageError(
            f"{MAX_MODEL_LEN_FLAG} {requested} exceeds the model's context length "
            f"({CONTEXT_LENGTH_KEY} {limit} in {model}/{MODEL_CONFIG_FILE})"
        )
    return requested


def servable_max_model_len(model: Path, requested: int | None) -> int:
    """For the engine (worker, `specmesh up`): the checkpoint must be one the engine serves, and the length one it
    serves exactly; returns the length to serve (the model's context length unless --max-model-len says less)."""
    check_model_dir(model)
    try:
        config = ModelConfig.from_dir(model)
    except UnsupportedModelError as exc:
        raise UsageError(f"{model}: unsupported model: {exc}") from exc
    except CheckpointError as exc:
        raise UsageError(f"{model}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{model}/{MODEL_CONFIG_FILE} is incomplete or malformed: {exc!r}") from exc
    max_model_len = resolve_max_model_len(requested, config.max_position_embeddings, model)
    try:
        config.check_served_length(max_model_len)
    except UnsupportedModelError as exc:
        raise UsageError(f"{MAX_MODEL_LEN_FLAG} {max_model_len}: {exc}") from exc
    return max_model_len


def check_tensor_parallel(
    model: Path, size: int, expert_parallel: bool = False, speculative: str | None = None
) -> None:
    """--tensor-parallel-size must split the model evenly (a servable model: servable_max_model_len first),
    --enable-expert-parallel its routed experts, and an EAGLE-3 head (--speculative-config) its layer."""
    if expert_parallel and size == 1:
        raise UsageError(
            "--enable-expert-parallel splits experts over --tensor-parallel-size ranks: give a size above 1"
        )
    try:
        target = ModelConfig.from_dir(model)
        check_shardable(target, size, expert_parallel)
        spec = SpeculativeConfig.from_json(speculative)
        if size > 1 and spec.method == "eagle3":
            from services.worker.drafting.checkpoints import default_eagle3_dir  # torch, only for such a worker
            from services.worker.model.eagle3 import Eagle3Config
            from services.worker.tensor_parallel.shard import check_head_shardable

            head = Eagle3Config.from_dir(spec.model or default_eagle3_dir(model), target)
            check_head_shardable(head.layer, size)
    except ShardingError as exc:
        raise UsageError(str(exc)) from exc


def check_kv_cache_memory(config: EngineConfig) -> None:
    """An explicit --kv-cache-memory must hold one sequence of --max-model-len (kv_budget.py)."""
    try:
        check_budget(config)
    except ValueError as exc:
        raise UsageError(f"--kv-cache-memory {config.kv_cache_memory}: {exc}") from exc
