"""Fixtures for gateway tests: a real nats-server with JetStream, a tiny real model directory, the gateway app.

Import the fixtures into a test module (`from tests.gatewayfixture import client, gateway, ...`).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer
from nats.aio.client import Client
from tests.natsfixture import NatsServer, nats_server

from services.gateway.app import GatewayConfig, create_app
from services.worker.demo_model.tokenizer import train_tokenizer
from shared.nats_roles import NatsRole
from shared.natsutil import connect

MODEL = "tiny"
MAX_MODEL_LEN = 64
MAX_POSITIONS = 128
VOCAB_SIZE = 600
TRAINING_FILES = ("textwrap.py", "json/decoder.py", "json/encoder.py")


__all__ = ["nats_server"]  # re-exported: gateway tests import every fixture from here

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    stdlib = Path(sysconfig.get_path("stdlib"))
    train_tokenizer([(stdlib / name).read_text() for name in TRAINING_FILES], VOCAB_SIZE, out)
    (out / "config.json").write_text(json.dumps({"eos_token_id": 0, "max_position_embeddings": MAX_POSITIONS}))
    return out


async def start_gateway(nats: NatsServer, model_dir: Path, **config: object) -> tuple[TestServer, Client]:
    """A gateway on a real port (TestServer runs handlers with handler_cancellation, as service.py does), connected
    as the gateway's NATS user."""
    nc = await connect(nats.settings(NatsRole.GATEWAY), "test-gateway")
    defaults = {"model_dir": model_dir, "served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN}
    settings = GatewayConfig(**(defaults | config))
    server = TestServer(create_app(settings, nc))
    await server.start_server(**settings.limits.runner_options())
    return server, nc


@pytest.fixture(scope="module")
async def gateway(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[TestServer]:  # noqa: F811
    server, nc = await start_gateway(nats_server, model_dir)
    yield server
    await server.close()
    await nc.drain()


@pytest.fixture
async def client(gateway: TestServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="x", max_retries=0) as c:
        yield c
