"""How many KV cache blocks a worker allocates when --num-kv-blocks is not given.

Enough for every slot's max_model_len positions when that fits the KV memory budget: no sequence is then ever
preempted, and each slot has a home region, which CPU attention reads for a whole decode batch in one call.
Otherwise as many blocks as the budget holds, at least one full-length sequence's, and the scheduler preempts the
newest sequence when they run out (vLLM sizes its cache from memory the same way). Without this bound a long-context
checkpoint's cache for every slot would not fit at all: Qwen2.5-0.5B's 32k positions are 0.8 GB of float32 keys and
values per slot.

The budget, per worker process: --kv-cache-memory, or by default on the CPU 4 GiB or a quarter of the memory
available at start (within the cgroup's limit), whichever is less, shared by the workers `specmesh up` starts and by
a worker's tensor-parallel ranks, which all draw on the host's memory; on CUDA, per rank (each has its own device),
--gpu-memory-utilization (90%) of the device's free memory at start, less the weights and a reserve for a step's activations (the logits of a
full step and room for CUDA graphs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from services.cpu_budget import cgroup_memory_headroom
from services.worker.drafting.checkpoints import default_draft_dir, default_eagle3_dir
from services.worker.engine.block_manager import blocks_for
from services.worker.model.config import ModelConfig
from services.worker.tensor_parallel.divisible import shard_config
from shared.config import DTYPE_BYTES, EngineConfig

MIB, GIB = 1 << 20, 1 << 30
CPU_KV_CACHE_BYTES = 4 * GIB
CPU_AVAILABLE_SHARE = 0.25
GPU_ACTIVATION_RESERVE_BYTES = GIB
# A step's logits in float32 and the temporaries sampling makes of the same size
LOGITS_COPIES = 4
FLOAT32_BYTES = 4
MEMINFO = Path("/proc/meminfo")


def _cache_bytes_per_block(cfg: ModelConfig, extra_layers: int, feature_size: int | None, itemsize: int,
                           block_size: int) -> int:
    """What a block costs one model's KVCache (engine/kv_cache.py): keys and values of each cache layer, and the
    hidden state a hidden-state drafter keeps per block."""
    layers = cfg.num_hidden_layers + cfg.num_mtp_layers + extra_layers
    per_block = layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return per_block + (feature_size or 0) * itemsize


def bytes_per_block(config: EngineConfig, target: ModelConfig, draft: ModelConfig | None,
                    eagle3_hidden_size: int | None) -> int:
    """The memory one more KV block takes in this worker process: the target's cache (its trunk, MTP modules and an
    EAGLE-3 head's layer, on this rank's kv heads) and a draft model's mirror of it."""
    itemsize = DTYPE_BYTES[config.dtype]
    local = shard_config(target, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel)
    feature = eagle3_hidden_size if eagle3_hidden_size is not None else (
        target.hidden_size if target.num_mtp_layers else None
    )
    total = _cache_bytes_per_block(local, eagle3_hidden_size is not None, feature, itemsize, config.block_size)
    if draft is not None:
        total += _cache_bytes_per_block(
            draft, 0, draft.hidden_size if draft.num_mtp_layers else None, itemsize, config.block_size
        )
    return total


def available_host_bytes() -> int:
    """What can be allocated without swapping: MemAvailable of /proc/meminfo (free pages elsewhere), and no more than
    the memory limits of the process's cgroup and its ancestors leave (a container's, a Kubernetes pod's)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    headroom = cgroup_memory_headroom()
    return available if headroom is None else min(available, headroom)


def weight_bytes(config: EngineConfig, target: ModelConfig, draft: ModelConfig | None) -> int:
    """This process's weights in config.dtype: the target's shard and a draft model's (built on the meta device,
    which costs no memory), and an EAGLE-3 head's as its checkpoint stores them."""
    import torch  # only here and for CUDA's budget: the CLI checks an explicit budget without loading torch

    from services.worker.model.llama import CausalLM

    itemsize = DTYPE_BYTES[config.dtype]
    with torch.device("meta"):
        models = [CausalLM(target, shard_config(
            target, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel
        ))]
        models += [CausalLM(draft)] if draft is not None else []
    total = sum(p.numel() for m in models for p in m.parameters()) * itemsize
    if config.speculative.method == "eagle3":
        head_dir = Path(config.speculative.model or default_eagle3_dir(config.model))
        total += sum(f.stat().st_size for f in head_dir.glob("*.safetensors"))
    return total


