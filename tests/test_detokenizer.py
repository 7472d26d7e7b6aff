"""Detokenizer logic on a real byte-level BPE tokenizer and real frames: text, stop strings, logprobs, ordering."""

from __future__ import annotations

import sysconfig
import uuid
from pathlib import Path

import numpy as np
import pytest

from services.detokenizer.assembler import Record, RequestAssembler, frame_records
from services.detokenizer.handlers import encode_chunk
from services.detokenizer.incremental import IncrementalDecoder, TokenTable
from services.detokenizer.stop import StopMatcher
from services.worker.demo_model.tokenizer import train_tokenizer
from shared import frames
from shared.frames import NO_TOKEN, FinishReason, FrameBuilder, FrameKind, SeqStatus
from shared.schemas import Chunk, DetokOpen
from shared.tokenizer import Tokenizer

VOCAB_SIZE = 600
TRAINING_FILES = ("argparse.py", "codecs.py", "json/encoder.py")
CHOSEN_LOGPROB = -0.25
PROMPT_TOKENS = 7
REPLACEMENT = "\ufffd"


def train_tiny_tokenizer(out_dir: Path) -> Tokenizer:
    """A real byte-level BPE trained in well under a second on a few stdlib modules."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    train_tokenizer([(stdlib / name).read_text() for name in TRAINING_FILES], VOCAB_SIZE, out_dir)
    return Tokenizer(out_dir)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def table(tokenizer: Tokenizer) -> TokenTable:
    return TokenTable.from_tokenizer(tokenizer)


def byte_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text`: every multi-byte character is split across tokens."""
    return [tokenizer.token_bytes.index(bytes([b])) for b in text.encode("utf-8")]


def eos(tokenizer: Tokenizer) -> int:
    return min(tokenizer.eos_token_ids)


def opened(
    api: str = "chat", stop: tuple[str, ...] = (), logprobs: int | None = None, drafts: bool = False, **options
) -> DetokOpen:
    return DetokOpen(
        request_id=uuid.uuid4().hex,
        reply_subject="test.replies",
        api=api,
        stop=stop,
        logprobs=logprobs,
        include_draft_logprobs=drafts,
        num_prompt_tokens=PROMPT_TOKENS,
        **options,
    )


def record(
    ids: list[int],
    *,
    seq_no: int,
    offset: int,
    top_k: int = 0,
    num_accepted: int = 0,
    finish: FinishReason = FinishReason.NONE,
    kind: FrameKind = FrameKind.TARGET,
    chosen_logprob: float = CHOSEN_LOGPROB,
) -> Record:
    """Packs one record with FrameBuilder and decodes it, as the service would receive it."""
    n = len(ids)
    alternatives = [[t] + [(t + j) % VOCAB_SIZE for j in range(1, top_k + 1)] for t in ids]
    token_ids = np.array(alternatives).reshape(n, top_k + 1)
    logprobs = np.array([[chosen_logprob] + [-0.5 * j for j in range(1, top_k + 1)]] * n).reshape(n, top_k + 1)
    status = SeqStatus.RUNNING if finish == FinishReason.NONE else SeqStatus.FINISHED
    builder = FrameBuilder(kind, worker_id=1, step=seq_no, top_k=top_k)
    builder.add(
        uuid.uuid4().hex, seq_no=seq_no, offset=offset, token_ids=token_ids, logprobs=logprobs,
        ranks=np.ones(n), num_accepted=num_accepted, status=status, finish_reason=finish,
    )
    ((_, decoded),) = frame_records(frames.decode(builder.encode()))
    return decoded


def text_of(chunk: Chunk) -> str:
    return chunk.choice["delta"].get("content", "") if "delta" in chunk.choice else chunk.choice["text"]


def run_steps(assembler: RequestAssembler, steps: list[list[int]], finish: FinishReason, **kw) -> list[Chunk | None]:
    out, offset = [], 0
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        reason = finish if last else FinishReason.NONE
        out.append(assembler.consume(record(ids, seq_no=i, offset=offset, finish=reason, **kw)))
        offset += len(ids)
    return out


