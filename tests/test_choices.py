"""A request's n choices on the engine (tiny checkpoints): each choice yields what a single-choice request with its
derived seed yields alone, greedy choices all equal transformers', choices admitted together share their prompt's
full KV blocks, preemption and hand-back keep every choice's tokens, and the detokenizer assembles the choices as
one stream."""

from __future__ import annotations

import uuid
from collections import defaultdict

import numpy as np
import pytest

from services.detokenizer.choices import RequestChoices
from services.detokenizer.assembler import frame_records
from services.detokenizer.incremental import TokenTable
from services.worker.publisher import step_frames
from shared.frames import FinishReason, FrameBuilder, FrameKind, SeqStatus, decode
from shared.schemas import Cancel, ChoiceProgress, DetokOpen, SamplingParams, WorkRequest
from shared.seeds import choice_seed, worker_seed
from shared.tokenizer import Tokenizer
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs, prompts,
    reference_model, run, single_thread, tiny_model_dir, tokens_alone,
)

transformers = pytest.importorskip("transformers")

NUM_CHOICES = 3
MAX_TOKENS = 20
SEED = 41
SAMPLED = dict(temperature=0.9, top_p=0.95, ignore_eos=True, max_tokens=MAX_TOKENS, seed=SEED)
BLOCK_SIZE = 8
SMALL_CACHE = dict(max_model_len=64, block_size=BLOCK_SIZE)
TIGHT_KV_BLOCKS = 12  # fewer than 3 choices x 4 requests need: sequences are preempted
WORKER_ID = 3


def _choices_request(prompt: list[int], n: int = NUM_CHOICES, **sampling) -> WorkRequest:
    return WorkRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, n=n, sampling=SamplingParams(**sampling), created=0.0
    )


def _choice_tokens(steps, request: WorkRequest) -> dict[int, list[int]]:
    """Each choice's tokens, checking each step's offset continues where the choice's last one ended."""
    tokens: dict[int, list[int]] = defaultdict(list)
    for outputs in steps:
        for out in outputs:
            if out.seq.request_id == request.request_id:
                assert out.offset == len(tokens[out.seq.choice])
                tokens[out.seq.choice] += out.tokens
    return dict(tokens)


def _long_prompt(prompts: list[list[int]]) -> list[int]:
    """A prompt of a few KV blocks: its choices share all but the block of its last token."""
    return prompts[0] + prompts[2] + prompts[3]


@pytest.mark.parametrize("method", ["naive", "ngram", "mtp", "eagle3"])
def test_each_choice_yields_what_its_derived_seed_yields_alone(model_dirs, prompts, method) -> None:
    model_dir = model_dirs(METHODS[method])
    prompt = _long_prompt(prompts)
    request = _choices_request(prompt, **SAMPLED)
    steps = run(make_engine(model_dir, METHODS[method]), {0: [request]})
    tokens = _choice_tokens(steps, request)
    assert sorted(tokens) == list(range(NUM_CHOICES))
    for choice, emitted in tokens.items():
        alone = make_request(prompt, **(SAMPLED | dict(seed=choice_seed(worker_seed(SEED), choice))))
        assert emitted == tokens_alone(make_engine(model_dir, METHODS[method]), alone), f"choice {choice}"
    assert len({tuple(t) for t in tokens.values()}) > 1, "sampled choices should differ"


def test_greedy_choices_all_equal_transformers(tiny_model_dir, prompts, greedy_reference) -> None:  # noqa: F811
    prompt = _long_prompt(prompts)
    request = _choices_request(prompt, **GREEDY, max_tokens=MAX_TOKENS)
    tokens = _choice_tokens(run(make_engine(tiny_model_dir, METHODS["ngram"]), {0: [request]}), request)
    assert list(tokens.values()) == [greedy_reference(prompt, MAX_TOKENS)] * NUM_CHOICES


def test_choices_admitted_together_share_their_prompts_full_blocks(tiny_model_dir, prompts) -> None:  # noqa: F811
    prompt = _long_prompt(prompts)
    engine = make_engine(tiny_model_dir, METHODS["ngram"], block_size=BLOCK_SIZE)
    engine.add_request(_choices_request(prompt, **SAMPLED))
    engine.step()  # the prefill
    blocks = engine.scheduler.blocks
    tables = [blocks.table(seq.slot) for seq in engine.scheduler.running]
    shared = (len(prompt) - 1) // BLOCK_SIZE
    assert shared >= 2
    assert all(table[:shared] == tables[0][:shared] for table in tables)
    assert len({table[shared] for table in tables}) == NUM_CHOICES  # the block of the last prompt token is each's own
    assert blocks.num_used == len(tables[0]) + (NUM_CHOICES - 1) * (len(tables[0]) - shared)
    run(engine, {})
    assert blocks.num_used == 0  # shared blocks went back once their last owner finished


