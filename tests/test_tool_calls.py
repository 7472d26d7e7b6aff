"""Tool calls read out of chat answers, whole and streamed: however the text is cut into chunks (one character each,
or several whole calls in one, as multi-token acceptance produces), the stream's deltas add up to the whole answer's
calls, each announced once by index, id and name before its arguments; content outside calls streams as content; a
call cut short keeps its name and the arguments written; the grammars tool_choice imposes compile and force what
the schema fixes, allowed_tools' among them: `required` over the allowed functions, `auto` text or their calls."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.structured import StructuredOutput, check, grammar_of, ll_tokenizer
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.tools.formats import FORMATS, format_for, tool_constraint
from services.gateway.tools.tool_calls import StreamedToolCalls, message_with_calls
from services.gateway.tools.tool_request import Forced, ToolFields
from shared.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "specmesh-demo"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_ANSWER = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
)
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def _streamed(text: str, pieces: list[int], finish: str = "stop", format_name: str = "hermes", parallel: bool = True):
    """The chunks' choices for `text` cut at `pieces` (lengths), the last one finishing."""
    calls = StreamedToolCalls(FORMATS[format_name] if isinstance(format_name, str) else format_name, parallel)
    out, at = [], 0
    cuts = [*pieces, len(text)]
    for i, size in enumerate(cuts):
        piece = text[at : at + size] if i < len(pieces) else text[at:]
        at += len(piece)
        last = i == len(cuts) - 1
        out.append(calls.choice({"index": 0, "delta": {"content": piece}, "logprobs": None,
                                 "finish_reason": finish if last else None}))
    return out


def _assembled(choices) -> tuple[str, list[tuple[str, dict]], str | None, list[dict]]:
    content, calls, entries = "", {}, []
    for choice in choices:
        delta = choice["delta"]
        content += delta.get("content") or ""
        indexes = [entry["index"] for entry in delta.get("tool_calls", [])]
        assert len(indexes) == len(set(indexes)), "one entry per call in a delta, as OpenAI streams them"
        for entry in delta.get("tool_calls", []):
            entries.append(entry)
            call = calls.setdefault(entry["index"], {"name": None, "arguments": "", "id": None})
            if "id" in entry:
                assert call["id"] is None, "a call is announced once"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            else:
                assert call["id"] is not None, "the name comes before the arguments"
            call["arguments"] += entry["function"].get("arguments", "")
    ordered = [calls[i] for i in sorted(calls)]
    return content, [(c["name"], json.loads(c["arguments"])) for c in ordered], choices[-1]["finish_reason"], entries


@pytest.mark.parametrize("cut", ["whole", "characters", "several_calls_in_one_chunk", "tags_split"])
def test_streamed_calls_add_up_to_the_whole_answers(cut) -> None:
    pieces = {
        "whole": [],
        "characters": [1] * (len(HERMES_ANSWER) - 1),
        "several_calls_in_one_chunk": [5],
        "tags_split": [16, 3, 40, 9, 30],
    }[cut]
    content, calls, finish, _ = _assembled(_streamed(HERMES_ANSWER, pieces))
    assert (content, calls, finish) == ("Let me check.", EXPECTED, "tool_calls")
    message = {"role": "assistant", "content": HERMES_ANSWER}
    assert message_with_calls(message, "stop", FORMATS["hermes"]) == "tool_calls"
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == EXPECTED


@pytest.mark.parametrize("cut", [[], [5], [1] * (len(HERMES_ANSWER) - 1)], ids=["whole", "chunk", "characters"])
def test_without_parallel_tool_calls_only_the_first_call_is_returned(cut) -> None:
    """Under tool_choice auto nothing forces one call: parallel_tool_calls false keeps the first, whole and streamed."""
    content, calls, finish, _ = _assembled(_streamed(HERMES_ANSWER, cut, parallel=False))
    assert (content, calls, finish) == ("Let me check.", EXPECTED[:1], "tool_calls")
    message = {"role": "assistant", "content": HERMES_ANSWER}
    assert message_with_calls(message, "stop", FORMATS["hermes"], parallel=False) == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == (
        EXPECTED[:1]
    )