# --- incremental UTF-8 -------------------------------------------------------------------------------------------


def test_characters_split_across_tokens_and_steps_never_become_replacement_chars(tokenizer, table) -> None:
    text = "a 😀 中文 é!"
    ids = byte_tokens(tokenizer, text)
    decoder = IncrementalDecoder(table)
    pieces = [decoder.step(ids[i : i + 3]).text for i in range(0, len(ids), 3)]
    pieces.append(decoder.step([], final=True).text)
    assert "".join(pieces) == text
    assert all(REPLACEMENT not in p for p in pieces)


def test_decoding_matches_the_tokenizer_and_tracks_spans(tokenizer, table) -> None:
    text = "def frobnicate(x):\n    return x  # ünïcödé ✓\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(table)
    step = decoder.step(ids, final=True)
    assert step.text == tokenizer.decode(ids) == text
    assert step.spans[0][0] == 0 and step.spans[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(step.spans, step.spans[1:]))


def test_invalid_and_dangling_bytes_become_replacement_chars(tokenizer, table) -> None:
    decoder = IncrementalDecoder(table)
    lone_continuation = tokenizer.token_bytes.index(b"\x80")
    assert decoder.step([lone_continuation]).text == REPLACEMENT
    dangling = byte_tokens(tokenizer, "中")[:2]
    assert decoder.step(dangling).text == ""
    assert decoder.step([], final=True).text == REPLACEMENT


def test_special_tokens_render_as_nothing_but_have_a_display_name(tokenizer, table) -> None:
    decoder = IncrementalDecoder(table)
    assert decoder.step([eos(tokenizer)]).text == ""
    assert table.display(eos(tokenizer))[0] == "<|endoftext|>"


def test_display_of_a_utf8_fragment_uses_escaped_bytes(tokenizer, table) -> None:
    first = byte_tokens(tokenizer, "😀")[0]
    assert table.display(first) == ("bytes:\\xf0", [0xF0])
    word = tokenizer.encode("return", add_special_tokens=False)[0]
    assert table.display(word) == (tokenizer.decode([word]), list(tokenizer.decode([word]).encode()))


# --- stop strings ------------------------------------------------------------------------------------------------


def test_stop_matcher_holds_back_only_what_may_still_become_a_stop_string() -> None:
    matcher = StopMatcher(["abcdef", "xyz"])
    assert matcher.feed("12abcde").text == "12"  # max(len(stop)) - 1 = 5 characters held
    assert matcher.holding == 5
    assert matcher.feed("Q").text == "abcdeQ"
    assert matcher.feed("x").text == ""
    assert matcher.feed("y", final=True).text == "xy"


def test_stop_matcher_earliest_match_wins_over_list_order() -> None:
    matcher = StopMatcher(["world", "lo w", ""])
    released = matcher.feed("hello world")
    assert released.text == "hel"
    assert (released.match.start, released.match.end) == (3, 7)


def test_an_included_stop_string_holds_nothing_back_and_ends_the_output_after_itself() -> None:
    matcher = StopMatcher(["abcdef", "xyz"], include=True)
    assert matcher.feed("12abcde").text == "12abcde" and matcher.holding == 0
    assert matcher.feed("Q").text == "Q"
    assert matcher.feed("x").text == "x"
    released = matcher.feed("yz and more")  # the stop string began in text released before
    assert released.text == "yz"
    assert (released.match.start, released.match.end, released.match.cut) == (8, 11, 11)


