"""Seed-OSS's tool calls (services/gateway/tools/qwen3_coder.py's SeedOss) without a model: Qwen3-Coder's XML in
`<seed:tool_call>` blocks with values inline, picked from the chat template, read typed by the tools' schemas whole
and in any cut, and forced in that layout; and its thinking, `<seed:think>`, set apart by `--reasoning-parser
seed_oss`."""

from __future__ import annotations

import json

import pytest

from services.gateway.reasoning.parser import FORMATS as REASONING_FORMATS, message_with_reasoning
from services.gateway.tools.formats import format_for
from services.gateway.tools.qwen3_coder import SeedOss
from services.gateway.tools.tool_request import ToolFields
from shared.structured import StructuredOutput, grammar_of
from tests.test_tool_calls import _takes
from tests.test_tool_calls_qwen3_coder import EXPECTED, FUNCTIONS, TIME, WEATHER, _read, _stream

FORMAT = SeedOss().reading(FUNCTIONS)
# How Seed-OSS's template writes an assistant's call (after the chat templates llama.cpp's and vLLM's parsers read)
TEMPLATE = ("{% for call in message.tool_calls %}<seed:tool_call>\n<function={{ call.function.name }}>\n"
            "{% for k, v in call.function.arguments | items %}<parameter={{ k }}>{{ v }}</parameter>\n{% endfor %}"
            "</function>\n</seed:tool_call>{% endfor %}")


def _call(name: str, parameters: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={key}>{value}</parameter>\n" for key, value in parameters)
    return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


ANSWER = ("I will look.\n" + _call("get_weather", [("city", "Paris"), ("days", "3"), ("note", 'say "hi"\n<b>'),
                                                   ("hours", "[9, 17]")]) + "\n" + _call("get_time", []))


def _streamed(answer: str, pieces: list[int]) -> tuple[str, list[list[str]]]:
    choices = _stream(answer, pieces, fmt=FORMAT)
    calls: dict[int, list[str]] = {}
    for entry in (e for choice in choices for e in choice["delta"].get("tool_calls", ())):
        name, arguments = calls.setdefault(entry["index"], ["", ""])
        calls[entry["index"]] = [name + entry["function"].get("name", ""), arguments + entry["function"]["arguments"]]
    return "".join(c["delta"].get("content") or "" for c in choices), [calls[i] for i in sorted(calls)]


def test_the_template_picks_the_format() -> None:
    assert isinstance(format_for(TEMPLATE), SeedOss)
    assert format_for(None, "seed_oss").name == "seed_oss"


@pytest.mark.parametrize("pieces", [[], [1] * (len(ANSWER) - 1), [5, 17, 3, 40]], ids=["whole", "characters", "mixed"])
def test_calls_read_typed_whole_and_in_any_cut(pieces: list[int]) -> None:
    content, calls = _read(ANSWER, fmt=FORMAT)
    assert content == "I will look." and [(name, json.loads(arguments)) for name, arguments in calls] == EXPECTED
    assert _streamed(ANSWER, pieces) == (content, calls)


def test_the_forced_grammar_writes_values_inline() -> None:
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMAT.grammar(
        ToolFields(tools=[WEATHER, TIME], tool_choice="required").callable, False)))
    assert _takes(grammar, _call("get_weather", [("city", "Oslo"), ("days", "2")]))
    assert _takes(grammar, _call("get_time", []))
    for refused in [_call("get_weather", [("city", "Rome"), ("days", "2")]),  # not in the enum
                    _call("get_weather", [("city", "\nOslo\n"), ("days", "2")]),  # Qwen3-Coder's layout
                    _call("get_weather", [("city", "Oslo")]).replace("seed:", "")]:  # Qwen3-Coder's tags
        assert not _takes(grammar, refused), refused


def test_its_thinking_is_set_apart() -> None:
    message = {"role": "assistant", "content": "<seed:think>Paris, probably.</seed:think>It is sunny."}
    message_with_reasoning(message, REASONING_FORMATS["seed_oss"], include=True)
    assert (message["reasoning_content"], message["content"]) == ("Paris, probably.", "It is sunny.")


def test_a_value_is_read_as_written_without_qwen3_coders_layout() -> None:
    """Seed-OSS writes values inline: a line break at a value's edge is the value's (the forced grammar's string
    limits held on exactly that text)."""
    answer = _call("get_weather", [("city", "Oslo"), ("days", "2"), ("note", "\nab\n")])
    expected = {"city": "Oslo", "days": 2, "note": "\nab\n"}
    assert json.loads(_read(answer, fmt=FORMAT)[1][0][1]) == expected
    assert json.loads(_streamed(answer, [1] * (len(answer) - 1))[1][0][1]) == expected
    for cut in ("ab\n", "ab\n</param"):  # cut short (max_tokens): the line break is still the value's
        text = "<seed:tool_call>\n<function=get_weather>\n<parameter=note>" + cut
        assert json.loads(_read(text, "length", fmt=FORMAT)[1][0][1]) == {"note": "ab\n"}


def test_a_call_written_while_thinking_is_thought_about_not_called() -> None:
    answer = ("<seed:think>I could call " + _call("get_time", []) + " but no.</seed:think>It is noon.")
    for pieces in ([], [1] * (len(answer) - 1), [7, 30, 4]):
        assert _streamed(answer, pieces) == (answer, [])
    assert _read(answer, fmt=FORMAT) == (answer, [])
    after = "<seed:think>Noon?</seed:think>" + _call("get_time", [])
    assert _read(after, fmt=FORMAT) == ("<seed:think>Noon?</seed:think>", [["get_time", "{}"]])
