"""Prefix caching in the engine, on the tiny test checkpoints: a request whose prompt starts with blocks an earlier
request computed starts from them, and nothing it emits changes: greedy tokens equal transformers' and the cold
run's under every drafting method, logprobs equal the cold run's, seeded samples and MTP's acceptance too. The
salt keeps tenants apart, and a request that scores its prompt computes it whole."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    DRAFTING_METHOD_NAMES, GREEDY, METHOD_NAMES, METHODS, PROMPT_TEXTS, encode_prompts, greedy_reference, make_engine,
    make_request, model_dirs, mtp_model_dir, outputs_of, reference_model, run, tokens_of, tiny_model_dir,
    mtp_model_dirs, single_thread,
)

pytest.importorskip("transformers")

BLOCK_SIZE = 8
NUM_TOKENS = 24
LOGPROB_TOLERANCE = 1e-5  # the cached blocks were computed in a pass of another shape: float32 summation order


@pytest.fixture(scope="module")
def long_prompt(tiny_model_dir: Path) -> list[int]:  # noqa: F811
    """Every prompt text in one: several blocks, and a partial one at the end."""
    prompt = encode_prompts(tiny_model_dir, ["".join(PROMPT_TEXTS)])[0]
    assert len(prompt) > 4 * BLOCK_SIZE and len(prompt) % BLOCK_SIZE
    return prompt


def _cached_tokens(prompt: list[int]) -> int:
    """Every full block but the one holding the prompt's last token, which a fresh request computes itself."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def _logprobs(steps, request) -> np.ndarray:
    return np.concatenate([o.target.logprobs for o in outputs_of(steps, request)])


def _seq(steps, request):
    return outputs_of(steps, request)[0].seq


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_a_cached_prompt_emits_what_the_cold_one_did(
    name, model_dirs, long_prompt, greedy_reference  # noqa: F811
) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    cold, hot = (make_request(long_prompt, max_tokens=NUM_TOKENS, logprobs=2, **GREEDY) for _ in range(2))
    cold_steps = run(engine, {0: [cold]})
    hot_steps = run(engine, {0: [hot]})
    assert _seq(cold_steps, cold).num_cached_tokens == 0
    assert _seq(hot_steps, hot).num_cached_tokens == _cached_tokens(long_prompt)
    assert tokens_of(hot_steps, hot) == tokens_of(cold_steps, cold) == greedy_reference(long_prompt, NUM_TOKENS)
    np.testing.assert_allclose(_logprobs(hot_steps, hot), _logprobs(cold_steps, cold), atol=LOGPROB_TOLERANCE)
    if method.method == "suffix":
        return  # suffix decoding drafts from the cold request's output too: the hit drafts better, not the same
    # MTP drafts on a hit from the hidden state kept beside the last cached block: exactly as cold.
    assert _seq(hot_steps, hot).num_accepted_tokens == _seq(cold_steps, cold).num_accepted_tokens
    assert _seq(hot_steps, hot).num_draft_tokens == _seq(cold_steps, cold).num_draft_tokens
    assert engine.scheduler.prefix_hits == _cached_tokens(long_prompt)


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_a_seeded_sample_is_the_same_on_a_hit(name, model_dirs, long_prompt) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    cold, hot = (make_request(long_prompt, max_tokens=NUM_TOKENS, temperature=1.0, seed=7) for _ in range(2))
    cold_steps = run(engine, {0: [cold]})
    hot_steps = run(engine, {0: [hot]})
    assert _seq(hot_steps, hot).num_cached_tokens > 0
    assert tokens_of(hot_steps, hot) == tokens_of(cold_steps, cold)