def test_no_stop_string_ends_in_the_text_of_the_first_min_tokens_tokens() -> None:
    """vLLM's min_tokens: a stop string completed within that text is passed over, one begun in it and completed
    after it stops the output where it begins (with include_stop_str_in_output too)."""
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("xST", may_stop=False).text == "x"  # what may still become a stop string is held back
    assert matcher.feed("OP", may_stop=False).text == "STOP"  # and released once complete within min_tokens
    assert matcher.feed("ab").text == "ab"
    for include, cut in ((False, 2), (True, 6)):
        matcher = StopMatcher(["STOP"], include=include)
        released = [matcher.feed("abST", may_stop=False), matcher.feed("OP then")]
        assert released[1].match.stop == "STOP" and released[1].match.cut == cut
        assert "".join(r.text for r in released) == "abSTOP"[:cut]


def test_an_opening_leaves_out_the_options_at_their_defaults() -> None:
    """What a detokenizer of an earlier version, which refuses unknown fields, reads in a rolling upgrade."""
    plain, bounded = opened(api="completion"), opened(api="completion", min_tokens=3)
    assert b"min_tokens" not in plain.to_bytes() and b'"min_tokens":3' in bounded.to_bytes()
    assert DetokOpen.from_bytes(plain.to_bytes()) == plain and DetokOpen.from_bytes(bounded.to_bytes()) == bounded


def test_min_tokens_keeps_the_assembler_from_stopping_in_its_tokens(tokenizer, table) -> None:
    """Byte tokens: the first "##" ends at token 4, within min_tokens 4; the second stops the output."""
    assembler = RequestAssembler(opened(api="completion", stop=("##",), min_tokens=4), table)
    (chunk,) = run_steps(assembler, [byte_tokens(tokenizer, "a##b##c")], FinishReason.LENGTH)
    assert text_of(chunk) == "a##b" and chunk.choice["stop_reason"] == "##" and chunk.usage.completion_tokens == 6
    assembler = RequestAssembler(opened(api="completion", stop=("##",), min_tokens=2), table)
    (chunk,) = run_steps(assembler, [byte_tokens(tokenizer, "a##b##c")], FinishReason.LENGTH)
    assert text_of(chunk) == "a" and chunk.usage.completion_tokens == 3


def test_include_stop_str_in_output_keeps_the_stop_string_and_its_tokens_entries(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(api="completion", stop=("STOP",), logprobs=0,
                                        include_stop_str_in_output=True), table)
    steps = [byte_tokens(tokenizer, piece) for piece in ("ok S", "T", "OP and", " more")]
    chunks = run_steps(assembler, steps, FinishReason.LENGTH)
    assert [None if c is None else text_of(c) for c in chunks] == ["ok S", "T", "OP", None]
    assert chunks[2].final and chunks[2].choice["finish_reason"] == "stop"
    assert chunks[2].choice["logprobs"]["tokens"] == ["O", "P"]  # the tokens of the stop string, none after
    assert chunks[2].usage.completion_tokens == len("ok STOP")


def test_include_stop_str_in_output_renders_the_stop_token(tokenizer, table) -> None:
    stop_token = byte_tokens(tokenizer, "!")[0]  # a stop_token_ids entry with text of its own
    for include, text in ((False, "ok"), (True, "ok!")):
        assembler = RequestAssembler(opened(api="completion", include_stop_str_in_output=include), table)
        (chunk,) = run_steps(assembler, [byte_tokens(tokenizer, "ok") + [stop_token]], FinishReason.STOP)
        assert text_of(chunk) == text and chunk.usage.completion_tokens == 3


def test_skip_special_tokens_false_shows_their_text_and_logprobs(tokenizer, table) -> None:
    ids = byte_tokens(tokenizer, "a") + [eos(tokenizer)] + byte_tokens(tokenizer, "b")
    for skip, text, tokens in ((True, "ab", ["a", "b"]), (False, "a<|endoftext|>b", ["a", "<|endoftext|>", "b"])):
        assembler = RequestAssembler(opened(api="completion", logprobs=0, skip_special_tokens=skip), table)
        (chunk,) = run_steps(assembler, [ids], FinishReason.LENGTH)
        assert text_of(chunk) == text and chunk.choice["logprobs"]["tokens"] == tokens


