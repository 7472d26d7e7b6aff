"""The prompt's part at the detokenizer (completions' echo, vLLM's prompt_logprobs) on a real tokenizer and real
PROMPT frames: text and entries first, the first token's logprob null, generated offsets after the prompt, parts
of bounded size, resent records ignored and lost ones failing the request."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from services.detokenizer.assembler import Record, RequestAssembler, frame_records
from services.detokenizer.logprobs import MIN_LOGPROB
from services.detokenizer.prompt import PROMPT_TOKENS_PER_PART
from shared import frames
from shared.frames import NO_TOKEN, FinishReason, FrameBuilder, FrameKind
from services.detokenizer.incremental import TokenTable
from shared.schemas import Chunk, DetokOpen
from shared.tokenizer import TOKENIZER_FILE, Tokenizer
from tests.test_detokenizer import record, table, tokenizer  # noqa: F401  (fixtures are used by name)

PROMPT_TEXT = "def read(path):\n    return open(path).read()\n"
OUTPUT_TEXT = "  # done"
SENTENCE = "Hello world, the quick brown fox jumps over the lazy dog."
SPECIALS = ["<unk>", "<s>", "</s>"]
TOP_K = 2
RANK = 4


def open_msg(prompt: list[int], api: str = "completion", **fields) -> DetokOpen:
    return DetokOpen(
        request_id=uuid.uuid4().hex, reply_subject="test.replies", api=api, num_prompt_tokens=len(prompt),
        prompt_token_ids=tuple(prompt), **fields,
    )


def prompt_record(prompt: list[int], start: int, end: int, seq_no: int = 0, top_k: int = TOP_K) -> Record:
    """A PROMPT record of prompt tokens start..end-1 with made-up scores: token i has logprob -i/10, its top
    alternatives are ids 1.. with logprobs -0.5, -1.0, ... and its rank is RANK."""
    n = end - start
    ids = np.array([[prompt[i]] + list(range(1, top_k + 1)) for i in range(start, end)]).reshape(n, top_k + 1)
    logprobs = np.array([[-i / 10] + [-0.5 * j for j in range(1, top_k + 1)] for i in range(start, end)])
    builder = FrameBuilder(FrameKind.PROMPT, worker_id=1, step=0, top_k=top_k)
    builder.add(uuid.uuid4().hex, seq_no=seq_no, offset=start, token_ids=ids, logprobs=logprobs.reshape(n, top_k + 1),
                ranks=np.full(n, RANK))
    ((_, decoded),) = frame_records(frames.decode(builder.encode()))
    return decoded


def finish(assembler: RequestAssembler, output: list[int], top_k: int = TOP_K) -> Chunk:
    return assembler.consume(record(output, seq_no=0, offset=0, top_k=top_k, finish=FinishReason.LENGTH))


def test_echo_without_logprobs_sends_the_prompt_text_before_the_first_tokens(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    assembler = RequestAssembler(open_msg(prompt, echo=True), table)
    (part,) = assembler.consume_prompt()
    assert part.choice["text"] == PROMPT_TEXT and part.choice["logprobs"] is None and part.num_tokens == 0
    assert assembler.consume_prompt() == []
    last = finish(assembler, tokenizer.encode(OUTPUT_TEXT))
    assert (last.seq, last.choice["text"], last.choice["finish_reason"]) == (1, OUTPUT_TEXT, "length")


def test_echo_with_logprobs_in_the_openai_completions_shape(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    output = tokenizer.encode(OUTPUT_TEXT)
    assembler = RequestAssembler(open_msg(prompt, echo=True, logprobs=TOP_K), table)
    assert assembler.consume_prompt() == []  # the scores are still to come
    parts = assembler.consume_prompt(prompt_record(prompt, 1, len(prompt)))
    last = finish(assembler, output)
    lp = parts[0].choice["logprobs"]
    assert "".join(c.choice["text"] for c in parts) == PROMPT_TEXT
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([-i / 10 for i in range(1, len(prompt))])
    chosen = {table.display(prompt[1])[0]: -0.1}  # the token itself, after its alternatives
    assert lp["top_logprobs"][1] == pytest.approx({table.display(1)[0]: -0.5, table.display(2)[0]: -1.0, **chosen})
    assert lp["text_offset"] == [len(tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
    generated = last.choice["logprobs"]
    assert generated["text_offset"][0] == len(PROMPT_TEXT)
    assert "".join(generated["tokens"]) == OUTPUT_TEXT


def test_prompt_logprobs_in_vllms_shape(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    assembler = RequestAssembler(open_msg(prompt, api="chat", prompt_logprobs=1), table)
    parts = assembler.consume_prompt(prompt_record(prompt, 1, len(prompt)))
    assert all(c.choice["delta"] == {} for c in parts)  # chat shows no echo
    shown = [entry for c in parts for entry in c.choice["prompt_logprobs"]]
    assert len(shown) == len(prompt) and shown[0] is None
    assert shown[1] == {
        str(prompt[1]): {"logprob": pytest.approx(-0.1), "rank": RANK, "decoded_token": table.display(prompt[1])[0]},
        "1": {"logprob": -0.5, "rank": 1, "decoded_token": table.display(1)[0]},
    }


def test_a_long_prompt_goes_out_in_parts_as_its_records_arrive(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT * 40)
    assert len(prompt) > 2 * PROMPT_TOKENS_PER_PART
    assembler = RequestAssembler(open_msg(prompt, echo=True, logprobs=0, prompt_logprobs=0), table)
    middle = PROMPT_TOKENS_PER_PART + 10
    first = assembler.consume_prompt(prompt_record(prompt, 1, middle, top_k=0))
    assert len(first) == 1  # one whole part; the tokens after it wait for more
    rest = assembler.consume_prompt(prompt_record(prompt, middle, len(prompt), seq_no=1, top_k=0))
    parts = first + rest
    assert [len(c.choice["logprobs"]["tokens"]) for c in parts[:-1]] == [PROMPT_TOKENS_PER_PART] * (len(parts) - 1)
    assert "".join(c.choice["text"] for c in parts) == PROMPT_TEXT * 40
    assert sum(len(c.choice["prompt_logprobs"]) for c in parts) == len(prompt)
    assert [c.seq for c in parts] == list(range(len(parts)))


def test_resent_prompt_records_are_ignored_and_overlaps_continue(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    assembler = RequestAssembler(open_msg(prompt, echo=True, logprobs=TOP_K), table)
    assert assembler.consume_prompt(prompt_record(prompt, 1, 5)) == []
    assert assembler.consume_prompt(prompt_record(prompt, 1, 5)) == []  # a worker that redid the prefill
    parts = assembler.consume_prompt(prompt_record(prompt, 3, len(prompt)))  # overlapping: only 5.. is new
    assert len(parts[0].choice["logprobs"]["tokens"]) == len(prompt)
    assert parts[0].error is None


def test_lost_prompt_records_fail_the_request(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    gap = RequestAssembler(open_msg(prompt, echo=True, logprobs=TOP_K), table)
    (failed,) = gap.consume_prompt(prompt_record(prompt, 3, len(prompt)))
    assert failed.final and "lost frames" in failed.error
    never = RequestAssembler(open_msg(prompt, prompt_logprobs=0), table)
    failed = finish(never, tokenizer.encode(OUTPUT_TEXT))
    assert failed.final and "PROMPT records" in failed.error


def test_prompt_records_must_hold_the_prompt(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode(PROMPT_TEXT)
    other = prompt[:1] + [t + 1 for t in prompt[1:]]
    assembler = RequestAssembler(open_msg(prompt, prompt_logprobs=1), table)
    (failed,) = assembler.consume_prompt(prompt_record(other, 1, len(other)))
    assert "other than the prompt" in failed.error


def test_an_impossible_prompt_logprob_is_sent_as_openais_stand_in(tokenizer, table) -> None:  # noqa: F811
    prompt = tokenizer.encode("x = 1")
    n = len(prompt) - 1
    builder = FrameBuilder(FrameKind.PROMPT, worker_id=1, step=0, top_k=1)
    builder.add(
        uuid.uuid4().hex, seq_no=0, offset=1, token_ids=np.array([[t, NO_TOKEN] for t in prompt[1:]]),
        logprobs=np.full((n, 2), -np.inf), ranks=np.full(n, RANK),
    )
    ((_, rec),) = frame_records(frames.decode(builder.encode()))
    assembler = RequestAssembler(open_msg(prompt, echo=True, logprobs=1, prompt_logprobs=1), table)
    (part,) = assembler.consume_prompt(rec)
    assert part.choice["logprobs"]["token_logprobs"][1:] == [MIN_LOGPROB] * n
    assert part.choice["prompt_logprobs"][1] == {
        str(prompt[1]): {"logprob": MIN_LOGPROB, "rank": RANK, "decoded_token": table.display(prompt[1])[0]}
    }


def _sentencepiece_tokenizer(directory: Path, decoder: str) -> Tokenizer:
    """A small SentencePiece-style tokenizer: words carry their space ("▁Hello"); the decoder drops the first one by a
    Strip step after Fuse (Llama 2) or by Metaspace's prepend scheme (Mistral v0.3)."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    if decoder == "strip":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator([PROMPT_TEXT, SENTENCE] * 20, trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    tok.save(str(directory / TOKENIZER_FILE))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(directory)


@pytest.mark.parametrize("decoder", ["strip", "metaspace"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_a_sentencepiece_prompt_echoes_as_the_tokenizer_decodes_it(tmp_path: Path, decoder: str, as_ids: bool) -> None:
    """The first word's space is dropped as decoding the prompt whole drops it; shown special tokens come first
    ("<s> Hello"), as they do there; the output after the prompt keeps its spaces."""
    tokenizer = _sentencepiece_tokenizer(tmp_path, decoder)
    assert tokenizer.leading_spaces_stripped == 1
    prompt = tokenizer.encode(SENTENCE)
    table = TokenTable.from_tokenizer(tokenizer)
    assembler = RequestAssembler(open_msg(prompt, echo=True, echo_special_tokens=as_ids), table)
    (part,) = assembler.consume_prompt()
    assert part.choice["text"] == tokenizer.decode(prompt, skip_special_tokens=not as_ids)
    output = tokenizer.encode("over the dog", add_special_tokens=False)  # "▁over ...": generated after the prompt
    assert finish(assembler, output).choice["text"] == " over the dog"
