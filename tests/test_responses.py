"""The Responses API without a model: a request read into the chat request it stands for (its items into messages,
its parameters into chat's), refusals by name, and the output items and events built from a chat answer's stream.
The whole path with the real openai client is tests/test_e2e_responses.py."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.errors import OpenAIError, bad_request, from_validation_error
from services.gateway.responses.conversation import InputError, check_calls_answered, input_messages
from services.gateway.responses.conversation import chat_body as chat_body_of
from services.gateway import wire_json
from services.gateway.request_body import RequestBodies
from services.gateway.responses.handler import reasoning_counter, renamed, shown
from services.gateway.responses.input_items import listed_items, page
from services.gateway.responses.store import STALE_AFTER_S, StoredRecord
from services.gateway.responses.output import ResponseOutput
from services.gateway.reasoning.parser import FORMATS
from services.gateway.responses.request import ResponsesRequest, check_refused
from services.gateway.tags import THINK_CLOSE
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

MODEL = "m"


def chat_body(request: ResponsesRequest, data: dict[str, Any]) -> dict[str, Any]:
    return chat_body_of(request, data, input_messages(request.input))


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": "hi", **fields})


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = chat_body(request(instructions="be brief", max_output_tokens=7, temperature=0.5), {})
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 7 and body["temperature"] == 0.5 and "top_p" not in body


def test_items_become_the_conversation_they_stand_for() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look",
                                                               "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_calls_after_reasoning_open_a_turn_of_their_own() -> None:
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think"}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert input_messages(items)[1] == {
        "role": "assistant", "content": "", "reasoning_content": "think",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


@pytest.mark.parametrize("items, param", [
    ([{"type": "web_search_call", "id": "ws"}], "input.[0].type"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.[0].content.[0].type"),
    ([{"role": "robot", "content": "x"}], "input.[0].role"),
    ([{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}], "input.[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c"}], "input.[1].output"),
    ([{"type": "function_call_output", "call_id": "unknown", "output": "x"}], "input.[0].call_id"),
    ([{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "gAAA"}], "input.[0].encrypted_content"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.[0].type"),
    (["just a string"], "input.[0]"),
    (5, "input"),
])
def test_an_item_the_conversation_cannot_hold_is_named(items: list, param: str) -> None:
    with pytest.raises(InputError) as caught:
        input_messages(items)
    assert caught.value.param == param


def test_tools_formats_and_logprobs_take_chats_shapes() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = chat_body(request(
        tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}},
        include=["message.output_text.logprobs"], top_logprobs=3,
    ), {"seed": 5, "top_k": 4, "unknown": 1})
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "r", "schema": schema,
                                                                               "strict": True}}
    assert (body["logprobs"], body["top_logprobs"], body["seed"], body["top_k"]) == (True, 3, 5, 4)
    assert "unknown" not in body
    assert chat_body(request(top_logprobs=2), {})["top_logprobs"] == 2
    assert "logprobs" not in chat_body(request(), {})


def test_structured_outputs_pass_on_to_chat_where_they_are_honoured() -> None:
    regex = {"regex": "[0-9]+"}
    chat = RequestBodies(max_n=1, strict_params=True).chat(chat_body(request(), {"structured_outputs": regex}))
    assert chat.structured_outputs is not None and chat.structured_outputs.regex == regex["regex"]


def test_auto_with_nothing_to_call_is_chats_none() -> None:
    """The Responses API's default choice, sent with no tools: chat would refuse it, and read calls of no tool."""
    chat = RequestBodies(max_n=1, strict_params=True).chat(chat_body(request(tool_choice="auto"), {}))
    assert chat.tool_fields.mode == "none"


def test_a_function_tool_is_strict_unless_it_says_otherwise_as_openais_responses_api() -> None:
    """Chat's tools default to `strict: false`, the Responses API's to `strict: true`: under plain auto a call of a
    tool that says nothing follows its schema, and the response shows it strict, as OpenAI's does."""
    flat = [{"type": "function", "name": "f"}, {"type": "function", "name": "g", "strict": None},
            {"type": "function", "name": "h", "strict": False}]
    body = request(tools=flat)
    assert [tool.model_dump()["strict"] for tool in body.tools] == [True, True, False]
    chat = ChatCompletionRequest.model_validate(chat_body(body, {}))
    assert [tool.function.strict for tool in chat.tools] == [True, True, False]
    assert chat.tool_fields.limits_calls


