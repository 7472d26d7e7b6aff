"""services/worker/engine/kv_budget.py: a worker's KV blocks fill every slot's full length within the memory budget
and no more; the cost of a block it plans is what the engine allocates, for every drafter and a tensor-parallel
shard, and the weights it leaves room for are those loaded; a budget smaller than one sequence is refused by name
before anything starts; CPU workers and ranks share the default; and an engine on a cache the budget cut short
preempts and still yields each request's tokens. A CPU cache takes memory only as it is written."""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

import pytest
import torch

from services import cli, engine_flags
from services.startup_checks import UsageError, check_kv_cache_memory
from services.worker.engine import kv_budget
from services.worker.engine.block_manager import blocks_for
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache import lazy_zeros
from services.worker.model.config import ModelConfig
from shared.config import DEFAULT_MODEL_DIR, DTYPE_BYTES, EngineConfig, SpeculativeConfig
from shared.ports import free_port
from shared.schemas import SamplingParams, WorkRequest

MAX_MODEL_LEN = 128
MIB = 1 << 20
ONE_SEQUENCE = blocks_for(MAX_MODEL_LEN, 16)
DRAFTERS = ("naive", "mtp", "eagle3", "draft_model")


def _config(method: str = "naive", **keys) -> EngineConfig:
    return EngineConfig(
        model=DEFAULT_MODEL_DIR, max_model_len=MAX_MODEL_LEN, speculative=SpeculativeConfig(method=method), **keys
    )


def _allocated_bytes(engine: Engine) -> int:
    """Every tensor of the engine's KV caches (the target's and a draft model's): keys, values and the hidden
    state kept per block."""
    caches = [engine.runner.cache] + ([engine.draft.runner.cache] if engine.draft is not None else [])
    total = 0
    for cache in caches:
        total += cache.nbytes
        if cache.boundary_hidden is not None:
            total += cache.boundary_hidden.numel() * cache.boundary_hidden.element_size()
    return total


@pytest.mark.parametrize("method", DRAFTERS)
def test_the_planned_cost_of_a_block_is_what_the_engine_allocates(method: str) -> None:
    config = _config(method, max_num_seqs=2)
    engine = Engine(config)
    num_blocks = engine.runner.cache.num_blocks
    assert num_blocks == 2 * ONE_SEQUENCE  # the demo's default budget holds every slot's full length
    per_block, target, draft = kv_budget._block_cost(config)
    assert _allocated_bytes(engine) == per_block * (num_blocks + 1)  # and the padding block
    if method != "eagle3":  # CUDA's budget leaves room for the weights (an EAGLE-3 head's as its files store them)
        models = [engine.runner.model] + ([engine.draft.runner.model] if engine.draft is not None else [])
        loaded = sum(p.numel() * p.element_size() for model in models for p in model.parameters())
        assert kv_budget.weight_bytes(config, target, draft) == loaded


def test_a_shard_costs_its_share_of_the_kv_heads() -> None:
    target = ModelConfig.from_dir(DEFAULT_MODEL_DIR)
    whole = kv_budget.bytes_per_block(_config(), target, None, None)
    split = kv_budget.bytes_per_block(_config(tensor_parallel_size=2), target, None, None)
    hidden = target.hidden_size * DTYPE_BYTES["float32"]  # the MTP module's input, kept whole per rank
    assert split - hidden == (whole - hidden) // 2


def test_an_explicit_budget_is_the_whole_workers_however_many_ranks_share_it() -> None:
    """--kv-cache-memory is what a worker's cache may take: split over two ranks, each plans with half, so the
    worker's caches together take what one rank's would (they took twice as much)."""
    budget = 64 * MIB
    split = _config(max_num_seqs=512, kv_cache_memory=budget, tensor_parallel_size=2)
    per_rank = kv_budget._block_cost(split)[0] * (kv_budget.planned_blocks(split) + 1)
    assert 2 * per_rank <= budget < 3 * per_rank


def test_full_length_for_every_slot_when_it_fits_else_what_the_budget_holds() -> None:
    config = _config(max_num_seqs=8)
    per_block = 1000
    assert kv_budget.num_kv_blocks(config, per_block, 10**9) == 8 * ONE_SEQUENCE
    # The cache allocates one padding block beside those it hands out
    assert kv_budget.num_kv_blocks(config, per_block, (3 * ONE_SEQUENCE + 1) * per_block + 999) == 3 * ONE_SEQUENCE
    assert kv_budget.num_kv_blocks(config, per_block, (ONE_SEQUENCE + 1) * per_block) == ONE_SEQUENCE
    with pytest.raises(ValueError, match="--kv-cache-memory, or lower --max-model-len"):
        kv_budget.num_kv_blocks(config, per_block, (ONE_SEQUENCE + 1) * per_block - 1)
    with pytest.raises(ValueError, match="holds 0 blocks"):
        kv_budget.num_kv_blocks(config, per_block, -5)  # a device whose weights left nothing
    assert kv_budget.planned_blocks(_config(num_kv_blocks=7)) == 7  # an explicit count is taken as it is


