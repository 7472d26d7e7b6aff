"""Structured output and tool calling through the whole mesh with the real openai client and LangChain: a
json_schema answer parses into the client's pydantic model, guided choices and regexes hold, a schema that does not
compile is a 400 naming its parameter and so is one that fails as it runs, forced tool calls follow the tools'
schemas whole and streamed, allowed_tools narrows the callable tools from the same prompt, a tool's result goes back
into the conversation, and LangChain's with_structured_output and bind_tools work on the demo model."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from services.mesh_process import Mesh
from tests.demomeshfixture import client, mesh  # noqa: F401  (fixtures are used by name)


MESSAGES = [{"role": "user", "content": "Describe the weather in Paris as a record."}]


class Report(BaseModel):
    city: str = Field(max_length=12)
    sky: Literal["clear", "cloudy", "rain"]
    windy: bool


REPORT_FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": Report.model_json_schema()}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False},
}}


def test_a_json_schema_answer_parses_into_the_clients_model(mesh: Mesh, client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(
        model=mesh.model, messages=MESSAGES, response_format=Report, max_tokens=64, temperature=0
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Report)
    streamed = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, max_tokens=64, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": Report.model_json_schema(),
                                                                "strict": True}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert Report.model_validate_json(text) == choice.message.parsed


def test_json_object_choices_and_regexes_hold(mesh: Mesh, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, max_tokens=48, temperature=0.7, seed=1,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for _ in range(3):
        choice = client.completions.create(
            model=mesh.model, prompt="Is the sky blue? Answer: ", max_tokens=8, temperature=1.0,
            extra_body={"guided_choice": ["yes", "no", "maybe"]},
        ).choices[0]
        assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    text = client.completions.create(
        model=mesh.model, prompt="A phone number: ", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    ).choices[0].text
    assert re.fullmatch(r"\d{3}-\d{4}", text)


# A structural tag whose trigger the demo model writes often: every `def` it writes opens a JSON object naming the
# function, on one line
DEF_TAG = {"type": "structural_tag", "triggers": ["def"], "structures": [{"begin": "def ", "end": "\n", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z_]{1,12}$"}}, "required": ["name"],
    "additionalProperties": False}}]}
DEF_STRUCTURE = re.compile(r"def (\{[^\n]*\})\n")


def test_a_structural_tag_keeps_prose_and_makes_each_triggered_structure_exact(
    mesh: Mesh, client: openai.OpenAI
) -> None:
    """vLLM's response_format (and structured_outputs) structural_tag: wherever the text holds the trigger, the
    structure follows, whole and streamed alike; text around it stays free."""
    structures = 0
    for seed in range(4):
        request = dict(model=mesh.model, prompt="import os\n\n", max_tokens=64, temperature=1.0, seed=seed)
        text = client.completions.create(extra_body={"response_format": DEF_TAG}, **request).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            stream=True, extra_body={"structured_outputs": {"structural_tag": json.dumps(DEF_TAG)}}, **request)
            if c.choices)
        assert streamed == text
        for found in DEF_STRUCTURE.finditer(text):
            assert set(json.loads(found.group(1))) == {"name"}
            structures += 1
        assert text.count("def") == len(DEF_STRUCTURE.findall(text)) + text.endswith(("def", "def "))
    assert structures > 0
    # Beside tools under auto its free text could write the calls' tag: refused; forced calls hold no text for it
    messages = [{"role": "user", "content": "Paris?"}]
    with pytest.raises(openai.BadRequestError) as beside_tools:
        client.chat.completions.create(model=mesh.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=8,
                                       extra_body={"response_format": DEF_TAG})
    assert beside_tools.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as regex_beside_tools:  # any text, so a call's tag too
        client.chat.completions.create(model=mesh.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=8,
                                       extra_body={"guided_regex": "(.|\n)*"})
    assert regex_beside_tools.value.body["param"] == "guided_regex"
    forced = client.chat.completions.create(model=mesh.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=64,
                                            tool_choice="required", parallel_tool_calls=False,
                                            extra_body={"response_format": DEF_TAG})
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_constraint_that_does_not_compile_is_a_400_naming_it(mesh: Mesh, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=mesh.model, prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})
    assert bad.value.body["param"] == "guided_regex" and "does not compile" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as both:
        client.completions.create(model=mesh.model, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert both.value.body["param"] == "guided_choice"


# A rule of more alternatives than llguidance's parser holds in one row (2,000): it compiles, and fails only at the
# first token the worker feeds it.
WIDE_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(3_000))


def test_a_constraint_failing_at_run_time_is_a_400_naming_it_and_others_go_on(
    mesh: Mesh, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model=mesh.model, prompt="x", max_tokens=4, extra_body={"guided_grammar": WIDE_GRAMMAR}
        )
    assert bad.value.body["param"] == "guided_grammar" and "limit of the grammar engine" in bad.value.body["message"]
    stream = client.completions.create(
        model=mesh.model, prompt="x", max_tokens=4, stream=True, extra_body={"guided_grammar": WIDE_GRAMMAR}
    )
    with pytest.raises(openai.APIError) as streamed:
        list(stream)
    assert "limit of the grammar engine" in streamed.value.message
    # Thousands of choices are one regex, which has no such limit (shared/structured.py).
    choices = [f"choice {i}" for i in range(3_000)]
    text = client.completions.create(
        model=mesh.model, prompt="x", max_tokens=8, temperature=0, extra_body={"guided_choice": choices}
    ).choices[0].text
    assert text in choices


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_required_and_named_tool_calls_follow_the_schemas(mesh: Mesh, client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    r = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )
    choice = r.choices[0]
    ((name, arguments),) = _calls(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert name in ("get_weather", "get_time")
    expected_keys = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}[name]
    assert set(arguments) == expected_keys
    named = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, tools=tools, max_tokens=64, temperature=0, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    ((name, arguments),) = _calls(named.choices[0].message)
    assert name == "get_time" and arguments["zone"] in ("utc", "cet")
    weather = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, tools=tools, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0].message.tool_calls[0].function
    # Streamed: the deltas (index, id and name, then the arguments as they are written) add up to the same call.
    for whole in (named.choices[0].message.tool_calls[0].function, weather):
        stream = client.chat.completions.create(
            model=mesh.model, messages=MESSAGES, tools=tools, max_tokens=64, temperature=0, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": whole.name}}, stream=True,
        )
        calls: dict[int, dict] = {}
        finish, pieces = None, []
        for chunk in stream:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for delta in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                if delta.function.name:
                    assert delta.id and call["name"] is None
                    call["name"] = delta.function.name
                pieces += [delta.function.arguments] if delta.function.arguments else []
                call["arguments"] += delta.function.arguments or ""
        assert finish == "stop"  # a named function's, as OpenAI answers
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(whole.name, whole.arguments)]
    assert len(pieces) > 1, pieces  # the city's arguments came as they were written, not at the call's end


def test_a_forced_call_cut_before_its_name_is_no_content(mesh: Mesh, client: openai.OpenAI) -> None:
    """max_tokens ends the answer inside the call's tag: a named function's call stands with no arguments yet, a
    required one is no call, and neither leaves the tag in content (streamed alike)."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    for tool_choice, names in (({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
                               ("required", [])):
        asked = dict(model=mesh.model, messages=MESSAGES, tools=tools, tool_choice=tool_choice, max_tokens=2,
                     temperature=0)
        choice = client.chat.completions.create(**asked).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls or ()] == names
        content, streamed = "", []
        for chunk in client.chat.completions.create(**asked, stream=True):
            for part in chunk.choices:
                content += part.delta.content or ""
                streamed += [d.function.name for d in part.delta.tool_calls or () if d.function.name]
        assert content == "" and streamed == names


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_narrow_the_calls_and_keep_the_prompt(mesh: Mesh, client: openai.OpenAI) -> None:
    """OpenAI's allowed_tools: the template shows every tool (the same prompt, so the same cached prefix), and the
    answer calls only the allowed ones: get_weather alone, where the model calls get_time when it may call either."""
    asked = dict(model=mesh.model, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=64, temperature=0,
                 parallel_tool_calls=False)
    free = client.chat.completions.create(**asked, tool_choice="required")
    assert [name for name, _ in _calls(free.choices[0].message)] == ["get_time"]  # the model's own pick
    narrowed = client.chat.completions.create(**asked, tool_choice=_allowed("required", "get_weather"))
    choice = narrowed.choices[0]
    ((name, arguments),) = _calls(choice.message)
    assert (name, set(arguments), choice.finish_reason) == ("get_weather", {"city", "unit"}, "tool_calls")
    assert narrowed.usage.prompt_tokens == free.usage.prompt_tokens
    undrafted = client.chat.completions.create(**asked, tool_choice=_allowed("required", "get_weather"),
                                               extra_body={"speculative": {"num_speculative_tokens": 0}})
    assert _calls(undrafted.choices[0].message) == [(name, arguments)]  # exact under the server's drafts
    stream = client.chat.completions.create(**asked, tool_choice=_allowed("required", "get_weather"), stream=True)
    names = [d.function.name for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()
             if d.function.name]
    assert names == ["get_weather"]
    # auto: text, or calls of the allowed tools only (a grammar; the demo model answers in text here, the same text
    # as under plain auto)
    plain = client.chat.completions.create(**asked, tool_choice="auto")
    auto = client.chat.completions.create(**asked, tool_choice=_allowed("auto", "get_weather"))
    assert not plain.choices[0].message.tool_calls and not auto.choices[0].message.tool_calls
    assert auto.choices[0].message.content == plain.choices[0].message.content
    auto_undrafted = client.chat.completions.create(**asked, tool_choice=_allowed("auto", "get_weather"),
                                                    extra_body={"speculative": {"num_speculative_tokens": 0}})
    assert auto_undrafted.choices[0].message.content == auto.choices[0].message.content
    for wrong, param in [(_allowed("required", "get_date"), "tool_choice"),
                         (_allowed("auto"), "tool_choice.allowed_tools.tools")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**asked, tool_choice=wrong)
        assert caught.value.body["param"] == param
    # Beside response_format: a record of the format, or a call of the allowed tool
    both = client.chat.completions.create(**asked, tool_choice=_allowed("auto", "get_time"),
                                          response_format=REPORT_FORMAT).choices[0].message
    assert [name for name, _ in _calls(both)] == ["get_time"] if both.tool_calls else Report.model_validate_json(
        both.content)
    # required's answer is calls, which hold no content for the format to shape (an agent's first turn sends both)
    forced = client.chat.completions.create(**asked, tool_choice="required", response_format=REPORT_FORMAT)
    assert forced.choices[0].message.content is None and _calls(forced.choices[0].message) == _calls(
        free.choices[0].message)
    with pytest.raises(openai.BadRequestError) as continued:  # the continued message is read for calls, unheld
        client.chat.completions.create(
            **{**asked, "messages": MESSAGES + [{"role": "assistant", "content": "<tool_call>\n"}]},
            tool_choice=_allowed("auto", "get_time"),
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    error = continued.value.body
    assert error["param"] == "tool_choice" and "continue_final_message" in error["message"]


def test_an_answer_in_a_format_beside_tools_follows_it_or_calls(mesh: Mesh, client: openai.OpenAI) -> None:
    """An agent's final output in a format beside its tools (response_format with tools under auto, as OpenAI's
    Agents SDK sends them): each answer is a record of the format or calls, the same whole and streamed, and a strict
    tool's calls follow its schema; the Responses API's text.format beside tools likewise."""
    strict_weather, strict_time = ({**tool, "function": {**tool["function"], "strict": True}}
                                   for tool in (WEATHER_TOOL, TIME_TOOL))
    for seed in range(3):  # each answer bounded: a record, or one call of a strict function
        params = dict(model=mesh.model, messages=MESSAGES, tools=[strict_weather, strict_time], max_tokens=96,
                      temperature=1.0, seed=seed, response_format=REPORT_FORMAT, parallel_tool_calls=False)
        choice = client.chat.completions.create(**params).choices[0]
        calls = _calls(choice.message)
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            if name == "get_weather":  # strict: its schema, closed
                assert set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 12, arguments
        if not calls:
            Report.model_validate_json(choice.message.content)
        content, streamed = "", {}
        for chunk in client.chat.completions.create(stream=True, **params):
            for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                call = streamed.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            content += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert (content or None, [(n, json.loads(a)) for n, a in streamed.values()]) == (choice.message.content, calls)
    alone = client.chat.completions.create(model=mesh.model, messages=MESSAGES, tool_choice="none", max_tokens=64,
                                           temperature=0, response_format=REPORT_FORMAT)  # no tools, none to call
    Report.model_validate_json(alone.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as refused:  # as OpenAI and vLLM answer: there is nothing to call
        client.chat.completions.create(model=mesh.model, messages=MESSAGES, tool_choice="auto", max_tokens=4)
    assert refused.value.body["param"] == "tool_choice"
    answer = client.responses.create(
        model=mesh.model, input=MESSAGES[0]["content"], max_output_tokens=64, temperature=0,
        tools=[{"type": "function", **strict_weather["function"]}],
        text={"format": {"type": "json_schema", "name": "report", "schema": Report.model_json_schema()}},
    )
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls or Report.model_validate_json(answer.output_text)


def test_a_tools_result_goes_back_into_the_conversation(mesh: Mesh, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=64,
        temperature=0, parallel_tool_calls=False,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=mesh.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=12, temperature=0
    )
    # The same tools, then the call and its result: a longer prompt than the first turn's.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 4
    without_tools = client.chat.completions.create(
        model=mesh.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=12, temperature=0
    )
    assert without_tools.choices[0].message.content and not without_tools.choices[0].message.tool_calls
    assert without_tools.usage.prompt_tokens == second.usage.prompt_tokens  # the tools are shown all the same


@pytest.mark.parametrize("use_responses_api", [False, True], ids=["chat completions", "responses"])
def test_langchain_structured_output_and_bound_tools(mesh: Mesh, use_responses_api: bool) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    messages = pytest.importorskip("langchain_core.messages")
    chat = langchain_openai.ChatOpenAI(
        base_url=mesh.base_url, api_key="unused", model=mesh.model, max_tokens=64, temperature=0, max_retries=0,
        use_responses_api=use_responses_api,
    )
    report = chat.with_structured_output(Report).invoke("Describe the weather in Paris as a record.")
    assert isinstance(report, Report)

    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """The weather of a city."""
        return "sunny"

    message = chat.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    # LangChain's schema of a function leaves additionalProperties open: the required ones must be there.
    assert {"city", "unit"} <= set(message.tool_calls[0]["args"])
    strict = chat.bind_tools([get_weather], tool_choice="required", strict=True).invoke("The weather in Paris?")
    assert set(strict.tool_calls[0]["args"]) == {"city", "unit"}
    # The call and its result go back, as LangChain's agents send them.
    answered = chat.bind_tools([get_weather]).invoke([
        messages.HumanMessage("The weather in Paris?"), strict,
        messages.ToolMessage("sunny", tool_call_id=strict.tool_calls[0]["id"]),
    ])
    assert answered.text and not answered.tool_calls


def test_an_echoed_call_in_the_final_message_is_text_whole_and_streamed(mesh: Mesh, client: openai.OpenAI) -> None:
    """Chat's echo repeats the final assistant message: a stream sends it before reading the answer for calls, so
    the whole answer must not read it for calls either."""
    echoed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    params = dict(
        model=mesh.model, messages=[*MESSAGES, {"role": "assistant", "content": echoed}], tools=[WEATHER_TOOL],
        max_tokens=8, temperature=0,
        extra_body={"echo": True},
    )
    whole = client.chat.completions.create(**params).choices[0].message
    content, calls = "", []
    for chunk in client.chat.completions.create(stream=True, **params):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
    assert whole.content.startswith(echoed) and content == whole.content
    assert not whole.tool_calls and not calls