def test_stop_strings_are_not_matched_in_control_tags_kept_for_the_parser(tokenizer, table) -> None:
    """A tag shown for the gateway's parser (here EOS's "<|endoftext|>") is not text the client sees: "|" inside it
    is no stop string, the one after it is; with skip_special_tokens false the client sees it, and it is."""
    ids = byte_tokens(tokenizer, "a") + [eos(tokenizer)] + byte_tokens(tokenizer, "b|c")
    for options, text in (
        ({"shown_special_ids": (eos(tokenizer),)}, "a<|endoftext|>b"), ({"skip_special_tokens": False}, "a<"),
    ):
        assembler = RequestAssembler(opened(api="completion", stop=("|",), **options), table)
        (chunk,) = run_steps(assembler, [ids], FinishReason.LENGTH)
        assert text_of(chunk) == text and chunk.choice["finish_reason"] == "stop", options


def test_stop_string_spanning_tokens_of_one_step_earliest_wins(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(stop=("world", "o w")), table)
    ids = tokenizer.encode("hello world and more", add_special_tokens=False)
    chunk = assembler.consume(record(ids, seq_no=0, offset=0))
    assert chunk.final and text_of(chunk) == "hell"
    assert chunk.choice["finish_reason"] == "stop" and assembler.cancel_reason == "stop_string"
    spans = IncrementalDecoder(table).step(ids).spans
    completing = next(i for i, (_, end) in enumerate(spans) if end >= len("hello w"))
    assert chunk.usage.completion_tokens == completing + 1 == chunk.num_tokens
    assert assembler.consume(record(ids, seq_no=1, offset=len(ids))) is None


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_the_final_chunk_names_what_stopped_it_as_vllms_stop_reason(tokenizer, table, api: str) -> None:
    """The stop string that matched (whichever of a step's tokens completed it), a stop token's id, and null for
    the tokenizer's EOS or a length finish; chunks before the final one carry no stop_reason."""
    ok, stop_token = byte_tokens(tokenizer, "ok"), byte_tokens(tokenizer, "!")[0]
    cases = [
        (("world", "o w"), [ok, byte_tokens(tokenizer, " hello world")], FinishReason.LENGTH, "o w"),
        ((), [ok, ok + [stop_token]], FinishReason.STOP, stop_token),
        ((), [ok, ok + [table.eos_token_id]], FinishReason.STOP, None),
        (("zz",), [ok, ok], FinishReason.LENGTH, None),
    ]
    assert table.eos_token_id is not None and table.eos_token_id != stop_token
    for stop, steps, finish, stop_reason in cases:
        chunks = [c for c in run_steps(RequestAssembler(opened(api, stop=stop), table), steps, finish) if c]
        assert chunks[-1].final and chunks[-1].choice["finish_reason"] in ("stop", "length")
        assert chunks[-1].choice["stop_reason"] == stop_reason, (stop, finish)
        assert all("stop_reason" not in c.choice for c in chunks[:-1])


def test_stop_string_forming_over_steps_is_held_back_then_released(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(api="completion", stop=("STOP",)), table)
    steps = [byte_tokens(tokenizer, piece) for piece in ("ok S", "T", "ep", " STO")]
    chunks = run_steps(assembler, steps, FinishReason.LENGTH)
    assert [None if c is None else text_of(c) for c in chunks] == ["ok ", None, "STep", " STO"]
    assert chunks[-1].final and chunks[-1].choice["finish_reason"] == "length"
    assert sum(c.num_tokens for c in chunks if c) == chunks[-1].usage.completion_tokens == 11


def test_stop_string_cut_drops_logprobs_of_tokens_after_it(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(api="completion", stop=("##",), logprobs=0), table)
    chunk = assembler.consume(record(byte_tokens(tokenizer, "ab##cd"), seq_no=0, offset=0))
    assert text_of(chunk) == "ab"
    assert chunk.choice["logprobs"]["tokens"] == ["a", "b"]
    assert chunk.choice["logprobs"]["text_offset"] == [0, 1]