def test_text_without_calls_streams_unchanged_and_keeps_its_finish() -> None:
    text = "No tools needed: <tool is a word here> and <tool_c too."
    content, calls, finish, _ = _assembled(_streamed(text, [1] * (len(text) - 1)))
    assert (content, calls, finish) == (text, [], "stop")


def test_a_call_cut_short_keeps_its_name_and_the_arguments_written() -> None:
    """...compact as a whole call's (what went out while they were written), the rest as written."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    choices = _streamed(text, [20, 20], finish="length")
    entries = [e for c in choices for e in c["delta"].get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "get_weather"
    assert "".join(e["function"].get("arguments", "") for e in entries) == '{"city":"Pa'
    assert choices[-1]["finish_reason"] == "length"
    message = {"role": "assistant", "content": text}
    assert message_with_calls(message, "length", FORMATS["hermes"]) == "length"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city":"Pa'
    malformed = {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1, } trailing'}
    message_with_calls(malformed, "length", FORMATS["hermes"])
    assert malformed["tool_calls"][0]["function"]["arguments"] == '{"a":1, } trailing'


@pytest.mark.parametrize(
    "ending",
    ["\n</tool_ca", "\n</tool_call>\n<", "\n</tool_call>\n<tool", "\n</tool_call>\n<tool_call>\n{",
     '\n</tool_call>\n<tool_call>\n{"na'],
)
@pytest.mark.parametrize("cut", [[], [1] * 80], ids=["whole", "characters"])
def test_a_call_written_whole_but_cut_short_keeps_its_whole_arguments_and_nothing_else(ending, cut) -> None:
    """max_tokens may end an answer inside the closing tag, or inside a next call before its name: the arguments
    are the JSON written, without the call's closing brace or a tag's start, and no tag's start becomes content."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = call + ending
    content, calls, finish, _ = _assembled(_streamed(text, cut[: len(text) - 1], finish="length"))
    assert (content, calls, finish) == ("", EXPECTED[:1], "length")
    message = {"role": "assistant", "content": text}
    assert message_with_calls(message, "length", FORMATS["hermes"]) == "length"
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'


CALL_THEN_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nsee <'


@pytest.mark.parametrize("cut", [[], [1] * (len(CALL_THEN_TEXT) - 1)], ids=["whole", "characters"])
def test_text_after_the_calls_keeps_a_trailing_tag_start_whole_and_streamed(cut) -> None:
    """Only an answer that ends in a tag's start right after its calls drops it; text ending in "<" keeps it."""
    text = CALL_THEN_TEXT
    content, calls, _, _ = _assembled(_streamed(text, cut, finish="length"))
    message = {"role": "assistant", "content": text}
    message_with_calls(message, "length", FORMATS["hermes"])
    assert calls == EXPECTED[:1] and content == message["content"] == "see <"


def test_a_named_tool_choice_finishes_with_stop_as_openai_does() -> None:
    """OpenAI and vLLM end an answer whose function tool_choice named with `stop`; `required` and `auto` calls end
    with `tool_calls`."""
    message = {"role": "assistant", "content": HERMES_ANSWER}
    assert message_with_calls(message, "stop", FORMATS["hermes"], forced=Forced("get_weather")) == "stop"
    calls = StreamedToolCalls(FORMATS["hermes"], forced=Forced("get_weather"))
    choice = calls.choice({"index": 0, "delta": {"content": HERMES_ANSWER}, "logprobs": None, "finish_reason": "stop"})
    assert choice["finish_reason"] == "stop" and choice["delta"]["tool_calls"]


