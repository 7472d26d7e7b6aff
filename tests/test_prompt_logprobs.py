"""Prompt logprobs at the worker (echo with logprobs, prompt_logprobs) on the tiny checkpoint: they equal the
log-softmax of transformers' logits over the prompt, only requests that ask get them, a request with max_tokens 0
ends with its prefill, PROMPT frames stay under their size limit, and a prompt is scored once under preemption."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from services.worker.publisher import prompt_frames, prompt_rows_per_frame, step_frames
from shared.frames import FinishReason, FrameKind, SeqStatus, decode
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, make_engine, make_request, outputs_of, prompts, reference_model, run, single_thread,
    tiny_model_dir,
)

pytest.importorskip("transformers")

TOLERANCE = 1e-4
WORKER_ID = 7
TOP_K = 3
NGRAM = METHODS["ngram"]


def reference_scores(model, prompt: list[int], top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' logprobs of prompt tokens 1.., their top-k ids and their ranks, computed directly."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # [P-1, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:])
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logits > logits.gather(1, targets[:, None])).sum(dim=-1) + 1
    return chosen.numpy(), logits.topk(top_k, dim=-1).indices.numpy(), ranks.numpy()


def prompt_records(frames: list[bytes]) -> dict[str, list]:
    records = defaultdict(list)
    for buf in frames:
        frame = decode(buf)
        if frame.kind is FrameKind.PROMPT:
            for request_id, rec, ids, logprobs, ranks in frame.rows():
                records[request_id].append((int(rec["seq_no"]), int(rec["offset"]), ids, logprobs, ranks))
    return records


def test_prompt_logprobs_equal_transformers_and_only_askers_get_them(tiny_model_dir, prompts, reference_model):  # noqa: F811
    scored = make_request(prompts[0], max_tokens=6, prompt_logprobs=TOP_K, **GREEDY)
    plain = make_request(prompts[1], max_tokens=6, logprobs=2, **GREEDY)
    echo_only = make_request(prompts[2], max_tokens=0, prompt_logprobs=0, logprobs=0, **GREEDY)
    engine = make_engine(tiny_model_dir, NGRAM, num_speculative_tokens=3)
    frames: list[bytes] = []
    steps = run(engine, {0: [scored, plain, echo_only]}, lambda outs: frames.extend(step_frames(outs, WORKER_ID, 0)))

    first, *later = outputs_of(steps, scored)
    expected, top, ranks = reference_scores(reference_model, prompts[0], TOP_K)
    assert first.prompt.token_ids[:, 0].tolist() == prompts[0][1:]
    np.testing.assert_allclose(first.prompt.logprobs[:, 0], expected, atol=TOLERANCE)
    np.testing.assert_array_equal(first.prompt.token_ids[:, 1:], top)
    np.testing.assert_array_equal(first.prompt.ranks, ranks)
    assert all(out.prompt is None for out in later), "a prompt is scored in its first prefill only"
    assert all(out.prompt is None for out in outputs_of(steps, plain))

    (ended,) = outputs_of(steps, echo_only)
    assert ended.tokens == [] and ended.seq.is_finished and ended.finish_reason is FinishReason.LENGTH
    np.testing.assert_allclose(ended.prompt.logprobs[:, 0], reference_scores(reference_model, prompts[2], 1)[0],
                               atol=TOLERANCE)

    records = prompt_records(frames)
    assert set(records) == {scored.request_id, echo_only.request_id}
    ((seq_no, offset, ids, _, _),) = records[scored.request_id]
    assert (seq_no, offset, ids[:, 0].tolist()) == (0, 1, prompts[0][1:])
    # The PROMPT frame goes out before the TARGET frame of the same step.
    kinds = [decode(buf).kind for buf in frames]
    assert kinds.index(FrameKind.PROMPT) < kinds.index(FrameKind.TARGET)


def test_long_prompts_are_split_into_frames_under_the_size_limit(tiny_model_dir, prompts):  # noqa: F811
    requests = [make_request(p, max_tokens=1, prompt_logprobs=TOP_K, **GREEDY) for p in prompts[:3]]
    engine = make_engine(tiny_model_dir, NGRAM)
    for request in requests:
        engine.add_request(request)
    outputs = engine.step()
    max_bytes = 512  # seven rows per frame at top-3
    frames = prompt_frames(outputs, WORKER_ID, engine.step_no, max_bytes)
    assert len(frames) > len(requests)
    assert all(len(buf) <= max_bytes for buf in frames)
    assert all(len(decode(buf).ranks) <= prompt_rows_per_frame(TOP_K, max_bytes) for buf in frames)
    records = prompt_records(frames)
    for request, out in zip(requests, outputs):
        parts = records[request.request_id]
        assert [seq_no for seq_no, *_ in parts] == list(range(len(parts)))
        offsets = [offset for _, offset, *_ in parts]
        sizes = [len(ranks) for *_, ranks in parts]
        assert offsets == [1 + sum(sizes[:i]) for i in range(len(parts))]
        np.testing.assert_array_equal(np.concatenate([ids for _, _, ids, _, _ in parts]), out.prompt.token_ids)
        np.testing.assert_array_equal(np.concatenate([lps for _, _, _, lps, _ in parts]), out.prompt.logprobs)


def test_a_prompt_is_scored_once_under_preemption(tiny_model_dir, prompts):  # noqa: F811
    requests = [
        make_request(p, max_tokens=36, prompt_logprobs=1, temperature=0.8, seed=i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    engine = make_engine(tiny_model_dir, NGRAM, max_model_len=64, block_size=8, num_kv_blocks=12)
    frames: list[bytes] = []
    preempted = 0

    def publish(outputs) -> None:
        nonlocal preempted
        preempted += len(engine.last_preempted)
        frames.extend(step_frames(outputs, WORKER_ID, engine.step_no, engine.last_preempted))

    run(engine, {0: requests}, publish)
    assert preempted > 0
    records = prompt_records(frames)
    for request in requests:
        ((seq_no, offset, ids, _, _),) = records[request.request_id]
        assert (seq_no, offset, ids[:, 0].tolist()) == (0, 1, list(request.prompt_token_ids[1:]))
    finished = [
        r for buf in frames if (f := decode(buf)).kind is FrameKind.TARGET for r in f.records
        if r["status"] == SeqStatus.FINISHED
    ]
    assert len(finished) == len(requests)


def test_the_choices_of_a_request_score_their_shared_prompt_once(tiny_model_dir, prompts, reference_model):  # noqa: F811
    base = make_request(prompts[3], max_tokens=4, prompt_logprobs=2, temperature=1.0, seed=3, ignore_eos=True)
    request = base.model_copy(update={"n": 3})
    engine = make_engine(tiny_model_dir, NGRAM, max_num_seqs=2)  # the third choice is admitted a step later
    frames: list[bytes] = []
    steps = run(engine, {0: [request]}, lambda outs: frames.extend(step_frames(outs, WORKER_ID, 0)))
    scored = [out for out in outputs_of(steps, request) if out.prompt is not None]
    assert [out.seq.choice for out in scored] == [0]
    np.testing.assert_allclose(scored[0].prompt.logprobs[:, 0], reference_scores(reference_model, prompts[3], 2)[0],
                               atol=TOLERANCE)
    assert len(prompt_records(frames)[request.request_id]) == 1