def test_the_first_token_completing_a_stop_string_ends_the_output_however_steps_group_tokens(tokenizer, table) -> None:
    """"el" is complete at the third token, before "hello" is: the same text and token count whether the tokens come
    one a step or in one step (accepted drafts)."""
    ids = byte_tokens(tokenizer, "hello")
    for steps in ([[t] for t in ids], [ids]):
        assembler = RequestAssembler(opened(stop=("hello", "el")), table)
        chunks = [c for c in run_steps(assembler, steps, FinishReason.LENGTH) if c is not None]
        assert "".join(text_of(c) for c in chunks) == "h"
        assert chunks[-1].choice["finish_reason"] == "stop" and chunks[-1].usage.completion_tokens == 3


def test_stop_string_cut_drops_draft_logprobs_after_it(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(api="completion", stop=("b",), logprobs=0, drafts=True), table)
    draft = record(byte_tokens(tokenizer, "abc"), seq_no=0, offset=0, num_accepted=3, kind=FrameKind.DRAFT)
    chunk = assembler.consume(record(byte_tokens(tokenizer, "abcd"), seq_no=0, offset=0, num_accepted=3), draft)
    assert text_of(chunk) == "a" and chunk.choice["logprobs"]["tokens"] == ["a"]
    assert chunk.choice["draft_logprobs"]["tokens"] == ["a"] and chunk.choice["draft_logprobs"]["text_offset"] == [0]


# --- logprobs shapes ---------------------------------------------------------------------------------------------


def test_chat_logprobs_and_draft_logprobs_shape(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(logprobs=2, drafts=True), table)
    ids = byte_tokens(tokenizer, "hi!")
    draft = record([ids[0], ids[1], ids[0]], seq_no=0, offset=0, top_k=1, num_accepted=2, kind=FrameKind.DRAFT)
    chunk = assembler.consume(record(ids, seq_no=0, offset=0, top_k=4, num_accepted=2), draft)
    assert text_of(chunk) == "hi!"
    content = chunk.choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["h", "i", "!"]
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == CHOSEN_LOGPROB and first["bytes"] == [ord("h")]
    assert len(first["top_logprobs"]) == 2  # the request's own top-2 out of the frame's top-4
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    drafted = chunk.choice["draft_logprobs"]["content"]
    assert [e["accepted"] for e in drafted] == [True, True, False]
    assert all(len(e["top_logprobs"]) == 1 for e in drafted)


def test_completion_logprobs_and_draft_logprobs_shape(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(api="completion", logprobs=1, drafts=True), table)
    ids = byte_tokens(tokenizer, "ok")
    draft = record([ids[0], ids[0]], seq_no=0, offset=0, num_accepted=1, kind=FrameKind.DRAFT, chosen_logprob=0.0)
    first = assembler.consume(record(ids, seq_no=0, offset=0, top_k=1, num_accepted=1), draft)
    ending = byte_tokens(tokenizer, "!") + [eos(tokenizer)]
    last = assembler.consume(record(ending, seq_no=1, offset=2, top_k=1, finish=FinishReason.STOP))
    lp = first.choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == ["o", "k"] and lp["text_offset"] == [0, 1] and lp["token_logprobs"] == [CHOSEN_LOGPROB] * 2
    # The chosen token is always there, after the alternatives it is not among: logprobs + 1 entries at most.
    assert lp["top_logprobs"][0] == {table.display(ids[0] + 1)[0]: -0.5, "o": CHOSEN_LOGPROB}
    dl = first.choice["draft_logprobs"]
    assert set(dl) == {"tokens", "token_logprobs", "top_logprobs", "text_offset", "accepted"}
    assert dl["accepted"] == [True, False] and dl["token_logprobs"] == [0.0, 0.0] and dl["text_offset"] == [0, 1]
    assert last.final and text_of(last) == "!" and last.choice["finish_reason"] == "stop"
    assert last.choice["logprobs"]["tokens"] == ["!"]  # the EOS token is counted but gets no entry
    assert last.choice["draft_logprobs"]["tokens"] == []
    usage = {
        "prompt_tokens": PROMPT_TOKENS, "completion_tokens": 4, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": None, "speculative": None,
    }
    # No speculation summary unless the request asked for one, no prediction counts without a prediction.
    assert last.usage.model_dump() == usage


