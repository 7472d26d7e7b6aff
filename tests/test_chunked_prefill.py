"""Chunked prefill in the engine, on the tiny test checkpoints: a step computes at most max_num_batched_tokens rows
(decoding sequences' first), so a long prompt arrives over several steps while the others keep decoding, and
nothing it emits changes: greedy tokens equal transformers' under every drafting method, seeded samples and logprobs
do not depend on the piece size, MTP's acceptance neither, prompt scores and shared choices span pieces, a sequence
moved mid-prefill continues exactly (preemption with prompts in pieces: tests/test_prefix_caching.py), and rejection sampling stays lossless (chi-square) with prompts in
pieces and cached. With prefix caching on, as by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.worker.engine.scheduler import MIN_PROMPT_TOKENS, Scheduler
from services.worker.engine.sequence import Sequence
from shared.schemas import SamplingParams
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHOD_NAMES, METHODS, PROMPT_TEXTS, encode_prompts, greedy_reference, make_engine, make_request,
    model_dirs, mtp_model_dir, mtp_model_dirs, outputs_of, prompts, reference_model, run, single_thread,
    tiny_model_dir, tokens_of,
)
from tests.test_prefix_caching import long_prompt  # noqa: F401
from tests.test_reproducibility import (  # noqa: F401
    DISTRIBUTION_MAX_MODEL_LEN, NUM_SEEDS, chi_square_critical, chi_square_homogeneity, looping_prompt, second_tokens,
)

pytest.importorskip("transformers")

BLOCK_SIZE = 8
PIECE = 24  # rows a step computes: a long prompt takes several steps
NUM_TOKENS = 20
LOGPROB_TOLERANCE = 1e-5  # pieces and whole prompts are passes of other shapes: float32 summation order


def _engine(model_dirs, name: str, piece: int | None, **overrides):  # noqa: F811
    chunking = dict(max_num_batched_tokens=piece) if piece else dict(enable_chunked_prefill=False)
    return make_engine(model_dirs(METHODS[name]), METHODS[name], block_size=BLOCK_SIZE, **chunking, **overrides)


def _seq(steps, request) -> Sequence:
    return outputs_of(steps, request)[0].seq


def _logprobs(steps, request) -> np.ndarray:
    return np.concatenate([o.target.logprobs for o in outputs_of(steps, request)])


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_a_prompt_in_pieces_emits_what_a_whole_one_does(
    name, model_dirs, long_prompt, prompts, greedy_reference  # noqa: F811
) -> None:
    """Two short requests decode while the long one arrives in pieces; every output equals transformers'."""
    engine = _engine(model_dirs, name, PIECE)
    short = [make_request(p, max_tokens=NUM_TOKENS, **GREEDY) for p in prompts[:2]]
    long = make_request(long_prompt, max_tokens=NUM_TOKENS, logprobs=1, **GREEDY)
    passes: list[int] = []  # rows of each forward pass of the step under way
    step_rows: list[int] = []
    forward = engine.runner.forward

    def counting(token_rows, starts, slots):
        passes.append(sum(len(r) for r in token_rows))
        return forward(token_rows, starts, slots)

    def end_step(_) -> None:
        step_rows.append(sum(passes))
        passes.clear()

    engine.runner.forward = counting
    steps = run(engine, {0: short, 2: [long]}, end_step)
    for request in short + [long]:
        prompt = list(request.prompt_token_ids)
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS)
    first_token_step = next(i for i, out in enumerate(steps) if any(o.seq.request_id == long.request_id for o in out))
    assert first_token_step >= 2 + len(long_prompt) // PIECE  # it arrived in pieces
    decode_rows = 2 * (1 + METHODS[name].num_speculative_tokens)
    assert max(step_rows) <= max(PIECE, decode_rows + MIN_PROMPT_TOKENS)  # a step's passes, within its budget

    whole = _engine(model_dirs, name, None)
    again = make_request(long_prompt, max_tokens=NUM_TOKENS, logprobs=1, **GREEDY)
    alone = run(whole, {0: [again]})
    np.testing.assert_allclose(_logprobs(steps, long), _logprobs(alone, again), atol=LOGPROB_TOLERANCE)
    if METHODS[name].needs_mtp:  # the module caught up on every piece: it drafts as after a whole prompt
        assert _seq(steps, long).num_accepted_tokens == _seq(alone, again).num_accepted_tokens


@pytest.mark.parametrize("piece", [16, 40])
def test_a_seeded_sample_does_not_depend_on_the_piece_size(piece, model_dirs, long_prompt) -> None:  # noqa: F811
    def sample(engine) -> list[int]:
        request = make_request(long_prompt, max_tokens=NUM_TOKENS, temperature=1.0, seed=11)
        return tokens_of(run(engine, {0: [request]}), request)

    for name in ("ngram", "mtp"):
        assert sample(_engine(model_dirs, name, piece)) == sample(_engine(model_dirs, name, None))


