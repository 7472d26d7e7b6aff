"""The frame codec: what FrameBuilder packs, decode gives back; every inconsistency raises its own FrameError."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from shared import frames
from shared.frames import (
    HEADER,
    MAX_TOP_K,
    NO_TOKEN,
    RECORD,
    BadField,
    BadMagic,
    CountMismatch,
    FinishReason,
    FrameBuilder,
    FrameKind,
    SeqStatus,
    TruncatedFrame,
    UnsupportedVersion,
)
from shared.schemas import ChoiceProgress, SamplingParams, WorkRequest
from services.worker.publisher import abort_frame

RNG_SEED = 7


def _arrays(rng: np.random.Generator, n: int, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    token_ids = rng.integers(0, 50_000, size=(n, top_k + 1))
    logprobs = np.sort(rng.normal(-3.0, 1.0, size=(n, top_k + 1)), axis=1)[:, ::-1]
    ranks = rng.integers(1, top_k + 2, size=n)
    return token_ids, logprobs, ranks


def _two_record_frame(top_k: int = 2) -> bytes:
    builder = FrameBuilder(FrameKind.TARGET, worker_id=1, step=1, top_k=top_k)
    rng = np.random.default_rng(RNG_SEED)
    for _ in range(2):
        token_ids, logprobs, ranks = _arrays(rng, 3, top_k)
        builder.add(uuid.uuid4().hex, seq_no=0, offset=0, token_ids=token_ids, logprobs=logprobs, ranks=ranks)
    return builder.encode()


def _patch(buf: bytes, dtype: np.dtype, index: int, field: str, value: int, offset: int = 0) -> bytes:
    raw = bytearray(buf)
    view = np.frombuffer(raw, dtype=dtype, count=index + 1, offset=offset)
    view[index][field] = value
    return bytes(raw)


@pytest.mark.parametrize("top_k", [0, 20])
def test_round_trip_keeps_every_record_and_array(top_k: int) -> None:
    rng = np.random.default_rng(RNG_SEED)
    builder = FrameBuilder(FrameKind.DRAFT, worker_id=3, step=2**40 + 5, top_k=top_k)
    sent = []
    for i, n in enumerate([3, 0, 1, 5]):
        request_id = uuid.uuid4().hex
        token_ids, logprobs, ranks = _arrays(rng, n, top_k)
        if top_k:
            token_ids[:, -1] = NO_TOKEN
            logprobs[:, -1] = -np.inf
        status = SeqStatus.FINISHED if i == 2 else SeqStatus.RUNNING
        reason = FinishReason.LENGTH if i == 2 else FinishReason.NONE
        builder.add(
            request_id, seq_no=i, offset=10 * i, token_ids=token_ids, logprobs=logprobs, ranks=ranks,
            num_accepted=min(n, 2), status=status, finish_reason=reason,
        )
        sent.append((request_id, i, 10 * i, min(n, 2), status, reason, token_ids, logprobs, ranks))
    buf = builder.encode()
    assert len(buf) == HEADER.itemsize + 4 * RECORD.itemsize + 9 * (8 * (top_k + 1) + 4)

    frame = frames.decode(buf)
    assert (frame.kind, frame.worker_id, frame.step, frame.top_k) == (FrameKind.DRAFT, 3, 2**40 + 5, top_k)
    rows = list(frame.rows())
    assert len(rows) == len(sent)
    for (rid, rec, ids, lps, rks), want in zip(rows, sent):
        want_rid, seq_no, offset, acc, status, reason, want_ids, want_lps, want_rks = want
        assert rid == want_rid
        assert (int(rec["seq_no"]), int(rec["offset"]), int(rec["num_accepted"])) == (seq_no, offset, acc)
        assert (int(rec["status"]), int(rec["finish_reason"])) == (status, reason)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(lps, want_lps.astype(np.float32))
        np.testing.assert_array_equal(rks, want_rks)


def test_empty_frame_round_trips() -> None:
    buf = FrameBuilder(FrameKind.TARGET, worker_id=0, step=9, top_k=MAX_TOP_K).encode()
    assert len(buf) == HEADER.itemsize
    frame = frames.decode(memoryview(buf))
    assert frame.step == 9 and len(frame.records) == 0 and frame.token_ids.shape == (0, MAX_TOP_K + 1)
    assert list(frame.rows()) == []


def test_builder_rejects_top_k_out_of_range_and_wrong_shapes() -> None:
    with pytest.raises(ValueError):
        FrameBuilder(FrameKind.TARGET, worker_id=0, step=0, top_k=MAX_TOP_K + 1)
    builder = FrameBuilder(FrameKind.TARGET, worker_id=0, step=0, top_k=2)
    with pytest.raises(ValueError):
        wrong_width = np.zeros((1, 2))
        builder.add(uuid.uuid4().hex, seq_no=0, offset=0, token_ids=wrong_width, logprobs=wrong_width, ranks=np.ones(1))


def test_short_header_is_truncated() -> None:
    with pytest.raises(TruncatedFrame) as err:
        frames.decode(_two_record_frame()[: HEADER.itemsize - 1])
    assert err.value.reason == "truncated"


def test_bad_magic() -> None:
    with pytest.raises(BadMagic) as err:
        frames.decode(_patch(_two_record_frame(), HEADER, 0, "magic", 0xDEADBEEF))
    assert err.value.reason == "bad_magic"


def test_bad_version() -> None:
    with pytest.raises(UnsupportedVersion) as err:
        frames.decode(_patch(_two_record_frame(), HEADER, 0, "version", frames.VERSION + 1))
    assert err.value.reason == "bad_version"


def test_bad_kind() -> None:
    with pytest.raises(BadField) as err:
        frames.decode(_patch(_two_record_frame(), HEADER, 0, "kind", 9))
    assert err.value.reason == "bad_field"


def test_top_k_above_the_maximum() -> None:
    with pytest.raises(BadField):
        frames.decode(_patch(_two_record_frame(), HEADER, 0, "top_k", MAX_TOP_K + 1))


def test_records_cut_off_are_truncated() -> None:
    buf = _two_record_frame()
    with pytest.raises(TruncatedFrame):
        frames.decode(buf[: HEADER.itemsize + RECORD.itemsize + 5])
    with pytest.raises(TruncatedFrame):
        frames.decode(_patch(buf, HEADER, 0, "num_records", 1000))


def test_arrays_shorter_than_announced() -> None:
    with pytest.raises(CountMismatch) as err:
        frames.decode(_two_record_frame()[:-4])
    assert err.value.reason == "count_mismatch"


def test_arrays_longer_than_announced() -> None:
    with pytest.raises(CountMismatch):
        frames.decode(_two_record_frame() + b"\0" * 4)
    with pytest.raises(CountMismatch):
        frames.decode(_patch(_two_record_frame(), RECORD, 1, "num_tokens", 2, offset=HEADER.itemsize))


def test_unknown_status_or_finish_reason() -> None:
    buf = _two_record_frame()
    with pytest.raises(BadField):
        frames.decode(_patch(buf, RECORD, 1, "status", max(SeqStatus) + 1, offset=HEADER.itemsize))
    with pytest.raises(BadField):
        frames.decode(_patch(buf, RECORD, 0, "finish_reason", max(FinishReason) + 1, offset=HEADER.itemsize))


def test_more_accepted_drafts_than_tokens() -> None:
    """A record accepting more drafts than it holds would break the detokenizer's acceptance tally: the frame is
    refused whole, as any malformed one (counted by reason), not half consumed."""
    buf = _two_record_frame()
    all_accepted = frames.decode(_patch(buf, RECORD, 1, "num_accepted", 3, offset=HEADER.itemsize))
    assert all_accepted.records[1]["num_accepted"] == 3
    with pytest.raises(BadField):
        frames.decode(_patch(buf, RECORD, 1, "num_accepted", 4, offset=HEADER.itemsize))


def test_a_refused_resumed_request_finishes_where_its_records_stand() -> None:
    resumed = WorkRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=(1, 2), n=2,
        progress=(ChoiceProgress(index=1, output_token_ids=(3, 4, 5), next_seq_no=2),),
        sampling=SamplingParams(max_tokens=3), detok_id="d", created=0.0,
    )
    ((request_id, rec, token_ids, _, _),) = frames.decode(abort_frame([resumed], 1, 9)).rows()
    assert request_id == resumed.request_id and len(token_ids) == 0
    assert (int(rec["seq_no"]), int(rec["offset"]), int(rec["choice"])) == (2, 3, 1)
    assert (rec["status"], rec["finish_reason"]) == (SeqStatus.FINISHED, FinishReason.ABORT)