def test_unused_top_slots_and_impossible_logprobs(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(logprobs=2, drafts=True), table)
    ids = byte_tokens(tokenizer, "x")
    draft = record(ids, seq_no=0, offset=0, top_k=2, num_accepted=1, kind=FrameKind.DRAFT, chosen_logprob=0.0)
    point_mass = Record(
        draft.seq_no, draft.offset, draft.num_accepted, draft.status, draft.finish_reason,
        np.array([[ids[0], NO_TOKEN, NO_TOKEN]]), np.array([[0.0, -np.inf, -np.inf]]), draft.ranks, ids[:1],
    )
    chunk = assembler.consume(record(ids, seq_no=0, offset=0, top_k=2), point_mass)
    assert chunk.choice["draft_logprobs"]["content"][0]["top_logprobs"] == []
    assert Chunk.from_bytes(chunk.to_bytes()) == chunk


def test_no_logprobs_requested_means_null_and_no_drafts(tokenizer, table) -> None:
    for api in ("chat", "completion"):
        assembler = RequestAssembler(opened(api=api, drafts=True), table)
        chunk = assembler.consume(record(byte_tokens(tokenizer, "y"), seq_no=0, offset=0))
        assert chunk.choice["logprobs"] is None and "draft_logprobs" not in chunk.choice


def test_split_character_gets_entries_only_once_its_text_is_out(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(logprobs=0), table)
    ids = byte_tokens(tokenizer, "😀")
    assert assembler.consume(record(ids[:2], seq_no=0, offset=0)) is None  # never an empty non-final chunk
    chunk = assembler.consume(record(ids[2:], seq_no=1, offset=2))
    assert text_of(chunk) == "😀" and chunk.num_tokens == 4
    content = chunk.choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80"]
    assert [b for e in content for b in e["bytes"]] == list("😀".encode())


# --- finishing, ordering -----------------------------------------------------------------------------------------


def test_abort_ends_with_an_error_chunk(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(), table)
    assembler.consume(record(byte_tokens(tokenizer, "ab"), seq_no=0, offset=0))
    chunk = assembler.consume(record([], seq_no=1, offset=2, finish=FinishReason.ABORT))
    assert chunk.final and chunk.error and chunk.usage.completion_tokens == 2
    assert assembler.cancel_reason is None  # the worker ended it itself


def test_gap_in_target_records_fails_the_request(tokenizer, table) -> None:
    ids = byte_tokens(tokenizer, "abc")
    lost_record = RequestAssembler(opened(), table)
    lost_record.consume(record(ids[:1], seq_no=0, offset=0))
    chunk = lost_record.consume(record(ids[1:2], seq_no=2, offset=1))
    assert chunk.final and "lost frames" in chunk.error and lost_record.cancel_reason == "error"
    assert lost_record.consume(record(ids[2:], seq_no=3, offset=2)) is None
    lost_tokens = RequestAssembler(opened(), table)
    lost_tokens.consume(record(ids[:1], seq_no=0, offset=0))
    assert lost_tokens.consume(record(ids[2:], seq_no=1, offset=2)).error


def test_duplicate_records_are_ignored(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(), table)
    ids = byte_tokens(tokenizer, "abc")
    assert text_of(assembler.consume(record(ids[:2], seq_no=0, offset=0))) == "ab"
    assert assembler.consume(record(ids[:2], seq_no=0, offset=0)) is None
    assert assembler.consume(record(ids[1:2], seq_no=0, offset=1)) is None
    last = assembler.consume(record(ids[2:], seq_no=1, offset=2, finish=FinishReason.LENGTH))
    assert text_of(last) == "c" and last.usage.completion_tokens == 3 and last.seq == 1


