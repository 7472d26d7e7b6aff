"""What the tests of the tool-call formats whose calls follow a control tag (Mistral, Granite) share: two tools and
the calls of them an answer holds, reading an answer whole and streamed in any cut, and random walks through the
grammars tool_choice imposes, token by token as the worker's masks would let a model write, read back by the
format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import torch

from services.detokenizer.incremental import IncrementalDecoder, TokenTable
from services.gateway.tools.formats import FORMATS, ToolFormat
from services.gateway.tools.tool_calls import StreamedToolCalls, message_with_calls
from services.gateway.tools.tool_request import ToolFields
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from tests.test_tool_calls import _assembled, _streamed

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
EXPECTED = [("get_weather", {"city": "Paris", "metric": True}), ("get_time", {})]  # the calls the answers hold
ALLOWED_TIME = {"type": "allowed_tools", "allowed_tools": {
    "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}


def check_reads_calls(format_name: str, answer: str, content: str) -> None:
    """`answer` holds EXPECTED after `content`: read so whole (finish_reason tool_calls), and streamed in any cut."""
    message = {"role": "assistant", "content": answer}
    assert message_with_calls(message, "stop", FORMATS[format_name]) == "tool_calls"
    assert message["content"] == (content or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == EXPECTED
    for pieces in ([], [1] * (len(answer) - 1), [3, 11, 7]):
        assert _assembled(_streamed(answer, pieces, format_name=format_name))[:3] == (content, EXPECTED, "tool_calls")


def check_stays_text(format_name: str, answer: str) -> None:
    """`answer` holds no calls: all of it content, whole and streamed."""
    message = {"role": "assistant", "content": answer}
    assert message_with_calls(message, "stop", FORMATS[format_name]) == "stop" and message["content"] == answer
    pieces = [2] * (len(answer) // 2)
    assert _assembled(_streamed(answer, pieces, format_name=format_name))[:3] == (answer, [], "stop")


def walk(
    ll: llguidance.LLTokenizer, grammar: str, tokenizer: Tokenizer, rng: random.Random,
    drawn_to: tuple[int, ...] = (), draw: float = 0.5, max_tokens: int | None = None,
) -> tuple[list[int], bool]:
    """(the tokens written, whether the grammar ended): each step a token the grammar allows, one of `drawn_to` (in
    order of preference, each allowed one taken with probability `draw`) or else any; at most `max_tokens`."""
    eos = next(iter(tokenizer.eos_token_ids))
    words = (tokenizer.vocab_size + 31) // 32
    matcher = llguidance.LLMatcher(ll, grammar)
    out: list[int] = []
    while not matcher.is_stopped() and (max_tokens is None or len(out) < max_tokens):
        mask = torch.full((words,), 0, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        allowed = [t for t in range(tokenizer.vocab_size) if mask[t // 32] >> (t % 32) & 1]
        token = next((t for t in drawn_to if t in allowed and rng.random() < draw), None)
        if token is None:
            token = rng.choice(allowed)
        assert matcher.consume_token(token)
        out.append(token)
    ended = matcher.is_stopped()
    return (out[:-1] if out and out[-1] == eos else out), ended


def _walks(fmt: ToolFormat, tokenizer: Tokenizer, spec: str, tmp_path: Path, seed: int, count: int, **options):
    """The walks through grammar `spec` that it ended: each its tokens and its text as the detokenizer makes it,
    keeping the format's tags."""
    eos = next(iter(tokenizer.eos_token_ids))
    ll = ll_tokenizer(tmp_path, tokenizer.vocab_size, (eos,))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=spec))
    table = TokenTable.from_tokenizer(tokenizer)
    rng = random.Random(seed)
    for _ in range(count):
        generated, ended = walk(ll, grammar, tokenizer, rng, **options)
        if ended:  # one cut short holds a call cut so, read as text
            yield generated, IncrementalDecoder(table, fmt.shown_special_ids).step(generated, final=True).text


def check_cut_forced_answer(fmt: ToolFormat, tokenizer: Tokenizer, generated: list[int], fields: ToolFields) -> None:
    """Every cut of a forced answer (max_tokens) reads, whole and streamed, as calls and no content: the markup of a
    call cut before its name is never text, and a named function's call stands from the first token on."""
    table = TokenTable.from_tokenizer(tokenizer)
    offered = {f.name for f in fields.callable}
    forced, parallel = fields.forced, fields.parallel_tool_calls
    for cut in range(1, len(generated)):
        text = IncrementalDecoder(table, fmt.shown_special_ids).step(generated[:cut], final=True).text
        message = {"role": "assistant", "content": text}
        assert message_with_calls(message, "length", fmt, parallel, forced) == "length"
        assert message["content"] is None, text
        whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert {name for name, _ in whole} <= offered, text
        if forced.name is not None:
            assert [name for name, _ in whole] == [forced.name], text
        streamed = StreamedToolCalls(fmt, parallel, forced)
        content, calls = "", {}
        for at in range(0, len(text), 3):
            choice = streamed.choice({"index": 0, "delta": {"content": text[at : at + 3]}, "logprobs": None,
                                      "finish_reason": "length" if at + 3 >= len(text) else None})
            content += choice["delta"].get("content") or ""
            for entry in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(entry["index"], ["", ""])
                call[0] += entry["function"].get("name") or ""
                call[1] += entry["function"].get("arguments") or ""
        assert content == "" and [tuple(calls[i]) for i in sorted(calls)] == whole, text


def forced_answers(fmt: ToolFormat, tokenizer: Tokenizer, tag: str, tool_choice, tmp_path: Path) -> list[str]:
    """The texts of walks through the grammar `tool_choice` forces (required or a named function) over WEATHER and
    TIME, each checked: it opens with the tag's token and reads as calls only, one where a function was named, each
    naming an offered function with arguments that follow its schema."""
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=tool_choice)
    spec = fmt.grammar(fields.callable, fields.forced_calls_parallel)
    eos = next(iter(tokenizer.eos_token_ids))
    texts = []
    for generated, text in _walks(fmt, tokenizer, spec, tmp_path, seed=7, count=8, drawn_to=(eos,)):
        assert generated[0] == tokenizer.special_tokens[tag]
        check_cut_forced_answer(fmt, tokenizer, generated, fields)
        content, calls = fmt.split(text)
        assert content == "" and calls, text
        assert tool_choice == "required" or len(calls) == 1
        for call in calls:
            arguments = json.loads(call.arguments)
            if call.name == "get_weather":
                assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["metric"], bool)
            else:
                assert call.name == "get_time" and arguments == {}
        texts.append(text)
    return texts


def check_allowed_auto(fmt: ToolFormat, tokenizer: Tokenizer, tag: str, tmp_path: Path) -> None:
    """Walks through allowed_tools auto's grammar (TIME allowed of WEATHER and TIME), drawn to the tag: an answer is
    text without the tag's text, or calls after its token, and every call names the allowed function; both come."""
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=ALLOWED_TIME)
    spec = fmt.text_or_calls_grammar(fields.callable, True)
    eos, tag_id = next(iter(tokenizer.eos_token_ids)), tokenizer.special_tokens[tag]
    answers = {"text": 0, "calls": 0}
    for generated, text in _walks(fmt, tokenizer, spec, tmp_path, seed=11, count=24, drawn_to=(tag_id, eos),
                                  draw=0.2, max_tokens=64):
        content, calls = fmt.split(text)
        assert (tag_id in generated) == bool(calls) and [call.name for call in calls] == ["get_time"] * len(calls)
        answers["calls" if calls else "text"] += 1
    assert answers["text"] and answers["calls"]