@pytest.mark.parametrize("name", ["naive", "mtp", "draft_model"])
def test_the_output_of_a_finished_request_is_cached_for_the_next_turn(
    name, model_dirs, long_prompt, greedy_reference  # noqa: F811
) -> None:
    """A chat's next turn resends the last answer: its blocks were computed while it was generated."""
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    first = make_request(long_prompt[:BLOCK_SIZE + 1], max_tokens=NUM_TOKENS, **GREEDY)
    answer = tokens_of(run(engine, {0: [first]}), first)
    turn = long_prompt[:BLOCK_SIZE + 1] + answer + long_prompt[-5:]
    second = make_request(turn, max_tokens=8, **GREEDY)
    steps = run(engine, {0: [second]})
    # Every full block of the first sequence whose keys are all accepted tokens: the last emitted token's never are.
    computed = BLOCK_SIZE + 1 + NUM_TOKENS - 1
    assert _seq(steps, second).num_cached_tokens == computed // BLOCK_SIZE * BLOCK_SIZE
    assert tokens_of(steps, second) == greedy_reference(turn, 8)


@pytest.mark.parametrize("name", DRAFTING_METHOD_NAMES)
def test_a_one_token_request_leaves_its_prompt_cached(name, model_dirs, long_prompt) -> None:
    """A request that finishes with its prefill's token: every drafter's cache still catches up with its prompt,
    so the prompt's blocks go to the prefix cache for the next request."""
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    run(engine, {0: [make_request(long_prompt, max_tokens=1, **GREEDY)]})
    again = make_request(long_prompt, max_tokens=4, **GREEDY)
    assert _seq(run(engine, {0: [again]}), again).num_cached_tokens == _cached_tokens(long_prompt)


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_requests_in_flight_together_share_a_prefix_cached_before_them(name, model_dirs, long_prompt) -> None:
    """The second and third find the blocks where the first left them, in another slot's home region (copied to
    their own on the CPU)."""
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    warm = make_request(long_prompt, max_tokens=2, **GREEDY)
    run(engine, {0: [warm]})
    alone = make_request(long_prompt, max_tokens=NUM_TOKENS, **GREEDY)
    expected = tokens_of(run(engine, {0: [alone]}), alone)
    together = [make_request(long_prompt, max_tokens=NUM_TOKENS, **GREEDY) for _ in range(3)]
    steps = run(engine, {0: together[:2], 3: together[2:]})
    for request in together:
        assert _seq(steps, request).num_cached_tokens == _cached_tokens(long_prompt)
        assert tokens_of(steps, request) == expected


def test_an_echo_only_prompt_leaves_blocks_an_mtp_hit_drafts_from_exactly(
    model_dirs, long_prompt  # noqa: F811
) -> None:
    """A prompt of whole blocks scored and not continued (max_tokens 0): its last block's trunk state never pairs with
    a token, so that block is not cached, and a later request drafts from what is as a cold one does."""
    method = METHODS["mtp"]
    prompt = long_prompt[: 3 * BLOCK_SIZE]
    longer = long_prompt[: 3 * BLOCK_SIZE + 5]
    engine = make_engine(model_dirs(method), method, block_size=BLOCK_SIZE)
    run(engine, {0: [make_request(prompt, max_tokens=0, **GREEDY)]})
    hot = make_request(longer, max_tokens=NUM_TOKENS, **GREEDY)
    hot_seq = _seq(run(engine, {0: [hot]}), hot)
    cold = make_request(longer, max_tokens=NUM_TOKENS, **GREEDY)
    cold_seq = _seq(run(make_engine(model_dirs(method), method, block_size=BLOCK_SIZE), {0: [cold]}), cold)
    assert hot_seq.num_cached_tokens == 2 * BLOCK_SIZE
    assert (hot_seq.output_ids, hot_seq.num_accepted_tokens) == (cold_seq.output_ids, cold_seq.num_accepted_tokens)


def test_a_salt_keeps_its_requests_prefixes_to_themselves(tiny_model_dir: Path, long_prompt) -> None:  # noqa: F811
    engine = make_engine(tiny_model_dir, METHODS["naive"], block_size=BLOCK_SIZE)

    def cached(salt: str | None) -> int:
        request = make_request(long_prompt, max_tokens=1, **GREEDY).model_copy(update={"cache_salt": salt})
        return _seq(run(engine, {0: [request]}), request).num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached(None) == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") == _cached_tokens(long_prompt)
    assert cached(None) == _cached_tokens(long_prompt)