def test_llama3_json_calls_whole_and_streamed() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls, finish, _ = _assembled(_streamed(text, [3, 7, 11], format_name="llama3_json"))
    assert (content, calls, finish) == ("", [EXPECTED[0]], "tool_calls")
    plain = "It is sunny."
    assert _assembled(_streamed(plain, [2], format_name="llama3_json"))[:3] == (plain, [], "stop")


@pytest.mark.parametrize("cut", [[1] * 200, [5, 9, 13], [400]], ids=["characters", "pieces", "whole"])
@pytest.mark.parametrize(
    "text, expected_content, expected_calls",
    [
        # Chained calls with arguments: the ";" split once took each call's closing brace.
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', "",
         EXPECTED),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "a}; {b"}}', "",
         [("get_weather", {"city": "a}; {b"})]),
        ('Let me look that up.\n{"name": "get_time", "parameters": {}}', "Let me look that up.", [("get_time", {})]),
        # An answer written in JSON, with no arguments key, is not a call (as vLLM reads it).
        ('{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
        ('Use {x} here.', "Use {x} here.", []),
    ],
)
def test_llama3_json_reads_chained_calls_and_text_before_them_the_same_whole_and_streamed(
    text, expected_content, expected_calls, cut
) -> None:
    message = {"role": "assistant", "content": text}
    finish = message_with_calls(message, "stop", FORMATS["llama3_json"])
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert (message["content"] or "", whole) == (expected_content, expected_calls)
    content, calls, streamed_finish, _ = _assembled(_streamed(text, cut, format_name="llama3_json"))
    assert (content, calls, streamed_finish) == (expected_content, expected_calls, finish)


def test_the_format_follows_the_chat_template() -> None:
    assert format_for("... <tool_call> ...").name == "hermes"
    assert format_for("... <|python_tag|> ...").name == "llama3_json"
    assert format_for(None, "llama3_json").name == "llama3_json"
    assert format_for("{% if message.tool_calls %}[TOOL_CALLS] {{ message.tool_calls | tojson }}{% endif %}").name \
        == "mistral"
    assert format_for("{% if message.tool_calls %}<|tool_call|>{{ message.tool_calls | tojson }}{% endif %}").name \
        == "granite"
    # A template that writes calls in a format not read here (Granite 20B's <function_call>): none, so that requests
    # with tools are refused.
    assert format_for("{% for call in message.tool_calls %}<function_call>{{ call | tojson }}{% endfor %}") is None
    assert format_for(None) is None


def test_forced_calls_follow_the_tools_schemas() -> None:
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice="required")
    tokenizer = ll_tokenizer(DEMO, 4096, (0,))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMATS["hermes"].grammar(fields.callable, True)))
    check(grammar, tokenizer)
    named = ToolFields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [f.name for f in named.callable] == ["get_weather"]
    one = grammar_of(StructuredOutput(kind="grammar", spec=FORMATS["hermes"].grammar(named.callable, False)))
    matcher = llguidance.LLMatcher(tokenizer, one)
    forced = tokenizer.decode_str(matcher.compute_ff_tokens())
    assert forced == '<tool_call>\n{"name":"get_weather","arguments":{"city":'


@pytest.mark.parametrize("function", [{"name": "ping"}, {"name": "ping", "parameters": {}}])
def test_a_forced_function_without_parameters_is_called_with_none(function: dict) -> None:
    """OpenAI: "omitting parameters defines a function with an empty parameter list"; under plain auto a function
    that is not strict still takes any object, as it does without a grammar."""
    tokenizer = ll_tokenizer(DEMO, 4096, (0,))
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        fields = ToolFields(tools=[{"type": "function", "function": function}], tool_choice=choice)
        grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMATS["hermes"].grammar(fields.callable, False)))
        forced = tokenizer.decode_str(llguidance.LLMatcher(tokenizer, grammar).compute_ff_tokens())
        assert forced.startswith('<tool_call>\n{"name":"ping","arguments":{}}'), (choice, forced)
    auto = ToolFields(tools=[{"type": "function", "function": function}])
    assert [f.schema for f in auto.grammar_functions] == [{"type": "object"}]


