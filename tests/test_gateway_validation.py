"""Every invalid request gets the right status and an OpenAI error body naming the parameter.

A real nats-server (with JetStream), the real gateway app on a real port, a real tokenizer trained on a few
stdlib files (fixtures in gatewayfixture.py), and the real `openai` client.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import OpenAIError
from services.gateway.response_size import check_response_size
from services.gateway.structured_request import ResponseFormat
from services.gateway.unknown_fields import MAX_LOGGED_NAMES, UnknownFields
from tests.gatewayfixture import (
    MAX_MODEL_LEN, MODEL, VOCAB_SIZE, NatsServer, client, gateway, model_dir, nats_server, start_gateway,
)

__all__ = ["client", "gateway", "model_dir", "nats_server"]  # fixtures, imported for pytest to find

TOO_LARGE = 5 * 1024 * 1024


def _check_error(exc: openai.APIStatusError, status: int, param: str | None, code: str | None = None) -> None:
    assert exc.status_code == status
    assert isinstance(exc.body, dict), exc.body
    assert set(exc.body) == {"message", "type", "param", "code"}
    assert exc.body["message"]
    assert exc.param == param, exc.body
    if code is not None:
        assert exc.code == code


async def _chat_error(client: openai.AsyncOpenAI, **kwargs) -> openai.APIStatusError:
    kwargs.setdefault("messages", [{"role": "user", "content": "hello"}])
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model=MODEL, **kwargs)
    return info.value


async def _completion_error(client: openai.AsyncOpenAI, **kwargs) -> openai.APIStatusError:
    kwargs.setdefault("prompt", "def f(x):")
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(model=MODEL, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": 2**63}, "seed"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 2}}, "prompt_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"int": "x"}}, "logit_bias.int"),  # a key the client chose, though it spells a type
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "", "content": "hi"}]}, "messages.[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.[0].content"),
        # A refusal is an assistant's part only, as OpenAI's schema has it
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "messages.[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.[0].content"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.[0].function"),
        # The test model's template writes no tool-call format the gateway reads: tools are refused, not misread.
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        # OpenAI fields that change the answer and are not implemented: refused by name, never dropped.
        ({"extra_body": {"functions": [{"name": "f", "parameters": {}}]}}, "functions"),
        ({"extra_body": {"function_call": {"name": "f"}}}, "function_call"),
        ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),
        # Nothing offered to call: OpenAI and vLLM refuse it, and a call read from the answer would name no tool.
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages.[1].function_call"),
        ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
        ({"extra_body": {"reasoning_effort": "low"}}, "reasoning_effort"),
        ({"extra_body": {"verbosity": "low"}}, "verbosity"),
        ({"extra_body": {"web_search_options": {}}}, "web_search_options"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),
        ({"extra_body": {"include_reasoning": False}}, "include_reasoning"),
        # vLLM's structural tags: every structure begins with a trigger; xgrammar's newer formats are refused by name
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                               "structures": [{"begin": "<g=", "schema": {}, "end": ">"}]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f=", "schema": {}, "end": ">"}]}},
         "response_format.triggers"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                              "structures": [{"begin": "<f=", "schema": "{x", "end": ">"}]}},
         "response_format.structures.[0].schema"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
         "response_format.format"),
        ({"response_format": {"type": "json_object", "triggers": ["<f="]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
            {"begin": "<f=", "schema": {"type": "wrong"}, "end": ">"}]}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "{not json"}}}, "structured_outputs.structural_tag"),
        ({"extra_body": {"structural_tag": "{}"}}, "structural_tag"),
        ({"stream": True, "stream_options": {"continuous_usage_stat": True}}, "stream_options.continuous_usage_stat"),
    ],
)
async def test_chat_rejects_bad_parameters(client: openai.AsyncOpenAI, kwargs: dict, param: str) -> None:
    exc = await _chat_error(client, **kwargs)
    _check_error(exc, 400, param)
    assert exc.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"n": 17}, "n"),
        ({"echo": "yes"}, "echo"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"extra_body": {"guided_regex": "a" * (1 << 20) + "b"}}, "guided_regex"),  # a 500 before
        # 128 prompts x 16 choices x 60 tokens x 21 values, echoed or scored: 2.6 million logprobs in one response
        ({"prompt": [[5] * 60] * 128, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 1}, "echo"),
        ({"prompt": [[5] * 60] * 128, "n": 16, "max_tokens": 1, "extra_body": {"prompt_logprobs": 20}},
         "prompt_logprobs"),
        ({"suffix": "end"}, "suffix"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"prompt": ["one", [1, 2]]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [["one"]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, VOCAB_SIZE + 5]}, "prompt"),
        ({"prompt": [[1], [1, VOCAB_SIZE + 5]]}, "prompt.[1]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ""}, "stop"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        # Chat's tool calling: a completion has no template to offer tools with, and a forced call would go unforced.
        ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
        ({"extra_body": {"tool_choice": "required"}}, "tool_choice"),
    ],
)
async def test_completion_rejects_bad_parameters(client: openai.AsyncOpenAI, kwargs: dict, param: str) -> None:
    _check_error(await _completion_error(client, **kwargs), 400, param)


async def test_prompt_longer_than_the_model_allows(client: openai.AsyncOpenAI) -> None:
    long_prompt = "x = [" + ", ".join(str(i) for i in range(200)) + "]"
    _check_error(await _completion_error(client, prompt=long_prompt), 400, "prompt", "context_length_exceeded")
    _check_error(await _completion_error(client, prompt=list(range(1, MAX_MODEL_LEN + 1))), 400, "prompt")
    long_chat = [{"role": "user", "content": long_prompt}]
    _check_error(await _chat_error(client, messages=long_chat), 400, "messages", "context_length_exceeded")


async def test_prompt_plus_max_tokens_longer_than_the_model_allows(client: openai.AsyncOpenAI) -> None:
    exc = await _completion_error(client, prompt=[1, 2, 3], max_tokens=MAX_MODEL_LEN - 2)
    _check_error(exc, 400, "max_tokens", "context_length_exceeded")
    exc = await _chat_error(client, max_completion_tokens=MAX_MODEL_LEN)
    _check_error(exc, 400, "max_completion_tokens", "context_length_exceeded")


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    _check_error(info.value, 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("gpt-nope")
    _check_error(info.value, 404, "model", "model_not_found")


async def test_missing_messages(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.post("/chat/completions", body={"model": MODEL}, cast_to=object)
    _check_error(info.value, 400, "messages")
    assert "Missing" in info.value.body["message"]


async def test_wrong_type_is_400_not_500(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.post("/completions", body={"model": MODEL, "prompt": "a", "stream": "yes"}, cast_to=object)
    _check_error(info.value, 400, "stream")


async def test_body_too_large_is_413(client: openai.AsyncOpenAI) -> None:
    exc = await _completion_error(client, prompt="x" * TOO_LARGE)
    _check_error(exc, 413, None)


async def _raw(gateway: TestServer, method: str, path: str, data: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, gateway.make_url(path), data=data) as response:
            assert response.content_type == "application/json"
            return response.status, await response.json()


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"'])
async def test_invalid_json_is_400(gateway: TestServer, body: bytes) -> None:
    status, payload = await _raw(gateway, "POST", "/v1/chat/completions", body)
    assert status == 400
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] is None


async def test_unknown_route_and_wrong_method_are_json(gateway: TestServer) -> None:
    status, payload = await _raw(gateway, "GET", "/v1/nothing-here")
    assert status == 404 and payload["error"]["message"]
    status, payload = await _raw(gateway, "GET", "/v1/completions")
    assert status == 405 and "POST" in payload["error"]["message"]


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "specmesh"
    assert (await client.models.retrieve(MODEL)).id == MODEL


async def test_health_and_metrics(gateway: TestServer) -> None:
    status, payload = await _raw(gateway, "GET", "/health")
    assert (status, payload) == (200, {"status": "ok"})
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.make_url("/metrics")) as response:
            assert response.status == 200
            text = await response.text()
    assert 'specmesh_gateway_requests_total{route="/health",status="200"}' in text


async def test_error_messages_name_the_parameter_and_the_bad_value(client: openai.AsyncOpenAI) -> None:
    temperature = await _chat_error(client, temperature=2.5)
    assert "'temperature'" in temperature.body["message"] and "2.5" in temperature.body["message"]
    n = await _completion_error(client, n=17)
    assert "got 17" in n.body["message"] and "--max-n" in n.body["message"]
    part = await _chat_error(client, messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    assert "input_audio" in part.body["message"]


# Refuses roles it does not know, the way Hugging Face templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


async def test_what_the_chat_template_cannot_render_is_a_400_naming_the_error(
    nats_server: NatsServer, model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    strict = tmp_path / "strict"
    shutil.copytree(model_dir, strict)
    config = json.loads((strict / "tokenizer_config.json").read_text())
    (strict / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": STRICT_TEMPLATE}))
    server, nc = await start_gateway(nats_server, strict)
    try:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
            exc = await _chat_error(c, messages=[{"role": "tool", "content": "3"}])
    finally:
        await server.close()
        await nc.drain()
    _check_error(exc, 400, "messages")
    assert "TemplateError: roles must be system, user or assistant" in exc.body["message"]


def test_a_json_schema_format_reads_its_schema_under_either_name() -> None:
    """OpenAI's `schema`, or `json_schema` as some clients write it inside and vLLM reads it; both, differing: 400."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for inner in ({"name": "r", "schema": schema}, {"name": "r", "json_schema": schema},
                  {"name": "r", "schema": schema, "json_schema": schema}):
        parsed = ResponseFormat.model_validate({"type": "json_schema", "json_schema": inner})
        assert parsed.json_schema.schema_ == schema
    with pytest.raises(ValidationError, match="differ"):
        ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "json_schema": {"type": "string"}}}
        )