def test_prompt_scores_span_the_pieces(tiny_model_dir: Path, long_prompt) -> None:  # noqa: F811
    def scores(engine):
        request = make_request(long_prompt, max_tokens=2, prompt_logprobs=2, **GREEDY)
        out = outputs_of(run(engine, {0: [request]}), request)[0]
        return out.prompt

    pieces = scores(make_engine(tiny_model_dir, METHODS["naive"], block_size=BLOCK_SIZE, max_num_batched_tokens=16))
    whole = scores(make_engine(tiny_model_dir, METHODS["naive"], block_size=BLOCK_SIZE, enable_chunked_prefill=False))
    assert len(pieces.ranks) == len(long_prompt) - 1
    np.testing.assert_array_equal(pieces.token_ids[:, 0], whole.token_ids[:, 0])
    np.testing.assert_allclose(pieces.logprobs, whole.logprobs, atol=LOGPROB_TOLERANCE)


def test_choices_sharing_a_prompt_follow_their_leader_across_pieces(
    tiny_model_dir: Path, long_prompt, greedy_reference  # noqa: F811
) -> None:
    engine = make_engine(tiny_model_dir, METHODS["ngram"], block_size=BLOCK_SIZE, max_num_batched_tokens=PIECE)
    request = make_request(long_prompt, max_tokens=NUM_TOKENS, **GREEDY).model_copy(update={"n": 3})
    steps = run(engine, {0: [request]})
    by_choice: dict[int, list[int]] = {}
    for outputs in steps:
        for out in outputs:
            by_choice.setdefault(out.seq.choice, []).extend(out.tokens)
    assert by_choice == {c: greedy_reference(long_prompt, NUM_TOKENS) for c in range(3)}


def test_a_request_moved_mid_prefill_continues_exactly_elsewhere(model_dirs, long_prompt) -> None:  # noqa: F811
    """A worker that leaves while a prompt is in pieces hands the request back with no output: the next worker
    serves it from the start, and a seeded sample comes out as if it had never moved."""
    request = make_request(long_prompt, max_tokens=NUM_TOKENS, temperature=1.0, seed=3)
    leaving = _engine(model_dirs, "mtp", PIECE)
    leaving.add_request(request)
    for _ in range(2):
        assert leaving.step() == []  # still in pieces
    leaving.abort(request.request_id)
    taking_over = _engine(model_dirs, "mtp", PIECE)
    alone = _engine(model_dirs, "mtp", None)
    assert tokens_of(run(taking_over, {0: [request]}), request) == tokens_of(run(alone, {0: [request]}), request)


def test_decoding_sequences_get_their_rows_first_and_prompts_the_rest() -> None:
    scheduler = Scheduler(4, max_num_batched_tokens=40, rows_per_decode=4)
    decoding = [Sequence(f"{i:032x}", [1, 2, 3], SamplingParams(), 0, frozenset()) for i in range(2)]
    for seq in decoding:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in decoding:
        seq.num_computed, seq.output_ids = 3, [4]
    long = Sequence("f" * 32, list(range(100)), SamplingParams(), 0, frozenset())
    scheduler.add(long)
    plan = scheduler.schedule()
    assert plan.decodes == decoding and plan.prefills == [long] and plan.chunks == [40 - 2 * 4]
    long.num_computed += 32
    busy = Scheduler(4, max_num_batched_tokens=16, rows_per_decode=9)
    for seq in decoding + [long]:
        busy.running.append(seq)
    assert busy.schedule().chunks == [MIN_PROMPT_TOKENS]  # decoding rows fill the budget: prompts still progress


def test_rejection_keeps_the_target_distribution_with_prompts_in_pieces_and_cached(
    tiny_model_dir: Path, looping_prompt  # noqa: F811
) -> None:
    """test_reproducibility's chi-square test with both features at work: admission waits for the step's prompt
    budget, so the first request's prompt arrives in pieces and the later ones start from its cached blocks."""
    common = dict(num_speculative_tokens=1, max_num_seqs=NUM_SEEDS, max_model_len=DISTRIBUTION_MAX_MODEL_LEN)
    plain_engine = make_engine(
        tiny_model_dir, METHODS["naive"], enable_chunked_prefill=False, enable_prefix_caching=False, **common
    )
    plain = second_tokens(plain_engine, looping_prompt, 0)
    engine = make_engine(
        tiny_model_dir, METHODS["ngram"], min_ngram_size=1, block_size=BLOCK_SIZE, max_num_batched_tokens=32, **common
    )
    assert len(looping_prompt) > 32
    speculative = second_tokens(engine, looping_prompt, NUM_SEEDS)
    # Nearly every request after the first started from its cached blocks (a few were admitted beside it).
    cached_per_request = (len(looping_prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert engine.scheduler.prefix_hits >= 0.95 * NUM_SEEDS * cached_per_request
    assert engine.stats.num_drafts > NUM_SEEDS / 3
    statistic, dof = chi_square_homogeneity(plain, speculative)
    assert dof >= 3 and statistic < chi_square_critical(dof), (statistic, dof)
