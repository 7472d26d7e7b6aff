"""The grammars tools impose under tool_choice `auto` (services/gateway/tools/formats.tool_constraint), without a
model: a `strict` function's calls follow its schema while the answer may still be text (OpenAI's strict mode), the
others' take any object; and an answer constrained beside tools (response_format, as an agent's final output) is
in its format or is calls, never free text."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.gateway.reasoning.parser import FORMATS as REASONING_FORMATS, opening_tag
from services.gateway.tools.formats import FORMATS, tool_constraint
from shared.structured import StructuredOutput, check, grammar_of, ll_tokenizer
from services.gateway.chat_request import ChatCompletionRequest
from tests.test_call_sequence import _whole_and_streamed
from tests.test_tool_calls import DEMO, TIME, WEATHER, _chat, _takes

STRICT_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
SKY = StructuredOutput(kind="json_schema", spec=json.dumps({
    "type": "object", "properties": {"sky": {"enum": ["clear", "rain"]}}, "required": ["sky"]}))
# How each format writes a call of `name` with arguments `arguments` (compact, as its grammar writes them)
CALL = {
    "hermes": lambda name, arguments: f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>',
    "llama3_json": lambda name, arguments: f'{{"name":"{name}","parameters":{arguments}}}',
    "mistral": lambda name, arguments: f'[TOOL_CALLS] [{{"name":"{name}","arguments":{arguments}}}]',
}


def _grammar(body, format_name: str, answer: StructuredOutput | None = None) -> tuple[str, str]:
    param, constraint = tool_constraint(body, FORMATS[format_name], None, answer)
    grammar = grammar_of(constraint)
    check(grammar, ll_tokenizer(DEMO, 4096, (0,)))
    return param, grammar


@pytest.mark.parametrize("format_name", sorted(CALL))
def test_a_strict_functions_calls_follow_its_schema_under_auto(format_name: str) -> None:
    call = CALL[format_name]
    param, grammar = _grammar(_chat(tools=[STRICT_WEATHER, TIME]), format_name)
    assert param == "tools"  # what makes the grammar: a strict function, not tool_choice
    for answer in ["It is sunny in Oslo.", call("get_weather", '{"city":"Oslo"}'),
                   call("get_time", '{"zone":[1,{"a":null}]}')]:  # get_time is not strict: any object
        assert _takes(grammar, answer), answer
    for answer in [call("get_weather", '{"town":"Oslo"}'), call("get_weather", '{"city":5}'),
                   call("get_date", "{}")]:
        assert not _takes(grammar, answer), answer


@pytest.mark.parametrize("format_name", sorted(CALL))
def test_an_answer_constrained_beside_tools_is_in_its_format_or_calls(format_name: str) -> None:
    call = CALL[format_name]
    for tools, strict in [([WEATHER, TIME], False), ([STRICT_WEATHER, TIME], True)]:
        _, grammar = _grammar(_chat(tools=tools), format_name, SKY)
        for answer in ['{"sky":"clear"}', call("get_time", "{}"), call("get_weather", '{"city":"Oslo"}')]:
            assert _takes(grammar, answer), answer
        refused = ["It is sunny.", '{"sky":"snow"}', call("get_date", "{}")]
        for answer in refused + ([call("get_weather", '{"city":5}')] if strict else []):
            assert not _takes(grammar, answer), answer
        if not strict:
            assert _takes(grammar, call("get_weather", '{"city":5}'))  # a function that is not strict: any object
    # allowed_tools auto beside response_format: the answer in its format, or calls of the allowed tools only
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    param, grammar = _grammar(_chat(tool_choice=allowed), format_name, SKY)
    assert param == "tool_choice"
    assert _takes(grammar, '{"sky":"rain"}') and _takes(grammar, call("get_time", "{}"))
    assert not _takes(grammar, call("get_weather", '{"city":"Oslo"}'))


def test_behind_a_reasoning_block_the_constrained_answer_or_calls_follow_it() -> None:
    qwen3 = REASONING_FORMATS["qwen3"]
    _, constraint = tool_constraint(_chat(), FORMATS["hermes"], opening_tag(qwen3), SKY)
    grammar = grammar_of(constraint.model_copy(update={"think_first": qwen3.think_first}))
    for answer in ['<think>\nclear, I think\n</think>\n\n{"sky":"clear"}', '{"sky":"rain"}',
                   '<think>\nlook it up\n</think>\n\n' + CALL["hermes"]("get_time", "{}")]:
        assert _takes(grammar, answer), answer
    assert not _takes(grammar, "<think>\nhmm\n</think>\n\nIt is sunny.")


def test_plain_auto_without_strict_functions_or_another_constraint_imposes_nothing() -> None:
    assert tool_constraint(_chat(), FORMATS["hermes"]) is None
    assert tool_constraint(_chat(tools=[STRICT_WEATHER], tool_choice="none"), FORMATS["hermes"], None, SKY) is None


@pytest.mark.parametrize(("answer", "content", "calls"), [
    # A call-shaped object inside the JSON answer is the answer's, as the grammar's answer path wrote it
    ('{"steps":[{"name":"get_time","parameters":{}}]}', '{"steps":[{"name":"get_time","parameters":{}}]}', []),
    # An object naming a function the request may not call is an answer
    ('{"name":"rm_rf","parameters":{}}', '{"name":"rm_rf","parameters":{}}', []),
    # The calls path: the whole answer one call
    ('{"name":"get_time","parameters":{}}', "", [["get_time", "{}"]]),
])
def test_beside_an_answer_a_llama3_call_is_what_the_grammars_calls_path_writes(
    answer: str, content: str, calls: list,
) -> None:
    """Llama 3's calls are JSON, as the answer beside them may be: read as the grammar tells them apart."""
    fmt = FORMATS["llama3_json"].reading([], beside_answer=["get_time", "get_weather"])
    for points in ([], list(range(1, len(answer)))):
        whole, streamed = _whole_and_streamed(fmt, answer, points, "stop")
        assert whole == streamed == (content, calls), points


def test_tool_choice_none_without_tools_leaves_the_answers_constraint_alone() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tool_choice": "none"})
    assert tool_constraint(body, FORMATS["hermes"], None, SKY) is None
    with pytest.raises(ValidationError, match="tool_choice"):  # auto with nothing to call: OpenAI's and vLLM's 400
        ChatCompletionRequest.model_validate({**body.model_dump(exclude_unset=True), "tool_choice": "auto"})