def default_cpu_budget() -> int:
    """The default budget of all a machine's CPU workers together."""
    return min(CPU_KV_CACHE_BYTES, int(available_host_bytes() * CPU_AVAILABLE_SHARE))


def default_budget(config: EngineConfig, weights: Callable[[], int], vocab_size: int) -> int:
    """The KV budget of this process when --kv-cache-memory is not given (see the module docstring). On the CPU the
    ranks of a tensor-parallel worker share the host's memory, so each takes its share of the worker's budget."""
    if not config.device.startswith("cuda"):
        return default_cpu_budget() // config.tensor_parallel_size
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    # A step's rows: the chunked-prefill budget, or without it at least a whole prompt of max_model_len
    rows = config.max_num_batched_tokens if config.enable_chunked_prefill else max(
        config.max_num_batched_tokens, config.max_model_len
    )
    logits = LOGITS_COPIES * rows * vocab_size * FLOAT32_BYTES
    return int(free * config.gpu_memory_utilization) - weights() - GPU_ACTIVATION_RESERVE_BYTES - logits


def num_kv_blocks(config: EngineConfig, per_block: int, budget: int) -> int:
    """Blocks for every slot's full length, or as many as `budget` bytes hold; refused when that is fewer than one
    sequence of max_model_len needs."""
    one_sequence = blocks_for(config.max_model_len, config.block_size)
    full = config.max_num_seqs * one_sequence
    fits = max(max(budget, 0) // per_block - 1, 0)  # the cache adds a padding block (kv_cache.py)
    if fits < one_sequence:
        raise ValueError(
            f"a KV cache of {budget / MIB:.1f} MiB holds {fits} blocks of {config.block_size} positions "
            f"({per_block} bytes each), fewer than the {one_sequence} that one sequence of max_model_len "
            f"{config.max_model_len} needs: give more with --kv-cache-memory, or lower --max-model-len"
        )
    return min(full, fits)


def planned_blocks(config: EngineConfig) -> int:
    """config.num_kv_blocks, or what the budget (config.kv_cache_memory, or the default) allows."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block, target, draft = _block_cost(config)
    if config.kv_cache_memory is None:
        budget = default_budget(config, lambda: weight_bytes(config, target, draft), target.vocab_size)
    else:
        budget = _rank_share(config)
    return num_kv_blocks(config, per_block, budget)


def _rank_share(config: EngineConfig) -> int:
    """What one rank's shard of the cache may take of an explicit kv_cache_memory, which is the worker's whole (all
    its ranks'): per_block is one shard's cost, so each rank plans with its share, as the default budget does."""
    return config.kv_cache_memory // config.tensor_parallel_size


def check_budget(config: EngineConfig) -> None:
    """Refuses (ValueError) an explicit kv_cache_memory too small for one sequence of max_model_len, before any
    process starts; torch-free."""
    if config.num_kv_blocks is None and config.kv_cache_memory is not None:
        num_kv_blocks(config, _block_cost(config)[0], _rank_share(config))


def _block_cost(config: EngineConfig) -> tuple[int, ModelConfig, ModelConfig | None]:
    """(bytes_per_block, the target's config, a draft model's config if one will be loaded)."""
    target = ModelConfig.from_dir(config.model)
    spec = config.speculative
    draft = eagle3_hidden_size = None
    # A missing drafter is left to its loader, which names it; a prefill worker loads no draft model.
    if spec.method == "draft_model" and config.role != "prefill":
        path = Path(spec.model or default_draft_dir(config.model))
        draft = ModelConfig.from_dir(path) if (path / "config.json").is_file() else None
    if spec.method == "eagle3":
        path = Path(spec.model or default_eagle3_dir(config.model)) / "config.json"
        eagle3_hidden_size = json.loads(path.read_text())["hidden_size"] if path.is_file() else None
    return bytes_per_block(config, target, draft, eagle3_hidden_size), target, draft
