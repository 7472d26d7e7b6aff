"""The batched prompt-lookup proposer (CUDA's ngram proposer; here on CPU tensors, where its launch runs the twin):
its token matrix follows each slot's sequence incrementally, through slot reuse, and it drafts exactly what the
host proposer drafts, so an engine using it still gives transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.drafting.ngram_device import DeviceNgramProposer
from services.worker.drafting.proposer import PromptLookupProposer
from services.worker.engine.sequence import Sequence
from shared.config import SpeculativeConfig
from shared.schemas import SamplingParams
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, PROMPT_TEXTS, encode_prompts, greedy_reference, make_engine, make_request, reference_model,
    run, tiny_model_dir, tokens_of,
)

CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_ngram_size=3, min_ngram_size=1)
MAX_NUM_SEQS, MAX_MODEL_LEN, VOCAB = 3, 256, 6  # a small vocabulary repeats itself, so lookups find matches


def _sequence(rng: random.Random, name: int) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 20))]
    return Sequence(f"{name:032x}", prompt, SamplingParams(max_tokens=64), 0, frozenset())


def test_batched_drafts_equal_the_host_proposers_through_growth_and_slot_reuse() -> None:
    rng = random.Random(0)
    device = DeviceNgramProposer(CONFIG, MAX_NUM_SEQS, MAX_MODEL_LEN, torch.device("cpu"))
    host = PromptLookupProposer(CONFIG)
    running = []
    for name in range(12):
        seq = _sequence(rng, name)
        seq.slot = name % MAX_NUM_SEQS  # each new sequence takes over a slot another one held
        running = [s for s in running if s.slot != seq.slot] + [seq]
        for _ in range(rng.randrange(1, 6)):
            budgets = [rng.randrange(0, 5) for _ in running]
            drafts = device.propose_batch(running, budgets)
            assert [d.tokens for d in drafts] == [host.propose(s, k).tokens for s, k in zip(running, budgets)]
            for s in running:
                s.output_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]
        for s in running:
            if device._owner[s.slot] is s:
                assert device.tokens[s.slot, : device._synced[s.slot]].tolist() == s.token_ids[: device._synced[s.slot]]


@pytest.mark.parametrize("k", [1, 3])
def test_engine_with_the_batched_proposer_gives_transformers_greedy_tokens(
    tiny_model_dir, greedy_reference, k  # noqa: F811
) -> None:
    prompts = encode_prompts(tiny_model_dir, PROMPT_TEXTS[:3])
    engine = make_engine(tiny_model_dir, METHODS["ngram"], num_speculative_tokens=k)
    engine.proposer = DeviceNgramProposer(
        engine.config.speculative, engine.config.max_num_seqs, engine.config.max_model_len, engine.runner.device
    )
    requests = [make_request(p, max_tokens=32, **GREEDY) for p in prompts]
    steps = run(engine, {0: requests[:2], 2: requests[2:]})
    for request, prompt in zip(requests, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, 32)
    assert engine.stats.num_accepted_tokens > 0
