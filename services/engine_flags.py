"""Engine options that `specmesh up` and `specmesh worker` both take (vLLM's spellings accepted beside
specmesh's), and how the launcher hands them on to its workers."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from services.startup_checks import MODEL_CONFIG_FILE
from shared import option_types
from shared.config import MAX_TENSOR_PARALLEL_SIZE, MIN_NUM_BATCHED_TOKENS, EngineConfig


def tensor_parallel_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_TENSOR_PARALLEL_SIZE:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_TENSOR_PARALLEL_SIZE}, got {value}")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512M", "1.5g" or a plain byte count; units are binary whether or not they say so."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB or a number of bytes)")
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


AUTO_DTYPE = "auto"
DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINT_DTYPE_KEYS = ("torch_dtype", "dtype")  # config.json's, before and since transformers 5
BFLOAT16_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bfloat16 arithmetic


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype config.json says the weights are stored in (a vision-language model's text config's), if one of
    DTYPES."""
    config = json.loads((Path(model_dir) / MODEL_CONFIG_FILE).read_text())
    for section in (config, config.get("text_config") or {}):
        for key in CHECKPOINT_DTYPE_KEYS:
            if section.get(key) in DTYPES:
                return section[key]
    return None


def resolved_dtype(dtype: str, device: str, model_dir: Path) -> str:
    """--dtype auto: float32 on the CPU (its fast path here, and transformers' reference numbers); on CUDA the
    checkpoint's own dtype, as transformers' torch_dtype="auto" loads it (bfloat16 for most published models), but
    float16 on a GPU without bfloat16 (before sm_80), as vLLM's auto falls back."""
    if dtype != AUTO_DTYPE:
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    stored = checkpoint_dtype(model_dir) or "float32"
    return "float16" if stored == "bfloat16" and not _has_bfloat16(device) else stored


def _has_bfloat16(device: str) -> bool:
    """Whether the GPU computes in bfloat16; asked only on CUDA (torch's import is two seconds of every start)."""
    import torch

    if not torch.cuda.is_available():  # nothing to ask: the engine will say the device is missing
        return True
    return torch.cuda.get_device_capability(torch.device(device)) >= BFLOAT16_CAPABILITY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fields = EngineConfig.model_fields
    parser.add_argument(
        "--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
        help="weights and activations; auto: float32 on the CPU, the checkpoint's own dtype on CUDA (config.json's "
        "torch_dtype: bfloat16 for most published models; float16 on a GPU before sm_80)",
    )
    parser.add_argument(
        "--kv-cache-memory", type=_size, default=None, metavar="SIZE",
        help="memory each worker's KV cache may take (4GiB, 512MiB, bytes): every slot gets its full --max-model-len "
        "when that fits, else the cache holds what fits and sequences are preempted when it runs out (default: on "
        "the CPU 4GiB or a quarter of the available memory, whichever is less, shared out among the machine's "
        "workers; on CUDA 90%% of the free memory less the weights and a reserve)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=_share, default=fields["gpu_memory_utilization"].default,
        help="CUDA: the share of each GPU's free memory the default KV budget starts from, less the weights and a "
        "reserve (refused on the CPU and beside --kv-cache-memory)",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=tensor_parallel_size, default=fields["tensor_parallel_size"].default,
        help="split each worker's model over this many processes (Megatron-style tensor parallelism): gloo on the "
        "CPU, sharing the worker's engine CPUs; NCCL on CUDA, rank r on GPU r (untested on a GPU). Passes run "
        "eagerly, without CUDA graphs. It must divide the model's attention heads, kv heads and intermediate size",
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", default=fields["enable_expert_parallel"].default,
        help="with --tensor-parallel-size N, give each rank N-th of a MoE model's routed experts whole instead of "
        "a slice of every expert (bigger products per expert, the same one all-reduce a layer); N must divide the "
        "number of experts",
    )
    default = fields["enable_prefix_caching"].default
    parser.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action="store_true", default=default,
        help="keep computed prompt and output blocks for later requests that start the same way (the default)",
    )
    parser.add_argument(
        "--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
        help="compute every prompt from its first token",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=option_types.at_least(MIN_NUM_BATCHED_TOKENS),
        default=fields["max_num_batched_tokens"].default,
        help="rows an engine step computes: every decoding sequence's, then pieces of prompts (chunked prefill)",
    )
    parser.add_argument(
        "--enable-chunked-prefill", dest="chunked_prefill", action="store_true",
        default=fields["enable_chunked_prefill"].default, help="prefill long prompts in pieces (the default)",
    )
    parser.add_argument(
        "--no-chunked-prefill", "--no-enable-chunked-prefill", dest="chunked_prefill", action="store_false",
        help="prefill every prompt in one step, however long",
    )


def config_keys(args: argparse.Namespace) -> dict:
    """The EngineConfig keys these options set."""
    return dict(
        dtype=resolved_dtype(args.dtype, args.device, args.model),
        enable_prefix_caching=args.prefix_caching, enable_chunked_prefill=args.chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options as a worker's command line takes them."""
    return [
        "--dtype", args.dtype,
        "--enable-prefix-caching" if args.prefix_caching else "--no-prefix-caching",
        "--enable-chunked-prefill" if args.chunked_prefill else "--no-chunked-prefill",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
    ] + (["--enable-expert-parallel"] if args.enable_expert_parallel else []) + (
        ["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory is not None else []
    )
