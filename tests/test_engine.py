"""The engine on a tiny random checkpoint: greedy output equals transformers' generate with and without
speculation, seeded sampling does not depend on the batch, stop conditions, logprob arrays, and frames."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.engine.engine import Engine, SeqOutput
from services.worker.publisher import step_frames
from shared.frames import NO_TOKEN, FinishReason, FrameKind, SeqStatus, decode
from shared.schemas import WorkRequest
from shared.tokenizer import Tokenizer
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, MAX_MODEL_LEN, METHODS, PROMPT_TEXTS, encode_prompts, greedy_reference, make_engine, make_request,
    outputs_of, reference_model, run, single_thread, tiny_model_dir, tokens_alone, tokens_of,
)

pytest.importorskip("transformers")

LOGPROB_TOLERANCE = 1e-4
WORKER_ID = 3
NUM_FULL_DRAFTS = 5
# The shared prompts with a longer third one: the text these tests' drafting and acceptance checks were tuned on.
ENGINE_PROMPT_TEXTS = (
    *PROMPT_TEXTS[:2],
    "class Template:\n    delimiter = '$'\n    idpattern = r'(?a:[_a-z][_a-z0-9]*)'\n",
    *PROMPT_TEXTS[3:],
)
METHOD_K = [("naive", 0), ("ngram", 1), ("ngram", 3), ("ngram", 5)]
NGRAM = METHODS["ngram"]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:  # noqa: F811
    return encode_prompts(tiny_model_dir, ENGINE_PROMPT_TEXTS)


@pytest.mark.parametrize("method,k", METHOD_K)
def test_greedy_alone_matches_transformers(tiny_model_dir, prompts, greedy_reference, method, k) -> None:  # noqa: F811
    engine = make_engine(tiny_model_dir, METHODS[method], num_speculative_tokens=k)
    request = make_request(prompts[0], max_tokens=40, **GREEDY)
    steps = run(engine, {0: [request]})
    assert tokens_of(steps, request) == greedy_reference(prompts[0], 40)
    if k:  # tiny random models repeat themselves, so prompt lookup must have had drafts accepted
        assert engine.stats.num_accepted_tokens > 0
        assert len(steps) < 40


@pytest.mark.parametrize("method,k", METHOD_K)
def test_mixed_batch_greedy_matches_transformers_and_sampling_matches_alone(
    tiny_model_dir, prompts, greedy_reference, method, k  # noqa: F811
) -> None:
    greedy = [
        make_request(prompts[0], max_tokens=24, **GREEDY),
        make_request(prompts[2], max_tokens=30, logprobs=3, **GREEDY),
        make_request(prompts[3], max_tokens=12, **GREEDY),
        make_request(prompts[1], max_tokens=20, **GREEDY),  # joins late and waits for a slot
    ]
    sampled = [
        make_request(prompts[1], max_tokens=16, temperature=0.8, seed=11, ignore_eos=True),
        make_request(prompts[2], max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=5, ignore_eos=True),
    ]
    engine = make_engine(tiny_model_dir, METHODS[method], num_speculative_tokens=k)
    steps = run(engine, {0: [greedy[0], sampled[0], greedy[1], greedy[2]], 4: [sampled[1], greedy[3]]})
    for request in greedy:
        expected = greedy_reference(list(request.prompt_token_ids), request.sampling.max_tokens)
        assert tokens_of(steps, request) == expected
    for request in sampled:
        alone = make_engine(tiny_model_dir, METHODS[method], num_speculative_tokens=k)
        assert tokens_of(steps, request) == tokens_alone(alone, request)
    if k:
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method,k", [("naive", 0), ("ngram", 3)])
def test_same_seed_gives_same_tokens_and_another_seed_differs(tiny_model_dir, prompts, method, k) -> None:  # noqa: F811
    def alone(seed: int) -> list[int]:
        request = make_request(prompts[0], max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return tokens_alone(make_engine(tiny_model_dir, METHODS[method], num_speculative_tokens=k), request)

    first, again, other = alone(42), alone(42), alone(43)
    assert len(first) == 24
    assert first == again
    assert first != other


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resumed_request_continues_where_it_left_off(tiny_model_dir, prompts, temperature) -> None:  # noqa: F811
    params = dict(max_tokens=30, temperature=temperature, seed=8, ignore_eos=True)
    full = tokens_alone(make_engine(tiny_model_dir, NGRAM), make_request(prompts[3], **params))
    resumed = make_request(prompts[3], output_token_ids=full[:10], **params)
    assert tokens_alone(make_engine(tiny_model_dir, NGRAM), resumed) == full[10:]


def test_reject_all_policy_reproduces_plain_decoding(tiny_model_dir, prompts) -> None:  # noqa: F811
    """Rejecting every draft emits what plain decoding emits at each position, sampled requests included."""
    # A low temperature keeps the sampled text repetitive enough for prompt lookup to draft.
    request = make_request(prompts[0], max_tokens=30, temperature=0.01, seed=21, ignore_eos=True)
    engine = make_engine(tiny_model_dir, NGRAM, accept_policy="reject_all")
    assert tokens_alone(engine, request) == tokens_alone(make_engine(tiny_model_dir, METHODS["naive"]), request)
    assert engine.stats.num_draft_tokens > 0 and engine.stats.num_accepted_tokens == 0


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_finishes_with_length(tiny_model_dir, prompts, max_tokens) -> None:  # noqa: F811
    request = make_request(prompts[0], max_tokens=max_tokens, **GREEDY)
    reasons: list[FinishReason] = []  # read after each step: SeqOutput reports its sequence's current state

    def record(outputs: list[SeqOutput]) -> None:
        reasons.extend(o.finish_reason for o in outputs)

    steps = run(make_engine(tiny_model_dir, NGRAM, num_speculative_tokens=5), {0: [request]}, record)
    assert len(tokens_of(steps, request)) == max_tokens
    assert reasons == [FinishReason.NONE] * (len(reasons) - 1) + [FinishReason.LENGTH]


def _full_draft_engine(model_dir: Path, max_model_len: int = MAX_MODEL_LEN) -> tuple[Engine, list[int]]:
    """An engine that drafts NUM_FULL_DRAFTS tokens every decode step, and the prompt that makes it so.

    The prompt holds every token id once; with 1-gram lookup any emitted token has occurred before, and with
    every draft accepted the sequence keeps copying the prompt after the model's one token per step.
    """
    engine = make_engine(
        model_dir, NGRAM, max_num_seqs=1, max_model_len=max_model_len, num_speculative_tokens=NUM_FULL_DRAFTS,
        min_ngram_size=1, accept_policy="accept_all",
    )
    return engine, list(range(Tokenizer(model_dir).vocab_size))


def test_context_length_bounds_drafts_and_finishes_with_length(tiny_model_dir) -> None:  # noqa: F811
    """Drafts stop short of max_model_len: each step drafts at most what the context leaves, less the bonus token."""
    max_model_len = 600  # 513 tokens after prefill, 6 per step, then 3 left: room for 2 drafts
    engine, prompt = _full_draft_engine(tiny_model_dir, max_model_len)
    [seq] = engine.add_request(make_request(prompt, max_tokens=max_model_len, **GREEDY))
    room: list[int] = []
    while engine.has_work():
        room.append(seq.max_new_tokens(max_model_len))
        outputs = engine.step()
        if len(room) > 1:
            assert len(outputs[0].draft_tokens) == min(NUM_FULL_DRAFTS, room[-1] - 1)
    assert min(room[1:]) < NUM_FULL_DRAFTS  # the context's end did bound the drafts
    assert seq.num_tokens == max_model_len and seq.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(make_request([1] * max_model_len, **GREEDY))


def test_stop_token_among_accepted_drafts_drops_the_rest(tiny_model_dir) -> None:  # noqa: F811
    engine, prompt = _full_draft_engine(tiny_model_dir, max_model_len=1024)
    free_run = make_request(prompt, max_tokens=30, **GREEDY)
    outs = outputs_of(run(engine, {0: [free_run]}), free_run)
    tokens = [t for o in outs for t in o.tokens]
    # The second draft of a later step, first emitted there: stopping on it leaves drafts after it unused.
    step = next(o for o in outs[2:] if o.draft_tokens[1] not in tokens[: o.offset + 1])
    stop_id = step.draft_tokens[1]
    engine, _ = _full_draft_engine(tiny_model_dir, max_model_len=1024)
    request = make_request(prompt, max_tokens=30, stop_token_ids=[stop_id], **GREEDY)
    outs = outputs_of(run(engine, {0: [request]}), request)
    assert [t for o in outs for t in o.tokens] == tokens[: step.offset + 2]
    assert outs[-1].tokens[-1] == stop_id and outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].num_accepted == len(outs[-1].tokens) == 2  # both kept tokens are accepted drafts
    # The counters (metrics) count the accepted drafts that were emitted, as usage does; the adaptive controller
    # learns what the verification accepted (the stop after it is no rejection).
    emitted_drafts = sum(o.num_accepted for o in outs)
    assert outs[-1].seq.num_accepted_tokens == engine.stats.num_accepted_tokens == emitted_drafts
    engine, _ = _full_draft_engine(tiny_model_dir, max_model_len=1024)
    learned, observe = [], engine.controller.observe

    def heard(seq, drafted: int, accepted: int) -> None:
        learned.append((drafted, accepted))
        observe(seq, drafted, accepted)

    engine.controller.observe = heard
    again = make_request(prompt, max_tokens=30, stop_token_ids=[stop_id], **GREEDY)
    last = outputs_of(run(engine, {0: [again]}), again)[-1]
    drafted, accepted = learned[-1]
    assert drafted == accepted > last.num_accepted == 2  # accept_all: every draft verified, two of them kept


@pytest.mark.parametrize("method,k", [("naive", 0), ("ngram", 3)])
def test_stop_token_ends_with_stop_and_is_the_last_token(
    tiny_model_dir, prompts, greedy_reference, method, k  # noqa: F811
) -> None:
    expected = greedy_reference(prompts[0], 40)
    stop_id = next(t for i, t in enumerate(expected) if i >= 10 and t not in expected[:i])  # first seen mid-way
    request = make_request(prompts[0], max_tokens=40, stop_token_ids=[stop_id], **GREEDY)
    engine = make_engine(tiny_model_dir, METHODS[method], num_speculative_tokens=k)
    outs = outputs_of(run(engine, {0: [request]}), request)
    tokens = [t for o in outs for t in o.tokens]
    assert tokens == expected[: expected.index(stop_id) + 1] and len(tokens) > 10
    assert outs[-1].finish_reason is FinishReason.STOP
    assert tokens[-1] == stop_id


def test_abort_frees_the_slot_for_a_waiting_request(tiny_model_dir, prompts, greedy_reference) -> None:  # noqa: F811
    engine = make_engine(tiny_model_dir, NGRAM, max_num_seqs=1)
    doomed = make_request(prompts[2], max_tokens=40, **GREEDY)
    never_runs = make_request(prompts[1], max_tokens=40, **GREEDY)
    waiting = make_request(prompts[0], max_tokens=20, **GREEDY)
    for request in (doomed, never_runs, waiting):
        engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert [s.finish_reason for s in engine.abort(never_runs.request_id)] == [FinishReason.ABORT]
    [aborted] = engine.abort(doomed.request_id)
    assert aborted.finish_reason is FinishReason.ABORT
    steps = run(engine, {})
    assert outputs_of(steps, doomed) == [] and outputs_of(steps, never_runs) == []
    assert aborted.slot is None
    # The waiting request reuses the slot full of the aborted one's stale keys and values.
    assert tokens_of(steps, waiting) == greedy_reference(prompts[0], 20)
    assert engine.abort(uuid.uuid4().hex) == []


def _reference_logprobs(reference, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the reference model's logits at each output position: [len(output), vocab]."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_target_logprobs(reference, request: WorkRequest, outs: list[SeqOutput], top_k: int) -> None:
    tokens = [t for o in outs for t in o.tokens]
    ids = np.concatenate([o.target.token_ids for o in outs])
    logprobs = np.concatenate([o.target.logprobs for o in outs])
    ranks = np.concatenate([o.target.ranks for o in outs])
    assert ids.shape == logprobs.shape == (len(tokens), top_k + 1)
    assert ids[:, 0].tolist() == tokens
    expected = _reference_logprobs(reference, list(request.prompt_token_ids), tokens)
    chosen = expected.gather(1, torch.tensor(tokens)[:, None])
    top_ids = torch.from_numpy(ids[:, 1:]).long()
    assert np.abs(logprobs[:, :1] - chosen.numpy()).max() <= LOGPROB_TOLERANCE
    assert np.abs(logprobs[:, 1:] - expected.topk(top_k).values.numpy()).max() <= LOGPROB_TOLERANCE
    assert np.abs(logprobs[:, 1:] - expected.gather(1, top_ids).numpy()).max() <= LOGPROB_TOLERANCE
    assert (np.diff(logprobs[:, 1:], axis=1) <= 0).all()
    # Ranks within what float error allows: tokens closer than the tolerance may order either way.
    best_rank = ((expected > chosen + LOGPROB_TOLERANCE).sum(dim=1) + 1).numpy()
    worst_rank = ((expected > chosen - LOGPROB_TOLERANCE).sum(dim=1) + 1).numpy()
    assert (ranks >= 1).all() and (best_rank <= ranks).all() and (ranks <= worst_rank).all()


def test_logprob_arrays_match_the_reference_model(tiny_model_dir, prompts, reference_model) -> None:  # noqa: F811
    top_k = 5
    wide = make_request(prompts[0], max_tokens=30, logprobs=top_k, include_draft_logprobs=True, **GREEDY)
    narrow = make_request(prompts[3], max_tokens=20, logprobs=2, temperature=0.7, seed=3, ignore_eos=True)
    steps = run(make_engine(tiny_model_dir, NGRAM), {0: [wide, narrow]})
    # Both were running through every step, so every record carries the widest top-K asked for.
    _assert_target_logprobs(reference_model, wide, outputs_of(steps, wide), top_k)
    _assert_target_logprobs(reference_model, narrow, outputs_of(steps, narrow), top_k)
    assert all(r == 1 for o in outputs_of(steps, wide) for r in o.target.ranks)  # greedy picks the top
    assert all(o.draft is None for o in outputs_of(steps, narrow))  # it did not ask for drafts


def test_ngram_draft_logprobs_are_a_point_mass(tiny_model_dir, prompts) -> None:  # noqa: F811
    request = make_request(prompts[0], max_tokens=30, logprobs=3, include_draft_logprobs=True, **GREEDY)
    outs = outputs_of(run(make_engine(tiny_model_dir, NGRAM), {0: [request]}), request)
    drafted = [o for o in outs if o.draft_tokens]
    assert drafted and all(o.draft is not None for o in drafted)
    for out in drafted:
        ids, logprobs = out.draft.token_ids, out.draft.logprobs
        assert ids[:, 0].tolist() == out.draft_tokens
        assert out.tokens[: out.num_accepted] == out.draft_tokens[: out.num_accepted]
        assert (logprobs[:, 0] == 0.0).all() and (out.draft.ranks == 1).all()
        # One candidate: the drafted token heads the top-K list too; the other slots are empty.
        assert (ids[:, 1] == ids[:, 0]).all() and (logprobs[:, 1] == 0.0).all()
        assert (ids[:, 2:] == NO_TOKEN).all() and np.isneginf(logprobs[:, 2:]).all()


def test_logprobs_without_any_request_asking_have_only_the_chosen_slot(tiny_model_dir, prompts) -> None:  # noqa: F811
    request = make_request(prompts[1], max_tokens=10, **GREEDY)
    outs = outputs_of(run(make_engine(tiny_model_dir, NGRAM), {0: [request]}), request)
    assert all(o.target.token_ids.shape == (len(o.tokens), 1) for o in outs)


def test_step_frames_decode_with_draft_first_and_counting_records(tiny_model_dir, prompts) -> None:  # noqa: F811
    with_drafts = make_request(prompts[0], max_tokens=30, logprobs=2, include_draft_logprobs=True, **GREEDY)
    plain = make_request(prompts[3], max_tokens=25, logprobs=1, temperature=0.8, seed=1, ignore_eos=True)
    late = make_request(prompts[1], max_tokens=12, **GREEDY)
    engine = make_engine(tiny_model_dir, NGRAM)
    records: dict[tuple[FrameKind, str], list[tuple]] = defaultdict(list)
    emitted: dict[str, list[int]] = defaultdict(list)

    def publish(outputs: list[SeqOutput]) -> None:
        for out in outputs:
            emitted[out.seq.request_id] += out.tokens
        frames = [decode(raw) for raw in step_frames(outputs, WORKER_ID, engine.step_no)]
        assert [f.kind for f in frames] in ([FrameKind.TARGET], [FrameKind.DRAFT, FrameKind.TARGET], [])
        targets = {}
        for frame in reversed(frames):
            assert frame.step == engine.step_no and frame.worker_id == WORKER_ID
            for request_id, rec, ids, _, _ in frame.rows():
                chosen = ids[:, 0].tolist()
                if frame.kind is FrameKind.TARGET:
                    targets[request_id] = (int(rec["offset"]), chosen)
                else:  # a DRAFT record joins the TARGET record of its request and step: accepted drafts lead it
                    offset, emitted_now = targets[request_id]
                    accepted = int(rec["num_accepted"])
                    assert int(rec["offset"]) == offset and chosen[:accepted] == emitted_now[:accepted]
                records[frame.kind, request_id].append((rec.copy(), chosen))

    run(engine, {0: [with_drafts, plain], 3: [late]}, on_step=publish)
    for request in (with_drafts, plain, late):
        target = records[FrameKind.TARGET, request.request_id]
        assert [int(r["seq_no"]) for r, _ in target] == list(range(len(target)))
        offsets = np.cumsum([0] + [int(r["num_tokens"]) for r, _ in target])
        assert [int(r["offset"]) for r, _ in target] == offsets[:-1].tolist()
        assert [t for _, ids in target for t in ids] == emitted[request.request_id]
        assert [int(r["status"]) for r, _ in target] == [SeqStatus.RUNNING] * (len(target) - 1) + [SeqStatus.FINISHED]
        assert int(target[-1][0]["finish_reason"]) == FinishReason.LENGTH
    drafts = records[FrameKind.DRAFT, with_drafts.request_id]
    assert drafts and [int(r["seq_no"]) for r, _ in drafts] == list(range(len(drafts)))
    assert all(int(r["num_accepted"]) <= int(r["num_tokens"]) for r, _ in drafts)
    assert not records[FrameKind.DRAFT, plain.request_id] and not records[FrameKind.DRAFT, late.request_id]


def test_adaptive_speculation_keeps_greedy_output_and_trims_unpaid_drafts(
    tiny_model_dir, prompts, greedy_reference  # noqa: F811
) -> None:
    engine = make_engine(tiny_model_dir, NGRAM, num_speculative_tokens=5, adaptive=True)
    requests = [make_request(p, max_tokens=30, **GREEDY) for p in prompts[:4]]
    steps = run(engine, {0: requests})
    for request in requests:
        assert tokens_of(steps, request) == greedy_reference(list(request.prompt_token_ids), 30)
    drafted_per_step = [len(o.draft_tokens) for outputs in steps for o in outputs]
    assert engine.stats.num_accepted_tokens > 0
    assert min(drafted_per_step) < 5  # the policy chose fewer drafts than the maximum somewhere