# What the forced grammars write: compact calls (a Hermes answer under required may make two)
FORCED_ANSWERS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris"}}',
}


@pytest.mark.parametrize("format_name", list(FORCED_ANSWERS))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_answer_cut_anywhere_is_calls_and_no_content(format_name: str, tool_choice) -> None:
    """max_tokens may end a forced answer before its call's name: its tag is never content (a named function's call
    stands from the first token on), whole or streamed."""
    from tests.toolgrammar import check_cut_forced_answer  # it imports this module

    tokenizer = Tokenizer(DEMO)
    answer = FORCED_ANSWERS[format_name]
    if format_name == "hermes" and tool_choice == "required":
        answer += "\n" + HERMES_ANSWER.split("\n", 4)[-1]  # and get_time's call after it
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=tool_choice)
    check_cut_forced_answer(FORMATS[format_name], tokenizer, tokenizer.encode(answer, add_special_tokens=False), fields)


def test_tool_choice_must_name_an_offered_tool() -> None:
    with pytest.raises(ValueError, match="not among the tools"):
        ToolFields(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="needs at least one tool"):
        ToolFields(tools=[], tool_choice="required")
    assert ToolFields(tools=[WEATHER]).mode == "auto" and ToolFields().mode == "none"


def test_a_call_is_named_by_its_first_key_and_its_name_is_decoded() -> None:
    text = '<tool_call>\n{"name": "caf\\u00e9", "arguments": {"name": "Bob"}}\n</tool_call>'
    entries = _assembled(_streamed(text, [1] * (len(text) - 1)))[3]
    assert entries[0]["function"]["name"] == "café"
    late = '<tool_call>\n{"arguments": {"name": "Bob"}, "name": "greet"}\n</tool_call>'
    content, calls, finish, _ = _assembled(_streamed(late, [1] * (len(late) - 1)))
    assert calls == [("greet", {"name": "Bob"})] and finish == "tool_calls"


def test_a_malformed_call_reads_the_same_whole_and_streamed() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # a brace short
    message = {"role": "assistant", "content": text}
    message_with_calls(message, "stop", FORMATS["hermes"])
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    entries = [e for c in _streamed(text, [7] * 10) for e in c["delta"].get("tool_calls", [])]
    streamed = [(entries[0]["function"]["name"], "".join(e["function"].get("arguments", "") for e in entries))]
    assert whole == streamed == [("get_weather", '{"city":"Paris"}')]  # written whole: as a parsed call's


