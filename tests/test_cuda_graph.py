"""The CUDA-graph path's padding, run eagerly on the CPU (capture itself needs a GPU: tests/test_cuda.py): every
batch the engine can run has a shape, padding never touches a live sequence's cache, and an engine whose decode
and verify passes go through the padded path gives the same greedy tokens as transformers and seeded tokens
that do not depend on it."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from services.worker.engine.cuda_graph import GraphRunner, GraphShape, batch_buckets, pad_host
from services.worker.engine.forward_batch import pack_host
from services.worker.engine.kv_cache import KVCache
from shared.config import EngineConfig
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, PROMPT_TEXTS, encode_prompts, greedy_reference, make_engine, make_request, reference_model,
    run, tiny_model_dir, tokens_of,
)

pytest.importorskip("transformers")

NUM_TOKENS = 24


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 20, 64])
def test_every_batch_size_has_a_bucket_and_the_last_is_max_num_seqs(max_num_seqs: int) -> None:
    buckets = batch_buckets(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
    assert all(any(b >= n for b in buckets) for n in range(1, max_num_seqs + 1))


def test_padding_keeps_real_rows_and_sends_the_rest_to_the_padding_block() -> None:
    cache = KVCache(1, 4, 64, 1, 8, torch.float32, "cpu", block_size=16)
    rows, starts, slots = [[5, 6, 7], [8], [9, 10]], [10, 20, 3], [2, 0, 3]
    host = pack_host(cache, rows, starts, slots)
    shape = GraphShape(num_seqs=4, query_len=3)
    padded = pad_host(host, shape, cache)

    assert len(padded.input_ids) == shape.num_tokens and len(padded.context_lens) == shape.num_entries
    real = host.num_tokens
    np.testing.assert_array_equal(padded.input_ids[:real], host.input_ids)
    np.testing.assert_array_equal(padded.positions[:real], host.positions)
    np.testing.assert_array_equal(padded.slot_mapping[:real], host.slot_mapping)
    np.testing.assert_array_equal(padded.query_starts[: host.num_seqs + 1], host.query_starts)
    np.testing.assert_array_equal(padded.context_lens[: host.num_seqs], host.context_lens)
    # Padding rows write only to the padding block, and no entry takes more than query_len rows.
    pad_blocks = padded.slot_mapping[real:] // cache.block_size
    assert (pad_blocks == cache.padding_block).all()
    counts = np.diff(padded.query_starts)
    assert (counts <= shape.query_len).all() and padded.query_starts[-1] == shape.num_tokens
    # Each padding entry's context is its own rows, so its queries see only padding keys.
    np.testing.assert_array_equal(padded.context_lens[host.num_seqs :], counts[host.num_seqs :])
    assert (padded.block_tables[host.num_seqs :] == cache.padding_block).all()


def _padded_engine(model_dir, method, max_num_seqs: int = 4):
    """An engine whose decode and verify passes run through the graph path's padding, eagerly."""
    engine = make_engine(model_dir, method, max_num_seqs=max_num_seqs)
    runner = engine.runner
    widths = EngineConfig(device="cuda", speculative=method.config()).graph_query_lens
    runner.graphs = GraphRunner(runner.model.forward, runner.cache, max_num_seqs, widths, capture=False)
    return engine


@pytest.mark.parametrize("name", ["naive", "ngram"])
def test_padded_passes_give_transformers_greedy_tokens(tiny_model_dir, greedy_reference, name) -> None:  # noqa: F811
    prompts = encode_prompts(tiny_model_dir, PROMPT_TEXTS[:3])
    engine = _padded_engine(tiny_model_dir, METHODS[name])
    requests = [make_request(p, max_tokens=NUM_TOKENS, **GREEDY) for p in prompts]
    steps = run(engine, {0: requests[:2], 3: requests[2:]})  # the batch grows mid-run: two buckets
    for request, prompt in zip(requests, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS)


def test_padded_passes_keep_seeded_sampling(tiny_model_dir) -> None:  # noqa: F811
    prompt = encode_prompts(tiny_model_dir, PROMPT_TEXTS[:1])[0]
    sampled = dict(temperature=1.0, top_p=0.9, seed=11, ignore_eos=True, max_tokens=NUM_TOKENS)
    padded, plain = make_request(prompt, **sampled), make_request(prompt, **sampled)
    expected = tokens_of(run(make_engine(tiny_model_dir, METHODS["ngram"]), {0: [plain]}), plain)
    assert tokens_of(run(_padded_engine(tiny_model_dir, METHODS["ngram"]), {0: [padded]}), padded) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["naive", "ngram"])
def test_captured_graphs_replay_transformers_greedy_tokens(tiny_model_dir, greedy_reference, name) -> None:  # noqa: F811
    prompts = encode_prompts(tiny_model_dir, PROMPT_TEXTS[:3])
    engine = make_engine(tiny_model_dir, METHODS[name], device="cuda")
    assert engine.runner.graphs is not None and engine.runner.graphs.shapes
    requests = [make_request(p, max_tokens=NUM_TOKENS, **GREEDY) for p in prompts]
    steps = run(engine, {0: requests[:2], 3: requests[2:]})
    for request, prompt in zip(requests, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS)
    eager = make_engine(tiny_model_dir, METHODS[name], device="cuda", enforce_eager=True)
    assert eager.runner.graphs is None
