"""One `specmesh up` on the demo model (real processes, real NATS) for the API test modules that need no special
server options, with an openai client and the demo tokenizer: import the fixtures by name into a test module. The
mesh itself is one per test process (conftest.py's demo_mesh), shared by those modules: a test sends text no other
test sends where what the mesh kept matters (its prefix cache)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

# Tools rendered into the prompt take a few hundred of the demo tokenizer's tokens: a context of 1,024.
MESH_OPTIONS = ("--max-num-seqs", "4", "--max-model-len", "1024")
CLIENT_TIMEOUT_S = 120


def running_mesh(
    tmp_path_factory: pytest.TempPathFactory, *options: str, model: Path = DEFAULT_MODEL_DIR
) -> Iterator[Mesh]:
    """A fixture's body: `specmesh up` with `options` on `model`, stopped cleanly after the tests that use it."""
    m = start_mesh(tmp_path_factory.mktemp("mesh"), *options, model=model)
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


def client_of(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


# A fixture imported into several modules is one fixture per module, whatever its scope: the shared mesh is
# conftest.py's, which this hands on.
@pytest.fixture(scope="module")
def mesh(demo_mesh: Mesh) -> Mesh:
    return demo_mesh


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return client_of(mesh)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)

