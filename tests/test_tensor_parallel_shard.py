"""The tensor-parallel split (services/worker/tensor_parallel/) against the whole model: shards put back together
are the checkpoint's tensors, and two real ranks over gloo compute what the unsplit layers do: the vocab-parallel
embedding bit for bit, the column- and row-parallel decoder blocks (trunk and MTP module), and the LM head's
gathered logits, to float rounding (the all-reduce sums in another order)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from services.worker.model.config import ModelConfig
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_model
from services.worker.tensor_parallel.divisible import ShardingError, check_shardable
from services.worker.tensor_parallel.group import TensorParallelGroup
from services.worker.tensor_parallel.model import ShardedCausalLM, load_shard
from services.worker.tensor_parallel.divisible import shard_config
from services.worker.tensor_parallel.shard import shard_state
from services.startup_checks import UsageError, check_tensor_parallel
from services.worker.drafting.checkpoints import default_eagle3_dir
from shared.config import DEFAULT_MODEL_DIR, EngineConfig
from tests.modelfixture import make_tiny_model_dir

TP = 2
MAX_MODEL_LEN = 64
SEQ_LEN = 12
ODD_VOCAB = 4095  # not a multiple of TP: the last slice is padded
TOLERANCE = 1e-6  # of the tensor's largest magnitude: float32 sums in another order
RANK_TIMEOUT_S = 60


# Routed experts in every layer, as Qwen3-MoE has them
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1)


def _demo_config(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_dir(DEFAULT_MODEL_DIR), **overrides)


@pytest.mark.parametrize("experts", [{}, MOE], ids=["dense", "routed-experts"])
def test_shards_put_back_together_are_the_checkpoint(experts: dict) -> None:
    cfg = _demo_config(vocab_size=ODD_VOCAB, tie_word_embeddings=False, **experts)
    with torch.device("meta"):
        names = CausalLM(cfg).state_dict()
    generator = torch.Generator().manual_seed(0)
    whole = {name: torch.randn(t.shape, generator=generator) for name, t in names.items()}
    shards = [shard_state(whole, cfg, rank, TP) for rank in range(TP)]
    local = shard_config(cfg, TP)
    with torch.device("meta"):
        expected = ShardedCausalLM(cfg, TensorParallelGroup(0, TP, cfg.vocab_size)).state_dict()
    for shard in shards:
        assert {n: t.shape for n, t in shard.items()} == {n: t.shape for n, t in expected.items()}
    q, kv = local.num_attention_heads * cfg.head_dim, local.num_key_value_heads * cfg.head_dim
    for name, tensor in whole.items():
        pieces = [shard[name] for shard in shards]
        if "qkv_proj" in name:  # each rank: its q heads, its k heads, its v heads
            parts = [p.split((q, kv, kv)) for p in pieces]
            rebuilt = torch.cat([torch.cat([part[i] for part in parts]) for i in range(3)])
        elif "gate_up_proj" in name:
            halves = [p.chunk(2) for p in pieces]
            rebuilt = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            rebuilt = torch.cat(pieces, dim=1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rebuilt = torch.cat(pieces)
            assert torch.equal(rebuilt[ODD_VOCAB:], torch.zeros_like(rebuilt[ODD_VOCAB:]))
            rebuilt = rebuilt[:ODD_VOCAB]
        else:
            assert all(torch.equal(p, tensor) for p in pieces), name
            continue
        assert torch.equal(rebuilt, tensor), name


def test_routed_experts_are_split_by_their_intermediate_rows() -> None:
    """Each rank holds a slice of every expert, so routing is the same on every rank; until this change a
    Qwen3-MoE checkpoint was refused any split."""
    moe = _demo_config(**MOE)
    local = shard_config(moe, TP)
    assert (local.num_experts, local.moe_intermediate_size) == (moe.num_experts, moe.moe_intermediate_size // TP)
    with pytest.raises(ShardingError, match=r"4 must divide the model's moe_intermediate_size \(6\)"):
        check_shardable(_demo_config(**{**MOE, "moe_intermediate_size": 6}), 4)


def test_expert_parallelism_gives_each_rank_whole_experts() -> None:
    cfg = _demo_config(**MOE)
    with torch.device("meta"):
        names = CausalLM(cfg).state_dict()
    whole = {name: torch.randn(t.shape) for name, t in names.items()}
    shards = [shard_state(whole, cfg, rank, TP, expert_parallel=True) for rank in range(TP)]
    for rank, shard in enumerate(shards):
        with torch.device("meta"):
            expected = ShardedCausalLM(cfg, TensorParallelGroup(rank, TP, cfg.vocab_size), True).state_dict()
        assert {n: t.shape for n, t in shard.items()} == {n: t.shape for n, t in expected.items()}
    experts = [name for name in whole if ".experts." in name]
    for name in experts:  # each expert's tensors whole, on one rank only
        holders = [shard[name] for shard in shards if name in shard]
        assert len(holders) == 1 and torch.equal(holders[0], whole[name]), name
    assert shard_config(cfg, TP, 1, expert_parallel=True).local_experts == range(2, 4)
    with pytest.raises(ShardingError, match=r"must divide the model's num_experts \(6\)"):
        check_shardable(_demo_config(**{**MOE, "num_experts": 6}), 4, expert_parallel=True)
    with pytest.raises(ShardingError, match="no routed experts"):
        check_shardable(_demo_config(), TP, expert_parallel=True)


def test_a_size_that_does_not_divide_the_heads_is_refused_by_its_numbers() -> None:
    with pytest.raises(ShardingError, match=r"3 must divide the model's num_attention_heads \(8\)"):
        check_shardable(_demo_config(), 3)
    with pytest.raises(ShardingError, match=r"8 must divide the model's num_key_value_heads \(4\)"):
        check_shardable(_demo_config(), 8)


def _passes(model: CausalLM) -> dict[str, torch.Tensor | None]:
    """Embedding, trunk, MTP module and logits of one sequence, by the module path (no KV cache)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, SEQ_LEN), generator=generator)
    positions = torch.arange(SEQ_LEN)[None]
    with torch.inference_mode():
        out = {"embedded": model.embed(ids), "hidden": model(ids, positions)}
        out["logits"] = model.logits(out["hidden"])
        if model.config.num_mtp_layers:
            out["mtp_hidden"] = model.mtp_forward(0, out["hidden"][:, :-1], ids[:, 1:], positions[:, 1:])
            out["mtp_logits"] = model.mtp_logits(0, out["mtp_hidden"])
    return out