def test_the_cpus_default_budget_is_4_gib_or_a_quarter_of_what_is_available_shared_by_ranks() -> None:
    def unused() -> int:
        raise AssertionError("the CPU's budget leaves no room for weights: they are not counted")

    budget = kv_budget.default_budget(_config(), unused, 4096)
    assert budget == min(4 * kv_budget.GIB, int(kv_budget.available_host_bytes() * 0.25))
    assert 0 < budget <= 4 * kv_budget.GIB
    assert kv_budget.default_budget(_config(tensor_parallel_size=2), unused, 4096) == budget // 2


def test_several_cpu_workers_share_the_default_budget() -> None:
    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]  # up checks that its ports are free
    _, args = cli.parse(["up", "--workers", "2", "--max-model-len", "256", *ports])
    assert args.kv_cache_memory == pytest.approx(kv_budget.default_cpu_budget() // 2, rel=0.05)  # memory moves
    _, args = cli.parse(["up", "--max-model-len", "256", *ports])
    assert args.kv_cache_memory is None  # one worker: its own default


@pytest.mark.parametrize(
    "text, expected",
    [("4GiB", 4 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("1000", 1000), ("2 KB", 2048), ("64b", 64)],
)
def test_sizes_read_as_binary_units(text: str, expected: int) -> None:
    assert engine_flags.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1G", "0", "4 GiBs", "4ib"])
def test_a_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        engine_flags.parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        engine_flags._size(text)


def test_a_budget_below_one_sequence_is_refused_at_start_naming_the_flag() -> None:
    per_block, _, _ = kv_budget._block_cost(_config("draft_model"))
    too_small = _config("draft_model", kv_cache_memory=(ONE_SEQUENCE + 1) * per_block - 1)
    with pytest.raises(UsageError, match=r"^--kv-cache-memory \d+: a KV cache of .* holds"):
        check_kv_cache_memory(too_small)
    check_kv_cache_memory(_config("draft_model", kv_cache_memory=(ONE_SEQUENCE + 1) * per_block))
    check_kv_cache_memory(_config(num_kv_blocks=1, kv_cache_memory=1))  # explicit blocks: the budget is moot


def _tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens, all admitted at once, and how many preemptions it took."""
    requests = [
        WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=p, created=0.0,
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for p in prompts
    ]
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    preemptions = 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.seq.request_id] += out.tokens
        preemptions += len(engine.last_preempted)
    return [tokens[r.request_id] for r in requests], preemptions


def test_a_cache_the_budget_cut_short_preempts_and_yields_the_same_tokens() -> None:
    prompts = [[1 + i, 40 + i, 7, 300 + i] * 8 for i in range(4)]  # 32 tokens each, 96 with their outputs
    whole = Engine(_config(max_num_seqs=4))
    per_block, _, _ = kv_budget._block_cost(_config(max_num_seqs=4))
    short = Engine(_config(max_num_seqs=4, kv_cache_memory=(ONE_SEQUENCE + 5) * per_block))
    assert short.runner.cache.num_blocks == ONE_SEQUENCE + 4 < whole.runner.cache.num_blocks
    assert _allocated_bytes(short) <= (ONE_SEQUENCE + 5) * per_block  # the budget, padding block included
    assert short.runner.cache.region_len is None  # no home region per slot: attention gathers blocks
    expected, none = _tokens(whole, prompts, 64)
    tokens, preemptions = _tokens(short, prompts, 64)
    assert tokens == expected and none == 0 < preemptions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_cache_takes_memory_as_it_is_written_not_when_made(dtype: torch.dtype) -> None:
    def resident_mib() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB

    before = resident_mib()
    keys = lazy_zeros((4, 64 * 2048 * 16, 32), dtype, "cpu")  # 512 or 256 MiB
    assert keys.dtype == dtype and keys.shape == (4, 64 * 2048 * 16, 32)
    assert resident_mib() - before < 16
    keys[:, :2048].fill_(1.0)
    assert bool((keys[:, :2048] == 1).all()) and not keys[:, 2048:4096].any()
