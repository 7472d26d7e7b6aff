"""Tool calls on a Mistral checkpoint through the whole mesh (`specmesh up`, real processes and NATS, the openai
client): its template names the format, a forced call is written with the [TOOL_CALLS] and [ARGS] tokens and comes
back as OpenAI's tool_calls, the same whole and streamed, with ids of nine letters and digits; and a conversation
that carries earlier calls under other clients' ids renders, though Mistral's template takes only nine-character
ids. A tiny random Mistral: the grammar, not the weights, makes the calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services.gateway.tools.mistral import CALL_ID_CHARS, TAGS
from services.mesh_process import Mesh
from tests.demomeshfixture import client_of, running_mesh
from tests.modelfixture import make_tiny_model_dir

pytestmark = pytest.mark.e2e

CONTROL_TOKENS = (*TAGS, "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]")
# Written for this test after Mistral's v11 templates: tools first, calls as [TOOL_CALLS]name[ARGS]{...}, and call
# ids of any other length refused.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}"
    "{% if message.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings "
    "with length 9!') }}{% endif %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# tool_choice values that force a call, and their test ids
FORCING = pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"],
)


def family_fixtures(kind: str, control_tokens: tuple[str, ...], template: str) -> tuple[Any, Any]:
    """A family's module's `mesh` and `client` fixtures: the mesh on a tiny random checkpoint of `kind` with the
    family's control tokens and chat template, and an openai client of it (`mesh, client = family_fixtures(...)`)."""

    @pytest.fixture(scope="module")
    def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
        model = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, control_tokens, template)
        yield from running_mesh(tmp_path_factory, "--max-num-seqs", "4", model=model)

    @pytest.fixture(scope="module")
    def client(mesh: Mesh) -> openai.OpenAI:
        return client_of(mesh)

    return mesh, client


def family_tests(max_tokens: int) -> tuple[Any, Any]:
    """A family's module's two tests: a forced call comes back as tool calls whole and streamed (forced_call, with
    `max_tokens`), and a conversation with an earlier call renders (answers_after_a_call)
    (`test_a_forced_call_..., test_a_conversation_... = family_tests(max_tokens)`)."""

    @FORCING
    def forced(client: openai.OpenAI, mesh: Mesh, tool_choice) -> None:
        forced_call(client, mesh, tool_choice, max_tokens=max_tokens)

    def conversation(client: openai.OpenAI, mesh: Mesh) -> None:
        answers_after_a_call(client, mesh)

    return forced, conversation


mesh, client = family_fixtures("mistral", CONTROL_TOKENS, TEMPLATE)


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _valid(name: str, arguments: dict) -> bool:
    if name == "get_time":
        return arguments == {}
    return name == "get_weather" and arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["days"], int)


@FORCING
def test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed(client: openai.OpenAI, mesh: Mesh,
                                                                   tool_choice) -> None:
    whole = forced_call(client, mesh, tool_choice, max_tokens=48)
    assert all(len(c.id) == CALL_ID_CHARS and c.id.isalnum() for c in whole.message.tool_calls)


def forced_call(client: openai.OpenAI, mesh: Mesh, tool_choice, max_tokens: int):
    """The choice of a seeded chat request whose `tool_choice` forces one call of WEATHER or TIME, checked: a valid
    call and no content, finish_reason `tool_calls` (`stop` for a named function, as OpenAI answers), and the same
    call and finish streamed."""
    params = dict(model=mesh.model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=max_tokens, temperature=1.0, seed=11)
    whole = client.chat.completions.create(**params).choices[0]
    assert whole.message.content is None and whole.message.tool_calls, whole
    calls = _calls(whole.message.tool_calls)
    assert len(calls) == 1 and _valid(*calls[0]), calls
    if tool_choice != "required":
        assert calls[0][0] == "get_weather" and whole.finish_reason == "stop"
    else:
        assert whole.finish_reason == "tool_calls"
    assert streamed_calls(client.chat.completions.create(stream=True, **params)) == (calls, whole.finish_reason)
    return whole


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    """A streamed answer's calls, put together from their deltas, and its finish reason; none of it content."""
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content, "the tags and calls never stream as content"
            for entry in choice.delta.tool_calls or ():
                call = streamed.setdefault(entry.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or entry.function.name
                call["arguments"] += entry.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for c in streamed.values()], finish


def test_a_conversation_with_other_clients_call_ids_renders(client: openai.OpenAI, mesh: Mesh) -> None:
    """OpenAI's ids (call_ and 24 characters) reach Mistral's template cut to their last nine, as vLLM cuts them."""
    answers_after_a_call(client, mesh)


def answers_after_a_call(client: openai.OpenAI, mesh: Mesh) -> None:
    """A conversation holding an earlier call, under an id of OpenAI's shape, and its result: rendered and answered."""
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_8f2c1d0e9b7a6c5d4e3f2a1b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_8f2c1d0e9b7a6c5d4e3f2a1b", "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(model=mesh.model, messages=messages, tools=[WEATHER, TIME],
                                            max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens > 0 and answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