def _groups(rank: int, models: list[tuple[Path, bool]]) -> list[TensorParallelGroup]:
    """One group object per model (each knows its model's vocabulary slice); the first one joins the process
    group for all of them."""
    return [TensorParallelGroup(rank, TP, ModelConfig.from_dir(d).vocab_size) for d, _ in models]


def _sharded_passes(groups: list[TensorParallelGroup], port: int, model_dirs: list[tuple[Path, bool]]) -> list[dict]:
    """model_dirs: (checkpoint, whether its experts go whole to the ranks)."""
    models = [
        load_shard(d, torch.float32, "cpu", "auto", MAX_MODEL_LEN, g, expert_parallel)
        for (d, expert_parallel), g in zip(model_dirs, groups)
    ]
    groups[0].connect("cpu", port)
    try:
        return [_passes(model) for model in models]
    finally:
        groups[0].leave()


def _follower(port: int, model_dirs: list[tuple[Path, bool]]) -> None:
    _sharded_passes(_groups(1, model_dirs), port, model_dirs)


def test_two_ranks_compute_what_the_whole_model_does(tmp_path: Path) -> None:
    moe = make_tiny_model_dir(tmp_path / "moe", "qwen3_moe")
    # MTP and a tied head; q/k/v biases; routed experts sliced, and whole (expert parallelism); Granite's scalars;
    # Gemma 3's sliding and full layers, sandwich norms and GELU
    model_dirs = [
        (DEFAULT_MODEL_DIR, False), (make_tiny_model_dir(tmp_path / "qwen2", "qwen2"), False),
        (moe, False), (moe, True), (make_tiny_model_dir(tmp_path / "granite", "granite"), False),
        (make_tiny_model_dir(tmp_path / "gemma3", "gemma3"), False),
    ]
    groups = _groups(0, model_dirs)
    port = groups[0].open_rendezvous()
    follower = multiprocessing.get_context("spawn").Process(target=_follower, args=(port, model_dirs))
    follower.start()
    try:
        sharded = _sharded_passes(groups, port, model_dirs)
    finally:
        follower.join(RANK_TIMEOUT_S)
    assert follower.exitcode == 0
    for (model_dir, _), got in zip(model_dirs, sharded):
        want = _passes(load_model(model_dir, max_model_len=MAX_MODEL_LEN))
        assert set(got) == set(want)
        assert torch.equal(got["embedded"], want["embedded"])
        for name in set(want) - {"embedded"}:
            scale = float(want[name].abs().max())
            torch.testing.assert_close(got[name], want[name], atol=TOLERANCE * scale, rtol=0, msg=name)


def test_the_cli_refuses_an_eagle3_head_the_size_cannot_split(tmp_path: Path) -> None:
    """At start, not once its shard loads in the follower processes."""
    config = json.loads((default_eagle3_dir(DEFAULT_MODEL_DIR) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 705}))
    check_tensor_parallel(DEFAULT_MODEL_DIR, TP, speculative='{"method": "eagle3"}')  # the shipped head splits
    with pytest.raises(UsageError, match="EAGLE-3 head's intermediate_size"):
        unsplittable = json.dumps({"method": "eagle3", "model": str(tmp_path)})
        check_tensor_parallel(DEFAULT_MODEL_DIR, TP, speculative=unsplittable)


def test_the_cli_refuses_expert_parallelism_it_cannot_do() -> None:
    with pytest.raises(UsageError, match="--enable-expert-parallel .* above 1"):
        check_tensor_parallel(DEFAULT_MODEL_DIR, 1, expert_parallel=True)
    with pytest.raises(UsageError, match="no routed experts"):
        check_tensor_parallel(DEFAULT_MODEL_DIR, TP, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size above 1"):
        EngineConfig(enable_expert_parallel=True)