THINKING_ANSWER = (
    "<think>\nThe user wants the weather. Maybe the <tool_call> format.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize("cut", [[1] * 400, [7, 5, 9, 70, 3], [1000]], ids=["characters", "pieces", "whole"])
def test_call_tags_in_qwen3s_reasoning_are_text_and_the_call_after_it_is_read(cut) -> None:
    """A tag written while reasoning is thought about, not called: it swallowed the real call after </think>."""
    reasoning = THINKING_ANSWER[: THINKING_ANSWER.index("</think>") + len("</think>")]
    message = {"role": "assistant", "content": THINKING_ANSWER}
    assert message_with_calls(message, "stop", FORMATS["hermes"]) == "tool_calls"
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert (message["content"], whole) == (reasoning, EXPECTED[:1])
    content, calls, finish, _ = _assembled(_streamed(THINKING_ANSWER, cut))
    assert (content, calls, finish) == (reasoning, EXPECTED[:1], "tool_calls")
    # Reasoning cut short by max_tokens holds no call, whole or streamed.
    unclosed = THINKING_ANSWER[:60]
    assert _assembled(_streamed(unclosed, cut, finish="length"))[:3] == (unclosed, [], "length")
    assert message_with_calls({"role": "assistant", "content": unclosed}, "length", FORMATS["hermes"]) == "length"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BOGUS = "<tool_call>\nnot json\n</tool_call>"
# Answers with whitespace in every place it can stand around calls, text and blocks that are not calls.
LAYOUTS = [
    f"\n Let me check.  \n{CALL}\n\n{CALL} \n",
    f"{CALL}\n  Done, see above.\n\n",
    f"Before\n{BOGUS}\n after \n{CALL}\n",
    f"{CALL}\n\n{BOGUS}  {CALL}",
    f"Text, then a call cut short:\n{CALL[:40]}",
    f"{CALL}\n<tool_c",
    f"{CALL}\nand text, then a tag cut before its name: <tool_call>\n",
    f"  <think>\nhm <tool_call>\n</think>\n \n{CALL}\nok ",
    "No calls at all:\n  <tool is a word>  \n",
    # Cut short after the calls: a tag's start is dropped right after a call, kept as text after other text.
    f"{CALL}\n{BOGUS}\n<tool",
    f"{CALL}\n<tool ",
    f"{CALL}<\n\n ",
    f"one{CALL}two\n{CALL}\n three {CALL}\n",  # text meeting text across a call
]


@settings(max_examples=400, deadline=None)
@given(answer=st.sampled_from(LAYOUTS), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_a_streamed_answer_reads_exactly_as_the_whole_one_whitespace_included(answer, cuts) -> None:
    points = sorted({min(c, len(answer)) for c in cuts})
    sizes = [b - a for a, b in zip([0, *points], points)]
    choices = _streamed(answer, sizes, finish="length")
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    calls: dict[int, list[str]] = {}
    for entry in (e for choice in choices for e in choice["delta"].get("tool_calls", ())):
        name, arguments = calls.setdefault(entry["index"], ["", ""])
        calls[entry["index"]] = [name + entry["function"].get("name", ""), arguments + entry["function"]["arguments"]]
    message = {"role": "assistant", "content": answer}
    message_with_calls(message, "length", FORMATS["hermes"])
    whole = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", ())]
    assert (content, [calls[i] for i in sorted(calls)]) == (message["content"] or "", whole)


@pytest.mark.parametrize(("tool_choice", "two_calls"), [
    ("required", True), ({"type": "function", "function": {"name": "get_weather"}}, False),
])
def test_a_named_function_is_called_once_whatever_parallel_tool_calls_says(tool_choice, two_calls: bool) -> None:
    """OpenAI and vLLM answer a named tool_choice with one call; `required` calls as often as parallel_tool_calls
    allows."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "?"}],
                                                 "tools": [WEATHER, TIME], "tool_choice": tool_choice})
    _, structured = tool_constraint(body, FORMATS["hermes"])
    tokenizer = ll_tokenizer(DEMO, 4096, (0,))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(structured))
    assert matcher.consume_tokens(tokenizer.tokenize_str(call)) and matcher.is_accepting()
    assert bool(matcher.consume_tokens(tokenizer.tokenize_str("\n" + call))) is two_calls


def test_only_line_breaks_next_to_a_call_are_layout() -> None:
    """The template's line breaks around a call's tags are not text; spaces are, and a line break stands for the
    layout where text meets text: words on either side of a call never run together."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"one {call} two\n{call}\nthree"
    message = {"role": "assistant", "content": text}
    message_with_calls(message, "stop", FORMATS["hermes"])
    assert message["content"] == "one  two\nthree" and len(message["tool_calls"]) == 2
    for pieces in ([], [1] * (len(text) - 1), [4, 60, 5]):
        assert _assembled(_streamed(text, pieces))[0] == message["content"]


def test_a_hermes_call_with_parameters_keeps_its_arguments_whole_and_streamed() -> None:
    """Models trained on Llama's format write "parameters" in Hermes blocks too: the arguments are kept, not {}."""
    text = '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>'
    message = {"role": "assistant", "content": text}
    message_with_calls(message, "stop", FORMATS["hermes"])
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert _assembled(_streamed(text, [1] * (len(text) - 1)))[1] == [("get_weather", {"city": "Oslo"})]
    cut = text[:-len('"}}\n</tool_call>')]  # cut short by max_tokens inside the arguments
    message = {"role": "assistant", "content": cut}
    message_with_calls(message, "length", FORMATS["hermes"])
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo'


def test_a_schema_with_integers_past_64_bits_still_makes_a_forced_call() -> None:
    """Valid JSON, which orjson refuses to write: the closed schema is kept by the standard library's JSON."""
    huge = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 10**20}}}
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": huge}}],
    })
    [function] = body.tool_fields.callable
    assert function.schema["properties"]["a"]["maximum"] == 10**20
    _, constraint = tool_constraint(body, FORMATS["hermes"])
    assert "100000000000000000000" in grammar_of(constraint)


