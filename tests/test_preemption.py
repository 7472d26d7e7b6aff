"""Preemption on the tiny checkpoints: with too few KV blocks for the batch, sequences are evicted, announced
in PREEMPTED records, recomputed, and every request still yields exactly the tokens it yields alone with
plenty of memory, greedy and seeded-sampled, for naive, ngram and mtp drafting."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from services.detokenizer.assembler import Record, RequestAssembler
from services.detokenizer.incremental import TokenTable
from services.worker.engine.engine import Engine, SeqOutput
from services.worker.publisher import step_frames
from shared.frames import FrameKind, SeqStatus, decode
from shared.schemas import DetokOpen, WorkRequest
from shared.tokenizer import Tokenizer
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs, prompts, run,
    single_thread, tiny_model_dir,
)

# Sequences of up to 64 positions in blocks of 8: 8 blocks hold one full-length sequence; four sequences of ~10-20
# prompt and 36 new tokens need ~25.
SMALL_CACHE = dict(max_model_len=64, block_size=8)
TIGHT_KV_BLOCKS = 12
MAX_TOKENS = 36
WORKER_ID = 5
SAMPLED = dict(temperature=0.8, top_p=0.95, ignore_eos=True, max_tokens=MAX_TOKENS)
GREEDY_ROW = GREEDY | dict(max_tokens=MAX_TOKENS)
PREEMPTION_METHODS = ("naive", "ngram", "mtp", "eagle3")


def _requests(prompts: list[list[int]]) -> list[WorkRequest]:
    """Greedy and seeded-sampled requests, all arriving at once."""
    return [
        make_request(prompt, **(GREEDY_ROW if i % 2 == 0 else SAMPLED | dict(seed=100 + i)))
        for i, prompt in enumerate(prompts)
    ]


def _run_with_frames(engine: Engine, requests: list[WorkRequest]) -> tuple[list[bytes], int]:
    """Steps until done, turning every step into its frames as the worker does; returns the frames and how
    many sequences were preempted."""
    frames: list[bytes] = []
    num_preempted = 0

    def publish(outputs: list[SeqOutput]) -> None:
        nonlocal num_preempted
        assert 0.0 <= engine.kv_usage <= 1.0
        num_preempted += len(engine.last_preempted)
        frames.extend(step_frames(outputs, WORKER_ID, engine.step_no, engine.last_preempted))

    run(engine, {0: requests}, on_step=publish)
    return frames, num_preempted


def _target_records(frames: list[bytes]) -> dict[str, list[Record]]:
    records: dict[str, list[Record]] = defaultdict(list)
    for buf in frames:
        frame = decode(buf)
        if frame.kind is FrameKind.TARGET:
            for request_id, rec, token_ids, logprobs, ranks in frame.rows():
                records[request_id].append(Record.from_row(rec, token_ids, logprobs, ranks))
    return records


def _tokens(records: list[Record]) -> list[int]:
    """The request's tokens, checking the records are gapless: seq_no counts up, each offset continues."""
    tokens: list[int] = []
    for seq_no, record in enumerate(records):
        assert (record.seq_no, record.offset) == (seq_no, len(tokens))
        tokens += record.token_ids[:, 0].tolist()
    return tokens


@pytest.fixture(scope="module")
def alone(model_dirs) -> Callable[[str, WorkRequest], list[int]]:
    """A request's tokens when it runs alone with the default (ample) KV cache."""

    def run_alone(method: str, request: WorkRequest) -> list[int]:
        engine = make_engine(model_dirs(METHODS[method]), METHODS[method], **SMALL_CACHE)
        frames, num_preempted = _run_with_frames(engine, [request])
        assert num_preempted == 0
        return _tokens(_target_records(frames)[request.request_id])

    return run_alone


@pytest.mark.parametrize("method", PREEMPTION_METHODS)
def test_preempted_requests_yield_the_tokens_they_yield_alone(model_dirs, prompts, alone, method) -> None:
    requests = _requests(prompts)
    engine = make_engine(
        model_dirs(METHODS[method]), METHODS[method], num_kv_blocks=TIGHT_KV_BLOCKS, **SMALL_CACHE
    )
    frames, num_preempted = _run_with_frames(engine, requests)
    assert num_preempted > 0
    records = _target_records(frames)
    preempted = {rid for rid, recs in records.items() if any(r.status is SeqStatus.PREEMPTED for r in recs)}
    assert preempted, "no PREEMPTED record was sent"
    for request in requests:
        recs = records[request.request_id]
        assert all(r.num_tokens == 0 for r in recs if r.status is SeqStatus.PREEMPTED)
        assert recs[-1].status is SeqStatus.FINISHED
        tokens = _tokens(recs)
        assert len(tokens) == MAX_TOKENS
        assert tokens == alone(method, request), f"request {request.request_id} changed under preemption"
    assert engine.kv_usage == 0.0  # every block is back in the pool


def test_the_detokenizer_takes_preempted_records_in_its_stride(tiny_model_dir, prompts) -> None:  # noqa: F811
    """A request's TARGET records, PREEMPTED ones included, assemble into the text of its tokens."""
    requests = _requests(prompts)
    engine = make_engine(tiny_model_dir, METHODS["ngram"], num_kv_blocks=TIGHT_KV_BLOCKS, **SMALL_CACHE)
    frames, num_preempted = _run_with_frames(engine, requests)
    assert num_preempted > 0
    tokenizer = Tokenizer(tiny_model_dir)
    table = TokenTable.from_tokenizer(tokenizer)
    for request_id, recs in _target_records(frames).items():
        open_msg = DetokOpen(
            request_id=request_id, reply_subject="test.replies", api="completion", num_prompt_tokens=1
        )
        assembler = RequestAssembler(open_msg, table)
        chunks = [c for c in (assembler.consume(r) for r in recs) if c is not None]
        assert all(c.error is None for c in chunks)
        assert chunks[-1].final and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert "".join(c.choice["text"] for c in chunks) == tokenizer.decode(_tokens(recs))
