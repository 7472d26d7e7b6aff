"""The packed step inputs without a model: positions, flat KV slots, offsets and tables of a ragged batch; the
greedy verification shortcut against the general verifier; HF weight names merged and split back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.engine.forward_batch import InputBuffers, pack
from services.worker.engine.kv_cache import KVCache
from services.worker.model.config import ModelConfig
from services.worker.model.weights import merge_projections, split_projections
from services.worker.sampling.greedy import greedy_verify
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, verify_torch

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32


def _cache() -> KVCache:
    cache = KVCache(1, 3, MAX_MODEL_LEN, 1, 2, torch.float32, "cpu", BLOCK_SIZE, num_blocks=24)
    cache.set_block_table(0, [5, 9])
    cache.set_block_table(2, [1, 2, 3])
    return cache


def test_pack_lays_ragged_rows_out_flat() -> None:
    cache = _cache()
    batch = pack(cache, [[7, 8, 9], [4]], starts=[2, 10], slots=[0, 2], buffers=InputBuffers(torch.device("cpu")))
    assert batch.input_ids.tolist() == [7, 8, 9, 4]
    assert batch.positions.tolist() == [2, 3, 4, 10]
    # slot 0: positions 2, 3 in block 5, position 4 in block 9; slot 2: position 10 in its third block (3)
    assert batch.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 9 * 4 + 0, 3 * 4 + 2]
    assert batch.query_starts.tolist() == [0, 3, 4] and batch.context_lens.tolist() == [5, 11]
    assert batch.block_tables.tolist() == [[5, 9, cache.padding_block], [1, 2, 3]]
    assert (batch.max_query_len, batch.max_context_len) == (3, 11)
    assert batch.last_rows.tolist() == [2, 3]


def test_pack_refuses_positions_past_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        pack(_cache(), [[1, 2]], starts=[MAX_MODEL_LEN - 1], slots=[0], buffers=InputBuffers(torch.device("cpu")))


def test_greedy_verify_equals_the_general_verifier_on_greedy_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    batch, slots, vocab = 6, 3, 11
    logits = torch.randn(batch, slots + 1, vocab, generator=generator)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(batch, slots, generator=generator) < 0.7, argmax[:, :slots], 0)
    counts = torch.tensor([0, 1, 2, 3, 3, 2])
    drafts = torch.where(torch.arange(slots) < counts[:, None], drafts, PAD_TOKEN)
    probs = torch.softmax(logits, -1)
    expected = verify_torch(VerifyInput(
        target_probs=probs, draft_tokens=drafts, num_drafts=counts, draft_probs=None,
        greedy=torch.ones(batch, dtype=torch.bool), seeds=torch.arange(batch),
        positions=torch.zeros(batch, dtype=torch.long),
    ))
    tokens, accepted = greedy_verify(logits, drafts, counts)
    assert torch.equal(accepted, expected.num_accepted)
    assert torch.equal(tokens, expected.output_tokens)


def test_projection_weights_merge_and_split_back() -> None:
    cfg = ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=2, rope_theta=1e4, rms_norm_eps=1e-6,
        max_position_embeddings=16, tie_word_embeddings=True, attention_bias=True, num_mtp_layers=0,
    )
    shapes = {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    state = {f"model.layers.0.self_attn.{n}.{kind}": torch.randn(rows, 8) if kind == "weight" else torch.randn(rows)
             for n, rows in shapes.items() for kind in ("weight", "bias")}
    state |= {f"model.layers.0.mlp.{n}.weight": torch.randn(12, 8) for n in ("gate_proj", "up_proj")}
    state["model.norm.weight"] = torch.randn(8)
    merged = merge_projections(state)
    assert merged["model.layers.0.self_attn.qkv_proj.weight"].shape == (16, 8)
    assert merged["model.layers.0.mlp.gate_up_proj.weight"].shape == (24, 8)
    back = split_projections(merged, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert np.array_equal(merged["model.norm.weight"].numpy(), state["model.norm.weight"].numpy())