def test_closed_schemas_are_kept_for_small_parameters_only_and_read_as_copies() -> None:
    from services.gateway.tools.tool_request import MAX_KEPT_SCHEMA_CHARS, FunctionDefinition, _closed_schema
    small = FunctionDefinition(name="f", parameters={"type": "object", "properties": {"kept": {"type": "string"}}})
    small.schema["properties"]["kept"]["type"] = "changed by a reader"
    assert small.schema["properties"]["kept"]["type"] == "string"
    kept = _closed_schema.cache_info().currsize
    wide = {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(MAX_KEPT_SCHEMA_CHARS // 64)}
    large = FunctionDefinition(name="g", parameters={"type": "object", "properties": wide})
    assert large.schema["additionalProperties"] is False
    assert _closed_schema.cache_info().currsize == kept  # closed for its request, not kept


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **fields}
    )


def test_allowed_tools_narrow_what_is_called_not_what_the_template_shows() -> None:
    body = _chat(tool_choice=_allowed("required", "get_time"), parallel_tool_calls=False)
    fields = body.tool_fields
    assert [tool["function"]["name"] for tool in body.template_tools()] == ["get_weather", "get_time"]
    assert (fields.mode, [f.name for f in fields.callable], fields.forces_calls) == ("required", ["get_time"], True)
    param, constraint = tool_constraint(body, FORMATS["hermes"])
    matcher = llguidance.LLMatcher(ll_tokenizer(DEMO, 4096, (0,)), grammar_of(constraint))
    assert param == "tool_choice"
    # get_time takes no parameters: its one call is forced whole
    assert ll_tokenizer(DEMO, 4096, (0,)).decode_str(matcher.compute_ff_tokens()) == \
        '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    both = _chat(tool_choice=_allowed("required", "get_time", "get_weather")).tool_fields
    assert [f.name for f in both.callable] == ["get_weather", "get_time"] and both.forced_calls_parallel
    # Whole tool definitions name the allowed functions as well (a client passing its filtered tools on)
    definition = {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": {}}}
    whole = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [definition]}}
    assert [f.name for f in _chat(tool_choice=whole).tool_fields.callable] == ["get_time"]


@pytest.mark.parametrize(("choice", "param"), [
    (_allowed("required", "get_date"), "tool_choice"),
    (_allowed("auto"), "tool_choice.allowed_tools.tools"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "always", "tools": [{"type": "function", "function": {
        "name": "get_time"}}]}}, "tool_choice.allowed_tools.mode"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "web_search"}]}},
     "tool_choice.allowed_tools.tools.[0].type"),
    # The Responses API's flat shape, sent to chat
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]},
     "tool_choice.allowed_tools"),
], ids=["not among the tools", "none", "an unknown mode", "a hosted tool", "the Responses shape"])
def test_wrong_allowed_tools_are_a_400_naming_the_place(choice: dict, param: str) -> None:
    from services.gateway.errors import from_validation_error
    with pytest.raises(ValueError) as caught:
        _chat(tool_choice=choice)
    error = from_validation_error(caught.value)
    assert error.param == param and "allowed_tools' is not supported" not in error.message
    if param == "tool_choice":
        assert "'get_date', which is not among the tools" in error.message


