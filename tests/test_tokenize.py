"""vLLM's /tokenize and /detokenize on a real gateway (real NATS, the demo model's tokenizer and chat template): a
text or a chat as the model's tokens, the same tokens /v1/chat/completions would send, and tokens back as text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from services.gateway.chat_request import ChatCompletionRequest
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer
from tests.gatewayfixture import MAX_MODEL_LEN, MODEL, start_gateway
from tests.natsfixture import NatsServer, nats_server

__all__ = ["nats_server"]  # a fixture, imported for pytest to find

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cache?"}]


@pytest.fixture(scope="module")
async def gateway(nats_server: NatsServer) -> AsyncIterator[TestServer]:
    server, nc = await start_gateway(nats_server, DEFAULT_MODEL_DIR)
    yield server
    await server.close()
    await nc.drain()


async def _post(gateway: TestServer, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(gateway.make_url(path), json=body) as response:
        return response.status, await response.json()


async def test_a_text_is_tokenized_with_or_without_the_special_tokens(gateway: TestServer) -> None:
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    status, body = await _post(gateway, "/tokenize", {"model": MODEL, "prompt": "def f(x):", "return_token_strs": True})
    assert status == 200
    ids = tokenizer.encode("def f(x):")
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                    "token_strs": tokenizer.token_strs(ids)}
    _, bare = await _post(gateway, "/tokenize", {"prompt": "def f(x):", "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode("def f(x):", add_special_tokens=False) and bare["token_strs"] is None


async def test_a_chat_is_tokenized_as_chat_completions_render_it(gateway: TestServer) -> None:
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    _, body = await _post(gateway, "/tokenize", {"messages": MESSAGES})
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES})
    assert body["tokens"] == tokenizer.apply_chat_template(request.chat()) and body["count"] == len(body["tokens"])
    _, open_turn = await _post(gateway, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert open_turn["count"] < body["count"]


async def test_tokens_come_back_as_text_special_tokens_included(gateway: TestServer) -> None:
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    ids = tokenizer.encode("return x")
    status, body = await _post(gateway, "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and body == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert body["prompt"].endswith("return x") and body["prompt"] != "return x"  # the BOS token's text first


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "hi", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"messages": []}, 400, "messages"),
])
async def test_bad_requests_name_the_parameter(gateway: TestServer, path: str, body: dict, status: int,
                                               param: str) -> None:
    got, error = await _post(gateway, path, body)
    assert got == status and error["error"]["param"] == param, error
