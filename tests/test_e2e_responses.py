"""POST /v1/responses through the whole mesh with the real openai client (`client.responses`): the same tokens as the
chat completion it stands for, streamed events that add up to the whole response, function calls out and their
outputs back in, allowed_tools, JSON schemas through `responses.parse`, logprobs, background responses polled,
cancelled and streamed (picked up again after the client left), and errors naming the Responses parameter."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from services.mesh_process import Mesh
from tests.demomeshfixture import client, mesh  # noqa: F401  (fixtures are used by name)

pytestmark = pytest.mark.e2e

PROMPT = "def read_config(path):"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
POLL_TIMEOUT_S = 60.0


def test_a_response_is_the_chat_completion_it_stands_for(mesh: Mesh, client: openai.OpenAI) -> None:
    response = client.responses.create(model=mesh.model, input=PROMPT, instructions="Answer in Python.",
                                       max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(
        model=mesh.model, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": PROMPT}],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Answer in Python." and response.max_output_tokens == 24
    assert response.temperature == 0 and response.top_p == 1.0 and response.tool_choice == "auto"


def test_streamed_events_add_up_to_the_whole_response(mesh: Mesh, client: openai.OpenAI) -> None:
    whole = client.responses.create(model=mesh.model, input=PROMPT, max_output_tokens=32, temperature=0)
    events = list(client.responses.create(model=mesh.model, input=PROMPT, max_output_tokens=32, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 32


def test_a_stop_completes_the_response_for_the_stream_helper(mesh: Mesh, client: openai.OpenAI) -> None:
    """The openai client's `responses.stream` gives its final response once the response completes: a stop string
    (specmesh's extension) ends this one before its budget."""
    with client.responses.stream(model=mesh.model, input=PROMPT, max_output_tokens=200, temperature=0,
                                 extra_body={"stop": ["\n"]}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and "\n" not in final.output_text
    assert final.output[0].status == "completed"


def test_a_forced_call_comes_out_as_a_function_call_item_and_its_output_goes_back(
    mesh: Mesh, client: openai.OpenAI,
) -> None:
    asked = dict(model=mesh.model, input="Paris?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 max_output_tokens=64, temperature=0)
    response = client.responses.create(**asked)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(**asked, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert events[-1].response.output[0].name == "get_weather"
    # The call and its output go back in as items, and the conversation goes on.
    items = [{"role": "user", "content": "Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}]
    after = client.responses.create(model=mesh.model, input=items, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=8, temperature=0)
    assert after.output[0].type == "message" and after.output_text
    # A call left without its output is OpenAI's 400, in the items or in the stored response continued.
    for continued in (dict(input=items[:2]), dict(input="and Oslo?", previous_response_id=response.id)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=mesh.model, tools=TOOLS, max_output_tokens=8, **continued)
        assert refused.value.body["message"] == f"No tool output found for function call {call.call_id}."
        assert refused.value.body["param"] == "input"


TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}


def test_allowed_tools_narrow_the_calls_and_are_shown_as_sent(mesh: Mesh, client: openai.OpenAI) -> None:
    """The model calls get_time when it may call either tool; allowed_tools with get_weather alone calls that, from
    the same prompt (both tools shown), and the response shows tool_choice as sent."""
    asked = dict(model=mesh.model, input="Paris?", tools=[*TOOLS, TIME], parallel_tool_calls=False,
                 max_output_tokens=64, temperature=0)
    free = client.responses.create(**asked, tool_choice="required")
    assert [item.name for item in free.output] == ["get_time"]  # the model's own pick
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    narrowed = client.responses.create(**asked, tool_choice=allowed)
    [call] = narrowed.output
    assert (call.type, call.name, set(json.loads(call.arguments))) == ("function_call", "get_weather", {"city"})
    assert narrowed.usage.input_tokens == free.usage.input_tokens
    assert narrowed.tool_choice.model_dump() == allowed
    events = list(client.responses.create(**asked, tool_choice=allowed, stream=True))
    assert events[-1].response.output[0].name == "get_weather"
    assert events[-1].response.tool_choice.model_dump() == allowed
    auto = client.responses.create(**asked, tool_choice={**allowed, "mode": "auto"})
    assert all(item.type != "function_call" or item.name == "get_weather" for item in auto.output)


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    sky: Literal["clear", "cloudy", "rain"]


def test_a_schema_in_text_format_holds(mesh: Mesh, client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=mesh.model, input="Paris?", text_format=Weather, max_output_tokens=64,
                                    temperature=1, extra_body={"seed": 3}).output_parsed
    assert isinstance(parsed, Weather)


@pytest.mark.parametrize("stop", [None, ["Module"]], ids=["no stop", "a stop string cutting a token"])
def test_logprobs_come_with_the_output_text(mesh: Mesh, client: openai.OpenAI, stop: list[str] | None) -> None:
    response = client.responses.create(model=mesh.model, input="Hi", max_output_tokens=40, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2,
                                       extra_body={"stop": stop})
    chat = client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=40, temperature=0, logprobs=True, top_logprobs=2, stop=stop)
    assert response.output_text == chat.choices[0].message.content
    entries = response.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.parametrize("fields, param", [
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"background": True, "store": False}, "store"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nothing"}}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]}, "input.[0].call_id"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.tools"),
    ({"input": 5}, "input"),
])
def test_errors_name_the_responses_parameter(mesh: Mesh, client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": mesh.model, "input": PROMPT, "max_output_tokens": 4, **fields})
    assert caught.value.body["param"] == param


def test_a_stored_response_is_continued_read_and_deleted(mesh: Mesh, client: openai.OpenAI) -> None:
    """Each turn sends only its new input: the stored responses give the conversation before it, exactly as the
    chat request that carries all of it would render."""
    first = client.responses.create(model=mesh.model, input="def a():", max_output_tokens=8, temperature=0)
    assert first.store is True
    second = client.responses.create(model=mesh.model, input="def b():", previous_response_id=first.id,
                                     instructions="Answer in Python.", max_output_tokens=8, temperature=0)
    third = client.responses.create(model=mesh.model, input="def c():", previous_response_id=second.id,
                                    max_output_tokens=8, temperature=0)
    conversation = [{"role": "user", "content": "def a():"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "def b():"}, {"role": "assistant", "content": second.output_text},
                    {"role": "user", "content": "def c():"}]
    chat = client.chat.completions.create(model=mesh.model, messages=conversation, max_tokens=8, temperature=0)
    assert third.output_text == chat.choices[0].message.content
    assert third.usage.input_tokens == chat.usage.prompt_tokens
    assert third.previous_response_id == second.id and third.instructions is None  # not carried over
    listed = client.responses.input_items.list(second.id)  # its own input, not the conversation's
    assert [(item.type, item.role, item.content[0].text) for item in listed.data] == [("message", "user", "def b():")]
    read = client.responses.retrieve(second.id)
    assert (read.id, read.output_text, read.instructions) == (second.id, second.output_text, "Answer in Python.")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(first.id)
    assert (missing.value.body["type"], missing.value.body["param"]) == ("invalid_request_error", None)
    with pytest.raises(openai.BadRequestError) as caught:  # the chain through it is broken
        client.responses.create(model=mesh.model, input="x", previous_response_id=third.id, max_output_tokens=2)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert client.responses.create(model=mesh.model, input="x", store=None, stream=None, parallel_tool_calls=None,
                                   max_output_tokens=2).store is True  # null: the default
    unstored = client.responses.create(model=mesh.model, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _polled(client: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    response = client.responses.retrieve(response_id)
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        response = client.responses.retrieve(response_id)
    return response


def test_a_background_response_is_polled_to_the_foreground_answer_and_can_be_cancelled(
    mesh: Mesh, client: openai.OpenAI
) -> None:
    asked = dict(model=mesh.model, input=PROMPT, max_output_tokens=16, temperature=0)
    started = client.responses.create(**asked, background=True)
    assert started.status in ("queued", "in_progress", "completed") and started.background is True
    done = _polled(client, started.id)
    foreground = client.responses.create(**asked)
    assert (done.status, done.output_text, done.usage.output_tokens) == (
        foreground.status, foreground.output_text, foreground.usage.output_tokens)
    assert client.responses.cancel(done.id).status == done.status  # ended: returned as it is
    with pytest.raises(openai.BadRequestError) as replayed:  # its events are not kept to stream again
        client.responses.retrieve(done.id, stream=True)
    assert replayed.value.body["param"] == "stream"
    long = client.responses.create(**{**asked, "max_output_tokens": 900}, background=True,
                                   extra_body={"ignore_eos": True})
    time.sleep(0.5)
    with pytest.raises(openai.BadRequestError) as chained:  # it has not ended: nothing to continue yet
        client.responses.create(**asked, previous_response_id=long.id)
    assert chained.value.body["param"] == "previous_response_id" and "still" in chained.value.body["message"]
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < 900
    with pytest.raises(openai.BadRequestError) as foreground_cancel:
        client.responses.cancel(foreground.id)
    assert "background" in foreground_cancel.value.body["message"]
    deleted = client.responses.create(**{**asked, "max_output_tokens": 64}, background=True,
                                      extra_body={"ignore_eos": True})
    client.responses.delete(deleted.id)  # stopped first: its run, which would end in a moment, does not write it back
    time.sleep(1.0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    with pytest.raises(openai.BadRequestError) as refused:  # checked before it is answered: nothing is stored
        client.responses.create(**{**asked, "max_output_tokens": 100_000}, background=True)
    assert refused.value.body["param"] == "max_output_tokens"


def test_a_streamed_background_response_is_picked_up_where_its_client_left(
    mesh: Mesh, client: openai.OpenAI
) -> None:
    """OpenAI's resumable streaming: the client that drops its stream reads the rest from `starting_after` the last
    event it had, and the whole stream can be read again; the response ran on meanwhile, to the foreground's text."""
    asked = dict(model=mesh.model, input=PROMPT, max_output_tokens=24, temperature=0)
    foreground = client.responses.create(**asked)
    first: list[Any] = []
    with client.responses.create(**asked, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 6:
                break  # the connection drops
    response_id = first[0].response.id
    assert [event.type for event in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0].response.status == "queued" and first[0].response.background is True
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == foreground.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == foreground.output_text
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in again] == [event.model_dump() for event in events]
    completed = client.responses.create(**asked, background=True, stream=True, extra_body={"stop": ["\n"]})
    completed_id = next(iter(completed)).response.id
    completed.close()
    with client.responses.stream(response_id=completed_id) as helper:  # the openai client's own way back in
        final = helper.get_final_response()  # it needs response.completed: an answer that stopped on its own
    assert final.status == "completed" and final.output_text == client.responses.retrieve(completed_id).output_text
    assert client.responses.retrieve(response_id).output_text == foreground.output_text
    with pytest.raises(openai.BadRequestError) as after_what:
        client.responses.retrieve(response_id, starting_after=3)  # without stream
    assert after_what.value.body["param"] == "starting_after"
    with pytest.raises(openai.BadRequestError) as foreground_stream:
        client.responses.retrieve(foreground.id, stream=True)
    assert foreground_stream.value.body["param"] == "stream"


def test_a_streamed_background_response_cancelled_midway_ends_its_stream(mesh: Mesh, client: openai.OpenAI) -> None:
    stream = client.responses.create(model=mesh.model, input=PROMPT, max_output_tokens=900, temperature=0,
                                     background=True, stream=True, extra_body={"ignore_eos": True})
    events: list[Any] = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 8:
            assert client.responses.cancel(events[0].response.id).status == "cancelled"
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.output_item.done" and events[-1].item.status == "incomplete"
    assert not {"response.completed", "response.incomplete", "response.failed"} & set(kinds)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert client.responses.retrieve(events[0].response.id).status == "cancelled"


def test_a_calls_output_continues_the_stored_response_that_made_the_call(mesh: Mesh, client: openai.OpenAI) -> None:
    called = client.responses.create(model=mesh.model, input="Paris?", tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    [call] = called.output
    answered = client.responses.create(
        model=mesh.model, previous_response_id=called.id, tools=TOOLS, tool_choice="none", max_output_tokens=8,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "clear"}],
    )
    items = [{"role": "user", "content": "Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "clear"}]
    sent_whole = client.responses.create(model=mesh.model, input=items, tools=TOOLS, tool_choice="none",
                                         max_output_tokens=8, temperature=0, store=False)
    assert answered.output_text == sent_whole.output_text
    assert answered.usage.input_tokens == sent_whole.usage.input_tokens


def _sdk_model(sdk: Any, api: str, mesh: Mesh) -> Any:
    """The OpenAI Agents SDK's model of the mesh: its Responses model, or its chat completions model."""
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    return (sdk.OpenAIResponsesModel if api == "responses" else sdk.OpenAIChatCompletionsModel)(
        model=mesh.model, openai_client=client,
    )


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_openai_agents_sdk_agent_calls_its_tool_and_answers(mesh: Mesh, api: str, streamed: bool) -> None:
    """The OpenAI Agents SDK's loop, on its Responses model and on its chat completions model: a required call of a
    Python function, its result sent back, and the answer after it. The stop string ends the demo model's answer
    (it would run to its budget, which the SDK takes for a failure)."""
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)
    cities: list[str] = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    model = _sdk_model(sdk, api, mesh)
    settings = sdk.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0,
                                 extra_body={"stop": ["\n#"]})
    agent = sdk.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                      model_settings=settings)

    async def run() -> Any:
        if not streamed:
            return await sdk.Runner.run(agent, "Weather in Paris?", max_turns=4)
        result = sdk.Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                   "MessageOutputItem"]
    assert len(cities) == 1 and isinstance(result.final_output, str)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_sdk_agent_with_an_output_type_calls_its_tool_and_answers_in_it(mesh: Mesh, api: str) -> None:
    """An agent whose final output is a record: the SDK sends the record's schema as the answer's format beside its
    strict function tools and tool_choice `required` (a calls-only answer, which the format does not shape), then
    the format alone once the tool has answered (it is enabled until then): the call, its result, the record."""
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)
    cities: list[str] = []

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        sunny: bool

    @sdk.function_tool(is_enabled=lambda context, agent: not cities)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    model = _sdk_model(sdk, api, mesh)
    settings = sdk.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0)
    agent = sdk.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                      model_settings=settings, output_type=Weather)
    result = asyncio.run(sdk.Runner.run(agent, "Weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert isinstance(result.final_output, Weather)