def test_the_response_size_bound_counts_prompt_logprobs_only_as_shown() -> None:
    """Generated logprobs cost the mesh their generation and are not counted; chat shows prompt_logprobs once, on the
    response, whatever n (completions on every choice)."""
    hi = [{"role": "user", "content": "hi"}]
    check_response_size(ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": hi, "logprobs": True, "top_logprobs": 20, "n": 16}), [100_000])
    scored = {"model": MODEL, "n": 16, "prompt_logprobs": 20}
    check_response_size(ChatCompletionRequest.model_validate({**scored, "messages": hi}), [90_000])
    with pytest.raises(OpenAIError):
        check_response_size(CompletionRequest.model_validate({**scored, "prompt": "hi"}), [90_000])


def test_unknown_field_names_are_logged_once_each_and_boundedly(caplog: pytest.LogCaptureFixture) -> None:
    """Each unknown name is logged once, and at most MAX_LOGGED_NAMES of them are remembered: a client sending
    thousands of new names per request grows neither the gateway's memory nor its log without bound."""
    fields = UnknownFields(strict=False, known={"completion": frozenset({"model"})})
    with caplog.at_level(logging.WARNING, logger="services.gateway.unknown_fields"):
        for batch in range(3):
            fields.check({"model": "m", **{f"x{batch}-{i}": 1 for i in range(MAX_LOGGED_NAMES)}}, "completion")
        fields.check({"x0-0": 1}, "completion")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_LOGGED_NAMES + 1 and "no more are logged" in lines[-1]


def test_an_error_names_the_first_bad_place_and_its_unions_deepest_complaint() -> None:
    """A later list item's deeper error does not displace the first item's; keys clients chose stay in the name."""
    from services.gateway.errors import from_validation_error
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"tools": [{"type": "function"}, {"type": "function", "function": {"name": "a", "parameters": 5}}]},
         "tools.[0].function"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"logit_bias": {"Hello": "x"}}, "logit_bias.Hello"),
    ]
    for fields, param in cases:
        with pytest.raises(ValidationError) as caught:
            ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
        assert from_validation_error(caught.value).param == param


def test_a_null_parallel_tool_calls_is_the_default_as_on_the_responses_endpoint() -> None:
    """Clients that send every unset option as null (as vLLM takes this one) get the default, not a 400."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": null}'
    assert ChatCompletionRequest.model_validate_json(body).parallel_tool_calls is True
