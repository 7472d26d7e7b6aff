"""One `specmesh up` on the demo model (real processes, real NATS) shared by the API tests that need no special
server options, with an openai client and the demo tokenizer: import the fixtures by name into a test module."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

MESH_OPTIONS = ("--max-num-seqs", "4", "--max-model-len", "256")
CLIENT_TIMEOUT_S = 120


def running_mesh(tmp_path_factory: pytest.TempPathFactory, *options: str) -> Iterator[Mesh]:
    """A fixture's body: `specmesh up` with `options`, stopped cleanly after the tests that use it."""
    m = start_mesh(tmp_path_factory.mktemp("mesh"), *options)
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


def client_of(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    yield from running_mesh(tmp_path_factory, *MESH_OPTIONS)


@pytest.fixture(scope="session")
def client(mesh: Mesh) -> openai.OpenAI:
    return client_of(mesh)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)