def test_token_ids_outside_the_vocabulary_fail_the_request(table) -> None:
    assembler = RequestAssembler(opened(), table)
    chunk = assembler.consume(record([VOCAB_SIZE + 3], seq_no=0, offset=0))
    assert chunk.final and "outside the vocabulary" in chunk.error


def test_a_used_top_alternative_outside_the_vocabulary_fails_the_request(table) -> None:
    def with_slots(token_ids: list[list[int]]) -> Record:
        builder = FrameBuilder(FrameKind.TARGET, worker_id=1, step=0, top_k=len(token_ids[0]) - 1)
        shape = (len(token_ids), len(token_ids[0]))
        builder.add(uuid.uuid4().hex, seq_no=0, offset=0, token_ids=np.array(token_ids), logprobs=np.zeros(shape),
                    ranks=np.ones(len(token_ids)))
        ((_, decoded),) = frame_records(frames.decode(builder.encode()))
        return decoded

    bad = with_slots([[5, 6, 7], [6, 7, VOCAB_SIZE]])
    assert "outside the vocabulary" in RequestAssembler(opened(logprobs=2), table).consume(bad).error
    assert RequestAssembler(opened(logprobs=1), table).consume(bad).error is None  # a slot it did not ask for
    empty = with_slots([[5, NO_TOKEN, NO_TOKEN], [6, NO_TOKEN, NO_TOKEN]])
    assert RequestAssembler(opened(logprobs=2), table).consume(empty).error is None
    assert "outside the vocabulary" in RequestAssembler(opened(), table).consume(with_slots([[NO_TOKEN]])).error


# --- one pass over a frame, and the chunk's encoding -------------------------------------------------------------


def test_frame_records_read_every_record_as_rows_and_from_row_do() -> None:
    builder = FrameBuilder(FrameKind.TARGET, worker_id=2, step=7, top_k=1)
    for i, (n, status, reason) in enumerate(
        [(3, SeqStatus.RUNNING, FinishReason.NONE), (0, SeqStatus.PREEMPTED, FinishReason.NONE),
         (2, SeqStatus.FINISHED, FinishReason.STOP)]
    ):
        token_ids = np.arange(2 * n).reshape(n, 2) + 10 * i
        builder.add(
            uuid.uuid4().hex, seq_no=i, offset=4 * i, token_ids=token_ids, logprobs=-np.ones((n, 2)), ranks=np.ones(n),
            num_accepted=min(n, 1), status=status, finish_reason=reason,
        )
    frame = frames.decode(builder.encode())
    for (request_id, got), (want_id, rec, tok, lp, rk) in zip(frame_records(frame), frame.rows(), strict=True):
        want = Record.from_row(rec, tok, lp, rk)
        assert request_id == want_id
        assert (got.seq_no, got.offset, got.num_accepted, got.status, got.finish_reason, got.ids) == (
            want.seq_no, want.offset, want.num_accepted, want.status, want.finish_reason, want.ids
        )
        for name in ("token_ids", "logprobs", "ranks"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_encoded_chunk_reads_back_as_to_bytes_does(tokenizer, table) -> None:
    assembler = RequestAssembler(opened(logprobs=2, drafts=True), table)
    ids = byte_tokens(tokenizer, "hé")
    draft = record(ids[:2], seq_no=0, offset=0, top_k=2, num_accepted=1, kind=FrameKind.DRAFT, chosen_logprob=0.0)
    chunks = [
        assembler.consume(record(ids, seq_no=0, offset=0, top_k=2, num_accepted=1), draft),
        assembler.consume(record([eos(tokenizer)], seq_no=1, offset=len(ids), top_k=2, finish=FinishReason.STOP)),
        RequestAssembler(opened(), table).fail("the worker ended the request (ABORT)"),
    ]
    for chunk in chunks:
        assert Chunk.from_bytes(encode_chunk(chunk)) == Chunk.from_bytes(chunk.to_bytes()) == chunk