def test_without_prefix_caching_every_prompt_is_computed(tiny_model_dir: Path, long_prompt) -> None:  # noqa: F811
    engine = make_engine(tiny_model_dir, METHODS["naive"], block_size=BLOCK_SIZE, enable_prefix_caching=False)
    for _ in range(2):
        request = make_request(long_prompt, max_tokens=1, **GREEDY)
        assert _seq(run(engine, {0: [request]}), request).num_cached_tokens == 0
    assert engine.scheduler.prefix_queries == 0


def test_a_request_scoring_its_prompt_computes_it_whole(tiny_model_dir: Path, long_prompt) -> None:  # noqa: F811
    engine = make_engine(tiny_model_dir, METHODS["naive"], block_size=BLOCK_SIZE)
    cold = make_request(long_prompt, max_tokens=2, prompt_logprobs=1, **GREEDY)
    cold_out = outputs_of(run(engine, {0: [cold]}), cold)[0]
    hot = make_request(long_prompt, max_tokens=2, prompt_logprobs=1, **GREEDY)
    hot_out = outputs_of(run(engine, {0: [hot]}), hot)[0]
    assert hot_out.seq.num_cached_tokens == 0
    np.testing.assert_allclose(hot_out.prompt.logprobs, cold_out.prompt.logprobs, atol=LOGPROB_TOLERANCE)
    # It still leaves its blocks for those that do not score theirs.
    plain = make_request(long_prompt, max_tokens=2, **GREEDY)
    assert _seq(run(engine, {0: [plain]}), plain).num_cached_tokens == _cached_tokens(long_prompt)


@pytest.mark.parametrize("piece", [None, 24], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("name", ["naive", "mtp"])
def test_a_preempted_sequence_resumes_from_its_own_cached_blocks(
    name, piece, model_dirs, long_prompt, greedy_reference  # noqa: F811
) -> None:
    """Two sequences in a pool that holds one and a half, their prompts computed whole or in pieces of 24 tokens: the
    newer is preempted, its blocks stay cached, and it resumes from them with unchanged output."""
    method = METHODS[name]
    max_model_len = 128
    chunking = dict(max_num_batched_tokens=piece) if piece else dict(enable_chunked_prefill=False)
    engine = make_engine(
        model_dirs(method), method, block_size=BLOCK_SIZE, max_model_len=max_model_len,
        num_kv_blocks=max_model_len // BLOCK_SIZE * 3 // 2, **chunking,
    )
    prompts = [long_prompt, long_prompt[:1] + long_prompt[:0:-1]]
    requests = [make_request(prompt, max_tokens=NUM_TOKENS + 16, **GREEDY) for prompt in prompts]
    preempted = []
    steps = run(engine, {0: requests[:1], 1: requests[1:]}, lambda _: preempted.extend(engine.last_preempted))
    assert preempted
    for prompt, request in zip(prompts, requests):
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS + 16)
    assert engine.scheduler.prefix_hits > 0


def test_every_block_returns_to_the_pool_after_a_churn_of_shared_prefixes(
    tiny_model_dir: Path, long_prompt  # noqa: F811
) -> None:
    """Requests of random lengths over one prompt arrive, share choices, finish and are aborted mid-way; once idle,
    every block is free or idle in the cache, none lost."""
    rng = random.Random(0)
    engine = make_engine(tiny_model_dir, METHODS["ngram"], block_size=BLOCK_SIZE, max_num_seqs=3)
    live: list[str] = []
    for _ in range(200):
        if rng.random() < 0.3:
            request = make_request(
                long_prompt[: rng.randint(4, len(long_prompt))], max_tokens=rng.randint(1, 24), ignore_eos=True,
                temperature=rng.choice([0.0, 1.0]),
            ).model_copy(update={"n": rng.choice([1, 2])})
            engine.add_request(request)
            live.append(request.request_id)
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        if engine.has_work():
            engine.step()
    while engine.has_work():
        engine.step()
    engine.step()
    blocks = engine.scheduler.blocks
    assert blocks.num_used == 0 and blocks.cache.num_idle == blocks.cache.num_named > 0
    assert engine.scheduler.prefix_hits > 0