# (a call of the allowed get_time, of get_weather, which is not allowed) as each format writes them compact
ALLOWED_CALL = {
    "hermes": ('<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
               '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'),
    "llama3_json": ('{"name":"get_time","parameters":{}}', '{"name":"get_weather","parameters":{"city":"Oslo"}}'),
    "mistral": ('[TOOL_CALLS] [{"name":"get_time","arguments":{}}]',
                '[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Oslo"}}]'),
}


def _takes(grammar: str, text: str) -> bool:
    """Whether `grammar` takes `text`, as the demo tokenizer cuts it, as a whole answer."""
    from tokenizers import Tokenizer as HFTokenizer
    matcher = llguidance.LLMatcher(ll_tokenizer(DEMO, 4096, (0,)), grammar)
    ids = HFTokenizer.from_file(str(DEMO / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(token) for token in ids) and matcher.consume_token(0)


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "mistral"])
def test_allowed_auto_answers_in_text_or_calls_the_allowed_tools_only(format_name: str) -> None:
    """Plain auto constrains nothing; allowed_tools auto is a grammar: text that holds no call's opening, or calls
    of the allowed functions, so that a call of another tool is never written, and never read."""
    fmt = FORMATS[format_name]
    body = _chat(tool_choice=_allowed("auto", "get_time"), parallel_tool_calls=True)
    assert tool_constraint(_chat(), fmt) is None  # plain auto
    param, constraint = tool_constraint(body, fmt)
    grammar = grammar_of(constraint)
    check(grammar, ll_tokenizer(DEMO, 4096, (0,)))
    allowed, other = ALLOWED_CALL[format_name]
    text = "It is sunny in Oslo, {\"city\": 1}.\n"
    taken = [text, "", allowed]
    if format_name != "llama3_json":  # Llama 3.x's call is the whole answer
        taken.append(f"Let me look.\n{allowed}")
    if format_name == "hermes":  # calls one by one, and none read in a leading reasoning block, closed or not
        taken += [f"{allowed}\n{allowed}", f"<think>\nMaybe <tool_call> then.\n</think>\n\n{allowed}",
                  "<think>\nMaybe <tool_call>"]
    for answer in taken:
        assert _takes(grammar, answer), answer
        message = {"role": "assistant", "content": answer}
        message_with_calls(message, "stop", fmt)
        assert all(call["function"]["name"] == "get_time" for call in message.get("tool_calls", ()))
        assert bool(message.get("tool_calls")) == answer.endswith(allowed)
    opening = {"hermes": "<tool_call>", "llama3_json": '{"name":', "mistral": "[TOOL_CALLS]"}[format_name]
    for answer in [other, f"Let me look.\n{other}", f"{text}{opening} is a tag"]:
        assert not _takes(grammar, answer), answer
    # Behind a reasoning parser's block (its grammar's, which the text does not open as); Hermes's grammar, which
    # reads a leading block as its split does, lets the model think about a tag there, not call it.
    from services.gateway.reasoning.parser import FORMATS as REASONING_FORMATS, opening_tag
    qwen3 = REASONING_FORMATS["qwen3"]
    assert opening_tag(qwen3) == "<think>" and opening_tag(REASONING_FORMATS["deepseek_r1"]) is None
    _, behind = tool_constraint(body, fmt, opening_tag(qwen3))
    thinking = grammar_of(behind.model_copy(update={"think_first": qwen3.think_first}))
    thought = f"Not {opening} yet." if format_name == "hermes" else "Not yet."
    assert _takes(thinking, f"<think>\n{thought}\n</think>\n\n{allowed}")
    assert not _takes(thinking, f"<think>\n{thought}\n</think>\n\n{other}")
