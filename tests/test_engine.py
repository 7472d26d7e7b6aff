"""The engine on a tiny random checkpoint: greedy output equals transformers' generate with and without
speculation, seeded sampling does not depend on the batch, stop conditions, logprob arrays, and frames."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.engine import Engine, SeqOutput
from services.worker.publisher import step_frames
from shared.config import EngineConfig, SpeculativeConfig
from shared.frames import NO_TOKEN, FinishReason, FrameKind, SeqStatus, decode
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from tests.modelfixture import tiny_model_dir  # noqa: F401  (the fixture is used by name)

transformers = pytest.importorskip("transformers")

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
LOGPROB_TOLERANCE = 1e-4
REFERENCE_TOKENS = 40  # the longest greedy continuation a test compares
WORKER_ID = 3
NUM_FULL_DRAFTS = 5
MAX_STEPS = 1000  # far more than any test needs: a scheduler that stalls fails instead of hanging
PROMPT_TEXTS = (
    "def wrap(text, width=70):\n    return text",
    "import os\n",
    "class Template:\n    delimiter = '$'\n    idpattern = r'(?a:[_a-z][_a-z0-9]*)'\n",
    "for i in range(10):\n    print(i, i * i)\n",
)
METHODS = [("naive", 0), ("ngram", 1), ("ngram", 3), ("ngram", 5)]
GREEDY = dict(temperature=0.0, ignore_eos=True)
Steps = list[list[SeqOutput]]


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tiny matrices gain nothing from more, and on a busy shared CPU the threads of
    every small op wait on each other (a step runs ~30x slower with two threads than with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:  # noqa: F811
    tok = Tokenizer(tiny_model_dir)
    return [tok.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> "transformers.PreTrainedModel":  # noqa: F811
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_reference(reference) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation with EOS disabled, generated once per prompt (a greedy continuation
    of n tokens is the first n of a longer one)."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int], num_tokens: int) -> list[int]:
        assert num_tokens <= REFERENCE_TOKENS
        if tuple(prompt) not in memo:
            ids = torch.tensor([prompt])
            # An explicit mask: the prompt starts with <|endoftext|>, which is also the pad id transformers
            # would otherwise mask out.
            with torch.no_grad():
                out = reference.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=REFERENCE_TOKENS,
                    eos_token_id=None, pad_token_id=0,
                )
            memo[tuple(prompt)] = out[0, len(prompt) :].tolist()
            assert len(memo[tuple(prompt)]) == REFERENCE_TOKENS
        return memo[tuple(prompt)][:num_tokens]

    return generate


def _engine(
    model_dir: Path, method: str = "ngram", k: int = 3, max_num_seqs: int = MAX_NUM_SEQS, accept_policy: str = "normal"
) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, accept_policy=accept_policy)
    config = EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, speculative=spec)
    return Engine(config)


def _request(prompt: list[int], output: list[int] = (), **sampling) -> WorkRequest:
    return WorkRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, output_token_ids=output,
        sampling=SamplingParams(**sampling), created=0.0,
    )


def _run(
    engine: Engine, arrivals: dict[int, list[WorkRequest]], on_step: Callable[[list[SeqOutput]], None] | None = None
) -> Steps:
    """Steps until every request finished; requests in arrivals[i] are added before step i (0-based)."""
    steps: Steps = []
    pending = dict(arrivals)
    while pending or engine.has_work():
        assert len(steps) < MAX_STEPS, "the engine stopped making progress"
        for request in pending.pop(len(steps), []):
            engine.add_request(request)
        outputs = engine.step() if engine.has_work() else []
        if on_step is not None:
            on_step(outputs)
        steps.append(outputs)
    return steps


def _outputs(steps: Steps, request_id: str) -> list[SeqOutput]:
    return [o for outputs in steps for o in outputs if o.seq.request_id == request_id]


def _tokens(steps: Steps, request: WorkRequest) -> list[int]:
    """The request's emitted tokens, checking that each step's offset continues where the last one ended."""
    outs = _outputs(steps, request.request_id)
    offset = len(request.output_token_ids)
    for out in outs:
        assert out.offset == offset
        offset += len(out.tokens)
    return [t for out in outs for t in out.tokens]


def _run_alone(model_dir: Path, request: WorkRequest, method: str, k: int) -> list[int]:
    return _tokens(_run(_engine(model_dir, method, k), {0: [request]}), request)


@pytest.mark.parametrize("method,k", METHODS)
def test_greedy_alone_matches_transformers(tiny_model_dir, prompts, greedy_reference, method, k) -> None:  # noqa: F811
    engine = _engine(tiny_model_dir, method, k)
    request = _request(prompts[0], max_tokens=40, **GREEDY)
    steps = _run(engine, {0: [request]})
    assert _tokens(steps, request) == greedy_reference(prompts[0], 40)
    if k:  # tiny random models repeat themselves, so prompt lookup must have had drafts accepted
        assert engine.stats.num_accepted_tokens > 0
        assert len(steps) < 40


@pytest.mark.parametrize("method,k", METHODS)
def test_mixed_batch_greedy_matches_transformers_and_sampling_matches_alone(
    tiny_model_dir, prompts, greedy_reference, method, k  # noqa: F811
) -> None:
    greedy = [
        _request(prompts[0], max_tokens=24, **GREEDY),
        _request(prompts[2], max_tokens=30, logprobs=3, **GREEDY),
        _request(prompts[3], max_tokens=12, **GREEDY),
        _request(prompts[1], max_tokens=20, **GREEDY),  # joins late and waits for a slot
    ]
    sampled = [
        _request(prompts[1], max_tokens=16, temperature=0.8, seed=11, ignore_eos=True),
        _request(prompts[2], max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=5, ignore_eos=True),
    ]
    engine = _engine(tiny_model_dir, method, k)
    steps = _run(engine, {0: [greedy[0], sampled[0], greedy[1], greedy[2]], 4: [sampled[1], greedy[3]]})
    for request in greedy:
        expected = greedy_reference(list(request.prompt_token_ids), request.sampling.max_tokens)
        assert _tokens(steps, request) == expected
    for request in sampled:
        assert _tokens(steps, request) == _run_alone(tiny_model_dir, request, method, k)
    if k:
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method,k", [("naive", 0), ("ngram", 3)])
def test_same_seed_gives_same_tokens_and_another_seed_differs(tiny_model_dir, prompts, method, k) -> None:  # noqa: F811
    params = dict(max_tokens=24, temperature=1.0, ignore_eos=True)
    first = _run_alone(tiny_model_dir, _request(prompts[0], seed=42, **params), method, k)
    again = _run_alone(tiny_model_dir, _request(prompts[0], seed=42, **params), method, k)
    other = _run_alone(tiny_model_dir, _request(prompts[0], seed=43, **params), method, k)
    assert len(first) == 24
    assert first == again
    assert first != other


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resumed_request_continues_where_it_left_off(tiny_model_dir, prompts, temperature) -> None:  # noqa: F811
    params = dict(max_tokens=30, temperature=temperature, seed=8, ignore_eos=True)
    full = _run_alone(tiny_model_dir, _request(prompts[3], **params), "ngram", 3)
    resumed = _request(prompts[3], output=full[:10], **params)
    assert _run_alone(tiny_model_dir, resumed, "ngram", 3) == full[10:]


def test_reject_all_policy_reproduces_plain_decoding(tiny_model_dir, prompts) -> None:  # noqa: F811
    """Rejecting every draft emits what plain decoding emits at each position, sampled requests included."""
    # A low temperature keeps the sampled text repetitive enough for prompt lookup to draft.
    request = _request(prompts[0], max_tokens=30, temperature=0.01, seed=21, ignore_eos=True)
    engine = _engine(tiny_model_dir, "ngram", 3, accept_policy="reject_all")
    assert _tokens(_run(engine, {0: [request]}), request) == _run_alone(tiny_model_dir, request, "naive", 0)
    assert engine.stats.num_draft_tokens > 0 and engine.stats.num_accepted_tokens == 0


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_finishes_with_length(tiny_model_dir, prompts, max_tokens) -> None:  # noqa: F811
    request = _request(prompts[0], max_tokens=max_tokens, **GREEDY)
    reasons: list[FinishReason] = []  # read after each step: SeqOutput reports its sequence's current state

    def record(outputs: list[SeqOutput]) -> None:
        reasons.extend(o.finish_reason for o in outputs)

    steps = _run(_engine(tiny_model_dir, "ngram", 5), {0: [request]}, record)
    assert len(_tokens(steps, request)) == max_tokens
    assert reasons == [FinishReason.NONE] * (len(reasons) - 1) + [FinishReason.LENGTH]


def _full_draft_engine(model_dir: Path, max_model_len: int = MAX_MODEL_LEN) -> tuple[Engine, list[int]]:
    """An engine that drafts NUM_FULL_DRAFTS tokens every decode step, and the prompt that makes it so.

    The prompt holds every token id once; with 1-gram lookup any emitted token has occurred before, and with
    every draft accepted the sequence keeps copying the prompt after the model's one token per step.
    """
    spec = SpeculativeConfig(num_speculative_tokens=NUM_FULL_DRAFTS, min_ngram_size=1, accept_policy="accept_all")
    engine = Engine(EngineConfig(model=model_dir, max_num_seqs=1, max_model_len=max_model_len, speculative=spec))
    return engine, list(range(Tokenizer(model_dir).vocab_size))


def test_context_length_bounds_drafts_and_finishes_with_length(tiny_model_dir) -> None:  # noqa: F811
    """Drafts stop short of max_model_len: each step drafts at most what the context leaves, less the bonus token."""
    max_model_len = 600  # 513 tokens after prefill, 6 per step, then 3 left: room for 2 drafts
    engine, prompt = _full_draft_engine(tiny_model_dir, max_model_len)
    seq = engine.add_request(_request(prompt, max_tokens=max_model_len, **GREEDY))
    room: list[int] = []
    while engine.has_work():
        room.append(seq.max_new_tokens(max_model_len))
        outputs = engine.step()
        if len(room) > 1:
            assert len(outputs[0].draft_tokens) == min(NUM_FULL_DRAFTS, room[-1] - 1)
    assert min(room[1:]) < NUM_FULL_DRAFTS  # the context's end did bound the drafts
    assert seq.num_tokens == max_model_len and seq.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(_request([1] * max_model_len, **GREEDY))


def test_stop_token_among_accepted_drafts_drops_the_rest(tiny_model_dir) -> None:  # noqa: F811
    engine, prompt = _full_draft_engine(tiny_model_dir, max_model_len=1024)
    free_run = _request(prompt, max_tokens=30, **GREEDY)
    outs = _outputs(_run(engine, {0: [free_run]}), free_run.request_id)
    tokens = [t for o in outs for t in o.tokens]
    # The second draft of a later step, first emitted there: stopping on it leaves drafts after it unused.
    step = next(o for o in outs[2:] if o.draft_tokens[1] not in tokens[: o.offset + 1])
    stop_id = step.draft_tokens[1]
    engine, _ = _full_draft_engine(tiny_model_dir, max_model_len=1024)
    request = _request(prompt, max_tokens=30, stop_token_ids=[stop_id], **GREEDY)
    outs = _outputs(_run(engine, {0: [request]}), request.request_id)
    assert [t for o in outs for t in o.tokens] == tokens[: step.offset + 2]
    assert outs[-1].tokens[-1] == stop_id and outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].num_accepted == len(outs[-1].tokens) == 2  # both kept tokens are accepted drafts


@pytest.mark.parametrize("method,k", [("naive", 0), ("ngram", 3)])
def test_stop_token_ends_with_stop_and_is_the_last_token(
    tiny_model_dir, prompts, greedy_reference, method, k  # noqa: F811
) -> None:
    expected = greedy_reference(prompts[0], 40)
    stop_id = next(t for i, t in enumerate(expected) if i >= 10 and t not in expected[:i])  # first seen mid-way
    request = _request(prompts[0], max_tokens=40, stop_token_ids=[stop_id], **GREEDY)
    outs = _outputs(_run(_engine(tiny_model_dir, method, k), {0: [request]}), request.request_id)
    tokens = [t for o in outs for t in o.tokens]
    assert tokens == expected[: expected.index(stop_id) + 1] and len(tokens) > 10
    assert outs[-1].finish_reason is FinishReason.STOP
    assert tokens[-1] == stop_id


def test_abort_frees_the_slot_for_a_waiting_request(tiny_model_dir, prompts, greedy_reference) -> None:  # noqa: F811
    engine = _engine(tiny_model_dir, "ngram", 3, max_num_seqs=1)
    doomed = _request(prompts[2], max_tokens=40, **GREEDY)
    never_runs = _request(prompts[1], max_tokens=40, **GREEDY)
    waiting = _request(prompts[0], max_tokens=20, **GREEDY)
    for request in (doomed, never_runs, waiting):
        engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert engine.abort(never_runs.request_id).finish_reason is FinishReason.ABORT
    aborted = engine.abort(doomed.request_id)
    assert aborted.finish_reason is FinishReason.ABORT
    steps = _run(engine, {})
    assert _outputs(steps, doomed.request_id) == [] and _outputs(steps, never_runs.request_id) == []
    assert aborted.slot is None
    # The waiting request reuses the slot full of the aborted one's stale keys and values.
    assert _tokens(steps, waiting) == greedy_reference(prompts[0], 20)
    assert engine.abort(uuid.uuid4().hex) is None


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


def test_logprob_arrays_match_the_reference_model(tiny_model_dir, prompts, reference) -> None:  # noqa: F811
    top_k = 5
    wide = _request(prompts[0], max_tokens=30, logprobs=top_k, include_draft_logprobs=True, **GREEDY)
    narrow = _request(prompts[3], max_tokens=20, logprobs=2, temperature=0.7, seed=3, ignore_eos=True)
    steps = _run(_engine(tiny_model_dir, "ngram", 3), {0: [wide, narrow]})
    # Both were running through every step, so every record carries the widest top-K asked for.
    _assert_target_logprobs(reference, wide, _outputs(steps, wide.request_id), top_k)
    _assert_target_logprobs(reference, narrow, _outputs(steps, narrow.request_id), top_k)
    assert all(r == 1 for o in _outputs(steps, wide.request_id) for r in o.target.ranks)  # greedy picks the top
    assert all(o.draft is None for o in _outputs(steps, narrow.request_id))  # it did not ask for drafts


def test_ngram_draft_logprobs_are_a_point_mass(tiny_model_dir, prompts) -> None:  # noqa: F811
    request = _request(prompts[0], max_tokens=30, logprobs=3, include_draft_logprobs=True, **GREEDY)
    drafted = [o for o in _outputs(_run(_engine(tiny_model_dir), {0: [request]}), request.request_id) if o.draft_tokens]
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
    request = _request(prompts[1], max_tokens=10, **GREEDY)
    outs = _outputs(_run(_engine(tiny_model_dir), {0: [request]}), request.request_id)
    assert all(o.target.token_ids.shape == (len(o.tokens), 1) for o in outs)


def test_step_frames_decode_with_draft_first_and_counting_records(tiny_model_dir, prompts) -> None:  # noqa: F811
    with_drafts = _request(prompts[0], max_tokens=30, logprobs=2, include_draft_logprobs=True, **GREEDY)
    plain = _request(prompts[3], max_tokens=25, logprobs=1, temperature=0.8, seed=1, ignore_eos=True)
    late = _request(prompts[1], max_tokens=12, **GREEDY)
    engine = _engine(tiny_model_dir, "ngram", 3)
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

    _run(engine, {0: [with_drafts, plain], 3: [late]}, on_step=publish)
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
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=True)
    engine = Engine(EngineConfig(model=tiny_model_dir, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, speculative=spec))
    requests = [_request(p, max_tokens=30, **GREEDY) for p in prompts[:4]]
    steps = _run(engine, {0: requests})
    for request in requests:
        assert _tokens(steps, request) == greedy_reference(list(request.prompt_token_ids), 30)
    drafted_per_step = [len(o.draft_tokens) for outputs in steps for o in outputs]
    assert engine.stats.num_accepted_tokens > 0
    assert min(drafted_per_step) < 5  # the policy chose fewer drafts than the maximum somewhere
