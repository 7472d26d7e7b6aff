"""API keys on the real gateway, driven by the real openai client: every /v1 route needs one of the keys, a wrong or
missing key gets OpenAI's 401 body, health, readiness and metrics stay open, and no key reaches a log line."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from services import cli
from services.gateway.auth import API_KEY_ENV, VLLM_API_KEY_ENV, parse_api_keys
from services.startup_checks import UsageError
from tests.gatewayfixture import MODEL, model_dir, nats_server, start_gateway  # noqa: F401
from tests.natsfixture import NatsServer

KEYS = ("sk-first-key", "sk-second-key")
WRONG_KEY = "sk-not-a-key"
UNAUTHORIZED = 401


@pytest.fixture(scope="module")
async def keyed(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[TestServer]:  # noqa: F811
    server, nc = await start_gateway(nats_server, model_dir, api_keys=tuple(SecretStr(k) for k in KEYS))
    yield server
    await server.close()
    await nc.drain()


def _client(server: TestServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


@pytest.mark.parametrize("key", KEYS)
async def test_each_key_opens_the_api(keyed: TestServer, key: str) -> None:
    async with _client(keyed, key) as client:
        assert [m.id for m in (await client.models.list()).data] == [MODEL]


async def test_a_wrong_key_raises_authentication_error_with_openais_body(keyed: TestServer) -> None:
    async with _client(keyed, WRONG_KEY) as client:
        with pytest.raises(openai.AuthenticationError) as raised:
            await client.completions.create(model=MODEL, prompt="def", max_tokens=2)
    assert raised.value.status_code == UNAUTHORIZED
    assert raised.value.body == {
        "message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize(
    "method, path, headers",
    [
        ("POST", "/v1/completions", {}),
        ("POST", "/v1/chat/completions", {"Authorization": "Basic dXNlcjpwYXNz"}),
        ("GET", "/v1/models", {"Authorization": "Bearer"}),
        ("GET", f"/v1/models/{MODEL}", {"Authorization": f"Bearer {WRONG_KEY}"}),
        ("GET", "/v1/no-such-route", {}),
    ],
)
async def test_every_v1_route_refuses_a_missing_or_wrong_key(
    keyed: TestServer, method: str, path: str, headers: dict[str, str]
) -> None:
    async with aiohttp.ClientSession() as session:
        # The body is not even valid: the key is checked before anything is read.
        async with session.request(method, keyed.make_url(path), headers=headers, data=b"{") as resp:
            body = await resp.json()
            assert resp.status == UNAUTHORIZED and resp.headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] is None


async def test_the_bearer_scheme_is_case_insensitive(keyed: TestServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(keyed.make_url("/v1/models"), headers={"Authorization": f"bearer {KEYS[0]}"}) as resp:
            assert resp.status == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
async def test_health_readiness_and_metrics_stay_open(keyed: TestServer, path: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(keyed.make_url(path)) as resp:
            assert resp.status == 200


async def test_no_key_reaches_the_logs(keyed: TestServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for key in (KEYS[0], WRONG_KEY):
        async with _client(keyed, key) as client:
            try:
                await client.models.list()
            except openai.AuthenticationError:
                pass
    assert all(key not in caplog.text for key in (*KEYS, WRONG_KEY))
    assert KEYS[0] not in repr(parse_api_keys([KEYS[0]], None, {}))


def test_keys_come_from_options_the_environment_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-file-1\n\n  sk-from-file-2  \nsk-twice\n")
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env,sk-twice")
    monkeypatch.setenv(VLLM_API_KEY_ENV, "sk-from-vllms-env")  # where a vLLM user keeps theirs
    _, args = cli.parse(["gateway", "--api-key", "sk-from-flag", "--api-key-file", str(key_file)])
    assert [k.get_secret_value() for k in args.api_keys] == [
        "sk-from-flag", "sk-from-env", "sk-twice", "sk-from-file-1", "sk-from-file-2",
    ]


def test_vllms_variable_gives_the_key_when_nothing_else_does() -> None:
    """As in vLLM, where --api-key replaces it: a key rotated on the command line leaves the old one refused."""
    assert [k.get_secret_value() for k in parse_api_keys([], None, {VLLM_API_KEY_ENV: "sk-old"})] == ["sk-old"]
    assert [k.get_secret_value() for k in parse_api_keys(["sk-new"], None, {VLLM_API_KEY_ENV: "sk-old"})] == [
        "sk-new"
    ]
    with pytest.raises(UsageError, match=f"^{VLLM_API_KEY_ENV}: an API key must be"):
        parse_api_keys([], None, {VLLM_API_KEY_ENV: "sk-a,sk-b"})


def test_a_malformed_key_is_refused_by_its_place_never_by_its_value(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-good\nsk bad key\n")
    with pytest.raises(UsageError, match=r"line 2: an API key must be") as refused:
        parse_api_keys([], key_file, {})
    assert "sk bad key" not in str(refused.value)