def test_choices_under_preemption_yield_their_tokens(tiny_model_dir, prompts) -> None:  # noqa: F811
    requests = [_choices_request(p, **(SAMPLED | dict(seed=SEED + i))) for i, p in enumerate(prompts)]
    roomy = make_engine(tiny_model_dir, METHODS["ngram"], **SMALL_CACHE)
    expected = [_choice_tokens(run(roomy, {0: [r]}), r) for r in requests]
    tight = make_engine(tiny_model_dir, METHODS["ngram"], num_kv_blocks=TIGHT_KV_BLOCKS, **SMALL_CACHE)
    num_preempted = 0

    def count(outputs) -> None:
        nonlocal num_preempted
        num_preempted += len(tight.last_preempted)

    steps = run(tight, {0: requests}, on_step=count)
    assert num_preempted > 0
    assert [_choice_tokens(steps, r) for r in requests] == expected
    assert tight.kv_usage == 0.0


def test_a_handed_back_choice_continues_alone(tiny_model_dir, prompts) -> None:  # noqa: F811
    request = _choices_request(prompts[1], **SAMPLED)
    full = _choice_tokens(run(make_engine(tiny_model_dir, METHODS["ngram"]), {0: [request]}), request)
    resumed = request.model_copy(
        update={"progress": (ChoiceProgress(index=2, output_token_ids=tuple(full[2][:7]), next_seq_no=5),)}
    )
    steps = run(make_engine(tiny_model_dir, METHODS["ngram"]), {0: [resumed]})
    outputs = [out for step in steps for out in step]
    assert {out.seq.choice for out in outputs} == {2}
    assert outputs[0].offset == 7 and outputs[0].seq.target_seq_no == 5  # its next TARGET record is number 5
    assert full[2][:7] + [t for out in outputs for t in out.tokens] == full[2]


def test_the_detokenizer_assembles_choices_as_one_stream(tiny_model_dir, prompts) -> None:  # noqa: F811
    """Frames of n choices (records carry the choice index) become one gapless chunk stream whose choices have
    their own indices and texts, whose last chunk is the only final one, with the usage of every choice."""
    request = _choices_request(prompts[0], **SAMPLED)
    engine = make_engine(tiny_model_dir, METHODS["ngram"])
    frames: list[bytes] = []
    steps = run(engine, {0: [request]}, on_step=lambda outs: frames.extend(step_frames(outs, WORKER_ID, engine.step_no)))
    tokens = _choice_tokens(steps, request)
    tokenizer = Tokenizer(tiny_model_dir)
    opened = DetokOpen(
        request_id=request.request_id, reply_subject="test.replies", api="completion",
        num_prompt_tokens=len(prompts[0]), n=NUM_CHOICES, return_token_ids=True,
    )
    assembler = RequestChoices(opened, TokenTable.from_tokenizer(tokenizer))
    chunks = []
    for buf in frames:
        frame = decode(buf)
        if frame.kind is FrameKind.TARGET:
            chunks += [c for _, record in frame_records(frame) if (c := assembler.consume(record)) is not None]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True] and assembler.finished
    for choice, emitted in tokens.items():
        mine = [c.choice for c in chunks if c.choice["index"] == choice]
        assert [t for c in mine for t in c["token_ids"]] == emitted
        assert "".join(c["text"] for c in mine) == tokenizer.decode(emitted)
        assert mine[-1]["finish_reason"] == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]), NUM_CHOICES * MAX_TOKENS)


def _record(request_id: str, choice: int, ids: list[int], finish: FinishReason = FinishReason.NONE):
    """A choice's first TARGET record, packed and decoded as the detokenizer receives it."""
    builder = FrameBuilder(FrameKind.TARGET, worker_id=WORKER_ID, step=1, top_k=0)
    status = SeqStatus.RUNNING if finish is FinishReason.NONE else SeqStatus.FINISHED
    builder.add(
        request_id, seq_no=0, offset=0, token_ids=np.array(ids)[:, None], logprobs=np.zeros((len(ids), 1)),
        ranks=np.ones(len(ids)), status=status, finish_reason=finish, choice=choice,
    )
    ((_, record),) = frame_records(decode(builder.encode()))
    return record


def test_a_choice_ending_on_a_stop_string_is_cancelled_alone(tiny_model_dir) -> None:  # noqa: F811
    tokenizer = Tokenizer(tiny_model_dir)
    request_id = uuid.uuid4().hex
    opened = DetokOpen(
        request_id=request_id, reply_subject="test.replies", api="completion", stop=("width",), num_prompt_tokens=4,
        n=2,
    )
    choices = RequestChoices(opened, TokenTable.from_tokenizer(tokenizer))
    stopped = choices.consume(_record(request_id, 0, tokenizer.encode("wrap(text, width=70)", False)))
    assert not stopped.final and stopped.choice["finish_reason"] == "stop" and stopped.choice["text"] == "wrap(text, "
    assert choices.take_cancels() == [Cancel(request_id=request_id, reason="stop_string", choice=0)]
    assert choices.consume(_record(request_id, 0, tokenizer.encode("more", False))) is None  # sent before the cancel
    other = tokenizer.encode("import os", False)
    last = choices.consume(_record(request_id, 1, other, FinishReason.LENGTH))
    assert last.final and last.seq == 1 and last.choice["index"] == 1 and choices.finished
    assert last.usage.completion_tokens == stopped.num_tokens + len(other)
    assert choices.take_cancels() == []  # the worker ended choice 1 itself