FLAT_TOOLS = [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]


def _allowed(mode: str, *names: str) -> dict[str, Any]:
    return {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": name} for name in names]}


def test_allowed_tools_take_chats_shape_and_the_response_shows_them_as_sent() -> None:
    sent = _allowed("required", "g")
    body = request(tools=FLAT_TOOLS, tool_choice=sent)
    assert body.tool_choice_shown == sent
    chat = chat_body(body, {})
    assert chat["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "g"}}]}}
    fields = ChatCompletionRequest.model_validate(chat).tool_fields
    assert [tool.function.name for tool in fields.tools] == ["f", "g"]  # the template shows both
    assert (fields.mode, [f.name for f in fields.callable]) == ("required", ["g"])
    auto = ChatCompletionRequest.model_validate(chat_body(request(tools=FLAT_TOOLS, tool_choice=_allowed(
        "auto", "f")), {})).tool_fields
    assert (auto.mode, [f.name for f in auto.callable], auto.limits_calls) == ("auto", ["f"], True)
    definition = {"type": "function", "name": "g", "description": "g", "parameters": {}, "strict": True}
    whole = {"type": "allowed_tools", "mode": "auto", "tools": [definition]}  # a whole definition names it too
    shown = request(tools=FLAT_TOOLS, tool_choice=whole).tool_choice_shown
    assert shown["tools"] == [{"type": "function", "name": "g"}]


@pytest.mark.parametrize(("choice", "param"), [
    (_allowed("auto", "h"), "tool_choice"),
    (_allowed("auto"), "tool_choice.tools"),
    (_allowed("sometimes", "f"), "tool_choice.mode"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]}, "tool_choice.tools.[0].type"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice.tools.[0].name"),  # chat's nested shape, sent to the Responses API
], ids=["not among the tools", "none", "an unknown mode", "a hosted tool", "chat's shape"])
def test_wrong_allowed_tools_are_refused_naming_the_place(choice: dict, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request(tools=FLAT_TOOLS, tool_choice=choice)
    error = from_validation_error(caught.value)
    assert error.param == param and "'allowed_tools' is not supported" not in error.message
    if param == "tool_choice":
        assert "'h', which is not among the tools" in error.message


@pytest.mark.parametrize("fields, where", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "text", "schema": {}}}}, "text.format"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_what_the_server_cannot_do_is_refused_by_name(fields: dict, where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    loc = ".".join(str(part) for part in caught.value.errors()[0]["loc"])
    assert loc.startswith(where)


@pytest.mark.parametrize("name, value", [
    ("max_tool_calls", 3), ("conversation", "conv_1"), ("truncation", "auto"),
    ("prompt", {"id": "pmpt_1"}), ("context_management", [{"type": "compaction"}]),
    # vLLM's extensions, refused here as on chat rather than dropped
    ("priority", 1), ("vllm_xargs", {"a": 1}), ("use_beam_search", True), ("logits_processors", ["p"]),
])
def test_refused_fields_are_400s_naming_them_unless_neutral(name: str, value: Any) -> None:
    with pytest.raises(OpenAIError) as caught:
        check_refused({name: value})
    assert caught.value.param == name
    check_refused({"truncation": "disabled", "max_tool_calls": None})


def test_chat_parameter_names_in_errors_become_the_responses_names() -> None:
    error = renamed(bad_request("Lower max_completion_tokens to at most 5.", param="max_completion_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "Lower max_output_tokens to at most 5.")
    assert renamed(bad_request("bad", param="messages.[2].content")).param == "input.[2].content"
    assert renamed(bad_request("x", param="seed")).param == "seed"


def _choice(content: str | None = None, reasoning: str | None = None, calls: list | None = None,
            finish_reason: str | None = None, logprobs: list | None = None) -> dict:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning"] = reasoning
    if calls is not None:
        delta["tool_calls"] = calls
    return {"index": 0, "delta": delta, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else {"content": logprobs}}


def _entry(token: str) -> dict:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}


def test_a_streamed_answer_becomes_items_and_events_in_order() -> None:
    output = ResponseOutput("resp_1", 7, {"model": MODEL})
    events = output.started()
    events += output.feed(_choice(reasoning="think", logprobs=[_entry("<think>"), _entry("think")]))
    events += output.feed(_choice(content="Hel", logprobs=[_entry("Hel")]))
    events += output.feed(_choice(content="lo", logprobs=[_entry("lo")]))
    events += output.feed(_choice(content="", calls=[{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": ""}}]))
    arguments = {"index": 0, "function": {"arguments": '{"a":1}'}}
    events += output.feed(_choice(calls=[arguments], finish_reason="tool_calls"))
    usage = {"input_tokens": 1, "output_tokens": 5, "total_tokens": 6}
    events += output.finish("tool_calls", usage)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"] == usage
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    text = message["content"][0]
    assert text["text"] == "Hello" and [e["token"] for e in text["logprobs"]] == ["Hel", "lo"]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == ("call_1", "f", '{"a":1}', "completed")
    added = events[8]
    assert added["item"]["status"] == "in_progress" and added["item"]["content"] == []


def test_the_rest_of_an_open_calls_arguments_goes_out_before_the_text_after_it() -> None:
    """One chunk may end a call's arguments and carry the text after the call (several tokens a step): the call's
    item closes with all of its arguments, then the text's item opens."""
    output = ResponseOutput("resp_1", 7, {"model": MODEL})
    output.started()
    output.feed(_choice(calls=[{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": '{"a":'}}]))
    events = output.feed(_choice(content="Done.", logprobs=[_entry("1}"), _entry("Done.")],
                                 calls=[{"index": 0, "function": {"arguments": "1}"}}]))
    assert [e["type"] for e in events] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
    ]
    assert events[1]["arguments"] == events[2]["item"]["arguments"] == '{"a":1}'
    assert [e["token"] for e in events[-1]["logprobs"]] == ["Done."]  # the text's own, after the call's


def test_an_answer_cut_by_its_budget_is_incomplete() -> None:
    output = ResponseOutput("resp_2", 7, {"model": MODEL})
    output.feed(_choice(content="abc"))
    events = output.finish("length", {})
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    # OpenAI's text part lists logprobs, empty when none were asked for; only a completed response has completed_at
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["logprobs"] == []
    assert final["completed_at"] is None


def test_a_completed_response_says_when_and_shows_openais_defaults() -> None:
    output = ResponseOutput("resp_7", 7, {"model": MODEL})
    output.feed(_choice(content="abc"))
    before = int(time.time())
    final = output.finish("stop", {})[-1]["response"]
    assert final["status"] == "completed" and before <= final["completed_at"] <= int(time.time())
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "x", "service_tier": "flex"})
    assert shown(body)["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert shown(body)["max_tool_calls"] is None and shown(body)["service_tier"] == "default"


def test_a_failure_ends_the_response_failed_with_its_error() -> None:
    output = ResponseOutput("resp_3", 7, {"model": MODEL})
    output.feed(_choice(content="abc"))
    events = output.fail({"message": "boom", "type": "server_error", "code": None})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}


@pytest.mark.parametrize("before, after, text, count", [
    ([1, 2], [4, 5], "r", "to_close"),  # up to the closing tag, included
    ([1, 2, 3], None, "r", "all"),  # the block never closed: all of it is reasoning
    ([1, 2, 3], None, "", "none"),  # no reasoning
])
def test_reasoning_tokens_are_counted_up_to_the_end_of_the_block(before, after, text, count) -> None:
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    close = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    token_ids = before + (close + after if after is not None else [])
    expected = {"to_close": len(before) + len(close), "all": len(token_ids), "none": 0}[count]
    assert reasoning_counter(tokenizer, FORMATS["qwen3"])(token_ids, text) == expected
    assert reasoning_counter(tokenizer, None)(token_ids, text) == 0


def test_a_calls_output_may_answer_a_call_of_the_conversation_it_continues() -> None:
    output = {"type": "function_call_output", "call_id": "c9", "output": "x"}
    assert input_messages([output], frozenset({"c9"})) == [{"role": "tool", "tool_call_id": "c9", "content": "x"}]


def test_a_call_without_its_output_is_refused_naming_it() -> None:
    call = {"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}
    answered = input_messages([call, {"type": "function_call_output", "call_id": "c9", "output": "x"}])
    check_calls_answered(answered)
    for messages in (input_messages([call, {"role": "user", "content": "and?"}]), answered[:1]):
        with pytest.raises(InputError, match="No tool output found for function call c9.") as refused:
            check_calls_answered(messages)
        assert refused.value.param == "input"
    for cut in ("", '{"city": "Par'):  # cut short by max_output_tokens: it could not be run, and needs no output
        check_calls_answered(input_messages([{**call, "arguments": cut}, {"role": "user", "content": "and?"}]))


def test_reasoning_with_no_answer_after_it_keeps_its_own_turn() -> None:
    """A turn's thinking stays in its turn when the next item is the user's, not the next answer's."""
    thought = {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "R1"}]}
    items = [{"role": "user", "content": "q1"}, thought, {"role": "user", "content": "q2"},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert input_messages(items) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "", "reasoning_content": "R1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "no"},
    ]


def test_null_asks_for_the_default() -> None:
    body = ResponsesRequest.model_validate_json(
        b'{"model": "m", "input": "x", "store": null, "stream": null, "parallel_tool_calls": null}'
    )
    assert (body.store, body.stream, body.parallel_tool_calls) == (True, False, True)


def test_a_union_parameters_error_names_the_parameter_not_the_member() -> None:
    with pytest.raises(ValidationError) as caught:
        request(tool_choice={"type": "custom", "name": "grep"})
    error = from_validation_error(caught.value)
    assert error.param == "tool_choice" and "'custom' is not supported" in error.message
    with pytest.raises(ValidationError) as caught:  # the allowed_tools member's complaint, picked by its type
        request(tool_choice={"type": "allowed_tools", "tools": []})
    assert from_validation_error(caught.value).param == "tool_choice.mode"
    with pytest.raises(ValidationError) as caught:  # the function member's complaint: it reached deepest
        request(tool_choice={"type": "function"})
    assert from_validation_error(caught.value).param == "tool_choice.name"
    with pytest.raises(ValidationError) as caught:  # keys the client chose are kept, capitals and all
        request(metadata={"Str": 5})
    assert from_validation_error(caught.value).param == "metadata.Str"
    for key in ("str", "int", "list[int]", "ResponsesRequest"):  # even a key that spells a type, given the body
        body = {"model": "m", "input": "hi", "metadata": {key: 5}}
        with pytest.raises(ValidationError) as caught:
            request(metadata=body["metadata"])
        assert from_validation_error(caught.value, body).param == f"metadata.{key}"


def _size(entries: list[dict]) -> list[str]:
    return [e["token"] for e in entries]


def test_logprobs_of_the_reasoning_and_its_tags_are_not_the_texts() -> None:
    output = ResponseOutput("resp_4", 7, {"model": MODEL})
    output.feed(_choice(reasoning="hm", logprobs=[_entry("<think>"), _entry("hm")]))
    output.feed(_choice(logprobs=[_entry("</")]))  # the closing tag, held back by the reasoning parser
    output.feed(_choice(reasoning=None, content="Hi", logprobs=[_entry("think>"), _entry("\n\n"), _entry("Hi")]))
    output.feed(_choice(content="!", logprobs=[_entry("!")]))
    events = output.finish("stop", {})
    assert _size(events[-1]["response"]["output"][1]["content"][0]["logprobs"]) == ["Hi", "!"]


def test_logprobs_held_at_the_end_go_with_the_text() -> None:
    """A stop string cut the last token's text: its entry is the text's all the same, as chat shows it."""
    output = ResponseOutput("resp_5", 7, {"model": MODEL})
    output.feed(_choice(content="# ", logprobs=[_entry("#"), _entry(" ")]))
    output.feed(_choice(logprobs=[_entry(" M")], finish_reason="stop"))
    events = output.finish("stop", {})
    assert _size(events[-1]["response"]["output"][0]["content"][0]["logprobs"]) == ["#", " ", " M"]
    assert _size(next(e for e in events if e["type"] == "response.output_text.done")["logprobs"]) == ["#", " ", " M"]


def test_a_chunks_text_before_a_call_takes_its_leading_logprobs() -> None:
    output = ResponseOutput("resp_6", 7, {"model": MODEL})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    output.feed(_choice(content="ok", calls=[call], logprobs=[_entry("ok"), _entry("<tool_call>"), _entry("{}")]))
    events = output.finish("tool_calls", {})
    assert _size(events[-1]["response"]["output"][0]["content"][0]["logprobs"]) == ["ok"]


def test_a_stored_responses_input_is_listed_as_items_with_ids_and_parts() -> None:
    assert listed_items("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}]
    items = listed_items([{"role": "assistant", "content": "a"},
                          {"type": "function_call_output", "call_id": "c", "output": "x", "id": "fco_given"}])
    assert items[0]["content"] == [{"type": "output_text", "text": "a", "annotations": []}]
    assert items[0]["id"].startswith("msg_") and items[0]["status"] == "completed"
    assert items[1]["id"] == "fco_given" and items[1]["type"] == "function_call_output"
    # A record kept before input items were kept lists none, rather than failing every read of the response.
    record = StoredRecord.from_bytes(orjson.dumps({"response": {"id": "resp_1", "output": []}, "turn": []}))
    assert record.items == [] and record.messages() == [{"role": "assistant", "content": ""}]


def test_input_items_are_paged_newest_first_unless_asked() -> None:
    items = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]
    first = page(items, {"limit": "2"})
    assert [i["id"] for i in first["data"]] == ["msg_4", "msg_3"] and first["has_more"]
    assert (first["first_id"], first["last_id"]) == ("msg_4", "msg_3")
    rest = page(items, {"limit": "10", "after": "msg_3"})
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_1", "msg_0"] and not rest["has_more"]
    assert [i["id"] for i in page(items, {"order": "asc"})["data"]] == [f"msg_{i}" for i in range(5)]
    for query, param in [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_9"}, "after")]:
        with pytest.raises(OpenAIError) as caught:
            page(items, query)
        assert caught.value.param == param


def test_a_tool_schema_with_integers_past_64_bits_is_served_on_the_responses_api() -> None:
    """The chat request built from it and the response object echoing it are written past orjson's 64 bits."""
    raw = (b'{"model": "m", "input": "hi", "tool_choice": "required", "tools": [{"type": "function", "name": "f",'
           b' "parameters": {"type": "object", "properties": {"a": {"type": "integer",'
           b' "maximum": 100000000000000000000}}}}]}')
    body, data = ResponsesRequest.model_validate_json(raw), orjson.loads(raw)
    chat = RequestBodies(max_n=1, strict_params=False).chat(chat_body(body, data))
    assert chat.tools[0].function.parameters["properties"]["a"]["maximum"] == 10**20
    assert b"100000000000000000000" in wire_json.dumps(shown(body))
    assert listed_items([{"role": "user", "content": [{"type": "output_text", "text": "x", "annotations": None}],
                          "status": None}])[0] | {"id": ""} == {
        "type": "message", "role": "user", "status": "completed", "id": "",
        "content": [{"type": "output_text", "text": "x", "annotations": []}]}


def test_a_running_background_response_whose_heartbeat_stopped_reads_as_failed() -> None:
    """Its gateway died: the entry stopped being written, and a reader sees why instead of in_progress for ever."""
    response = {"id": "resp_1", "status": "in_progress", "background": True, "error": None}
    beating = StoredRecord(response, [], [], heartbeat=time.time())
    assert beating.as_read.response["status"] == "in_progress"
    stopped = StoredRecord(response, [], [], heartbeat=time.time() - 2 * STALE_AFTER_S)
    gone = stopped.as_read.response
    assert gone["status"] == "failed" and "stopped" in gone["error"]["message"]
    done = StoredRecord({**response, "status": "completed"}, [], [], heartbeat=time.time() - 2 * STALE_AFTER_S)
    assert done.as_read.response["status"] == "completed"
    assert StoredRecord.from_bytes(stopped.to_bytes()).heartbeat == stopped.heartbeat


def test_a_stored_integer_past_64_bits_reads_back_as_written() -> None:
    """A client's tool schema may hold one, and the stored response echoes the tools; orjson reads it as a float."""
    big = 2**70
    response = {"id": "resp_1", "tools": [{"parameters": {"maximum": big, "minimum": -big, "multipleOf": 1e30}}]}
    read = StoredRecord.from_bytes(StoredRecord(response, [], []).to_bytes()).response
    assert read["tools"][0]["parameters"] == {"maximum": big, "minimum": -big, "multipleOf": 1e30}
    assert isinstance(read["tools"][0]["parameters"]["maximum"], int)
