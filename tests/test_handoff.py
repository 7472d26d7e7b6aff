"""Prefill/decode disaggregation in the engines, on the tiny test checkpoints: a prefill engine computes a prompt and
its first token and exports the request (engine/handoff.py); a decode engine imports it and goes on. What the two
emit together is what one engine emits alone, bit for bit: tokens, target logprobs, drafts and draft logprobs,
greedy and seeded, under every drafting method. A handoff that does not fit is refused by name, and one whose cached
blocks are gone on arrival is recomputed."""

from __future__ import annotations

import pytest

from shared.schemas import ChoiceProgress
from services.worker.engine.handoff import HandoffMismatch
from services.worker.handoff.format import decode, trim
from tests.handofffixture import decode_request, run_prefill
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, MAX_STEPS, METHOD_NAMES, METHODS, PROMPT_TEXTS, encode_prompts, make_engine, make_request, model_dirs,
    mtp_model_dir, mtp_model_dirs, outputs_of, run, single_thread, tiny_model_dir,
)

pytest.importorskip("transformers")

BLOCK_SIZE = 8
NUM_TOKENS = 20
SAMPLED = dict(temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:  # noqa: F811
    prompt = encode_prompts(tiny_model_dir, ["".join(PROMPT_TEXTS)])[0]
    assert len(prompt) % BLOCK_SIZE  # a partial last block travels too
    return prompt


def _record(outputs) -> list:
    """Everything a stream carries of the outputs, exactly."""
    record = []
    for out in outputs:
        record.append((out.offset, out.tokens, out.draft_tokens, out.num_accepted, out.target.logprobs.tobytes(),
                       out.target.token_ids.tobytes(), out.target.ranks.tobytes()))
        if out.draft is not None:
            record.append((out.draft.logprobs.tobytes(), out.draft.token_ids.tobytes()))
    return record


def _engines(model_dirs, name, **overrides):  # noqa: F811
    method = METHODS[name]
    return [
        make_engine(model_dirs(method), method, block_size=BLOCK_SIZE, role=role, **overrides)
        for role in ("both", "prefill", "decode")
    ]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", METHOD_NAMES)
def test_prefill_then_decode_emits_what_one_engine_does(name, sampling, model_dirs, prompt) -> None:  # noqa: F811
    both, prefill, decode_engine = _engines(model_dirs, name)
    options = dict(max_tokens=NUM_TOKENS, logprobs=2, include_draft_logprobs=True, **sampling)
    alone = make_request(prompt, **options)
    expected = outputs_of(run(both, {0: [alone]}), alone)
    request = make_request(prompt, **options)
    first, seq, payload = run_prefill(prefill, request)
    assert [len(o.tokens) for o in first] == [1]
    continued = decode_request(request, seq)
    decode_engine.add_request(continued, payload)
    rest = outputs_of(run(decode_engine, {}), continued)
    assert _record(first + rest) == _record(expected)
    assert rest[-1].seq.num_accepted_tokens == expected[-1].seq.num_accepted_tokens


def test_blocks_the_decode_worker_holds_need_not_travel(model_dirs, prompt) -> None:  # noqa: F811
    _, prefill, decode_engine = _engines(model_dirs, "mtp")
    options = dict(max_tokens=NUM_TOKENS, logprobs=1, **GREEDY)
    warm = make_request(prompt, **options)
    decode_engine.add_request(warm, run_prefill(prefill, warm)[2] and None)  # the decode engine computes it itself
    expected = [t for o in outputs_of(run(decode_engine, {}), warm) for t in o.tokens]
    request = make_request(prompt, **options)
    first, seq, payload = run_prefill(prefill, request)
    held = (len(prompt) - 1) // BLOCK_SIZE
    trimmed = trim(payload, held)
    assert decode(trimmed).meta.choices[0].first_block == held
    assert len(trimmed) < len(payload) / 4
    continued = decode_request(request, seq)
    decode_engine.add_request(continued, trimmed)
    rest = outputs_of(run(decode_engine, {}), continued)
    assert [t for o in first + rest for t in o.tokens] == expected
    assert (decode_engine.scheduler.handoffs_imported, decode_engine.scheduler.handoffs_recomputed) == (1, 0)


def test_a_handoff_whose_cached_blocks_are_gone_is_recomputed(model_dirs, prompt) -> None:  # noqa: F811
    both, prefill, decode_engine = _engines(model_dirs, "ngram")
    options = dict(max_tokens=NUM_TOKENS, **GREEDY)
    alone = make_request(prompt, **options)
    expected = [t for o in outputs_of(run(both, {0: [alone]}), alone) for t in o.tokens]
    request = make_request(prompt, **options)
    first, seq, payload = run_prefill(prefill, request)
    continued = decode_request(request, seq)
    decode_engine.add_request(continued, trim(payload, 2))  # blocks 0 and 1 were never computed there
    rest = outputs_of(run(decode_engine, {}), continued)
    assert [t for o in first + rest for t in o.tokens] == expected
    # Counted once, as recomputed: not also as imported (the handoff's KV arrived, but was not used).
    assert (decode_engine.scheduler.handoffs_imported, decode_engine.scheduler.handoffs_recomputed) == (0, 1)


def test_a_handoff_that_does_not_fit_is_refused_by_name(model_dirs, prompt) -> None:  # noqa: F811
    _, prefill, decode_engine = _engines(model_dirs, "naive")
    request = make_request(prompt, max_tokens=NUM_TOKENS, **GREEDY)
    _, seq, payload = run_prefill(prefill, request)
    continued = decode_request(request, seq)
    with pytest.raises(HandoffMismatch, match="not where its output stands"):
        stale = ChoiceProgress(index=0, output_token_ids=(*seq.output_ids, 5), next_seq_no=seq.target_seq_no + 1)
        decode_engine.add_request(continued.model_copy(update={"progress": (stale,)}), payload)
    with pytest.raises(HandoffMismatch, match="magic"):
        decode_engine.add_request(continued, b"XXXX" + payload[4:])
    with pytest.raises(HandoffMismatch, match="runs past"):
        decode_engine.add_request(continued, payload[:-1])
    other = make_engine(model_dirs(METHODS["naive"]), METHODS["naive"], block_size=2 * BLOCK_SIZE, role="decode")
    with pytest.raises(HandoffMismatch, match="in blocks of"):
        other.add_request(continued, payload)
    assert not decode_engine.has_work() and not other.has_work()


def test_every_choice_of_a_request_is_handed_off_together(model_dirs, prompt) -> None:  # noqa: F811
    both, prefill, decode_engine = _engines(model_dirs, "ngram")
    options = dict(max_tokens=NUM_TOKENS, **SAMPLED)
    alone = make_request(prompt, **options).model_copy(update={"n": 3})
    expected = {o.seq.choice: o.seq.output_ids for o in outputs_of(run(both, {0: [alone]}), alone)}
    request = make_request(prompt, **options).model_copy(update={"n": 3})
    _, seq, payload = run_prefill(prefill, request)
    choices = decode(payload).meta.choices
    assert [c.choice for c in choices] == [0, 1, 2]
    progress = tuple(
        ChoiceProgress(index=c.choice, output_token_ids=c.output_ids, next_seq_no=c.target_seq_no) for c in choices
    )
    continued = request.model_copy(update={"progress": progress, "sampling": seq.sampling})
    decode_engine.add_request(continued, payload)
    got = {o.seq.choice: o.seq.output_ids for o in outputs_of(run(decode_engine, {}), continued)}
    assert got == expected and len(got) == 3


@pytest.mark.parametrize("name", ["naive", "mtp"])
def test_choices_more_than_a_prefill_worker_holds_decode_there_and_the_rest_is_handed_off(
    name, model_dirs, prompt  # noqa: F811
) -> None:
    """n = 3 on a prefill worker of 2 slots: the two choices it holds would wait on the third for ever; they decode
    there instead, and the third is handed off once it has its first token. Every choice emits what it does on one
    engine."""
    both, prefill, decode_engine = _engines(model_dirs, name, max_num_seqs=2)
    options = dict(max_tokens=NUM_TOKENS, **SAMPLED)
    alone = make_request(prompt, **options).model_copy(update={"n": 3})
    expected = {}
    for out in outputs_of(run(both, {0: [alone]}), alone):
        expected.setdefault(out.seq.choice, []).extend(out.tokens)
    request = make_request(prompt, **options).model_copy(update={"n": 3})
    prefill.add_request(request)
    got, handoffs = {}, []
    for _ in range(MAX_STEPS):
        if not prefill.has_work():
            break
        for out in prefill.step():
            got.setdefault(out.seq.choice, []).extend(out.tokens)
        handoffs += prefill.hand_off_ready()
    else:
        pytest.fail("the prefill worker stopped making progress")
    ((seqs, payload),) = handoffs
    assert [s.choice for s in seqs] == [2]
    [seq] = seqs
    progress = ChoiceProgress(index=2, output_token_ids=tuple(seq.output_ids), next_seq_no=seq.target_seq_no)
    continued = request.model_copy(update={"progress": (progress,), "sampling": seq.sampling})
    decode_engine.add_request(continued, payload)
    for out in outputs_of(run(decode_engine, {}), continued):
        got[2].extend(out.tokens)
    assert got == expected


def test_a_handoff_with_no_pending_drafts_goes_on_as_one_engine_does(model_dirs, prompt) -> None:  # noqa: F811
    """Two tokens in all: the first one spends the draft budget, so the MTP drafter hands off zero drafts (empty
    sections), which the decode worker reads as such instead of refusing the request."""
    both, prefill, decode_engine = _engines(model_dirs, "mtp")
    options = dict(max_tokens=2, logprobs=1, include_draft_logprobs=True, **GREEDY)
    alone = make_request(prompt, **options)
    expected = outputs_of(run(both, {0: [alone]}), alone)
    request = make_request(prompt, **options)
    first, seq, payload = run_prefill(prefill, request)
    assert {s.name: s.shape for s in decode(payload).meta.sections}["0.draft_probs"][0] == 0
    continued = decode_request(request, seq)
    decode_engine.add_request(continued, payload)
    assert _record(first + outputs_of(run(decode_engine, {}), continued)) == _record(expected)
    assert decode_engine.scheduler.handoffs_recomputed == 0
