"""`specmesh up --tensor-parallel-size 2` through the real mesh and the official openai client: its worker's engine
runs split over two ranks and answers with the greedy tokens of the whole model in one process."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from tests.methodfixture import METHODS, make_engine, make_request, tokens_alone

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
PROMPT = "def fibonacci(n):\n"
METHOD = "mtp"  # the method whose drafter runs the split model most (its MTP module, every step)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(
        tmp_path_factory.mktemp("mesh"), "--max-num-seqs", "2", "--max-model-len", "256",
        "--tensor-parallel-size", "2", "--speculative-config", METHODS[METHOD].config().model_dump_json(),
    )
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


def test_a_split_worker_serves_the_whole_models_greedy_tokens(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(
        model=mesh.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    prompt_ids = list(choice.model_extra["prompt_token_ids"])
    engine = make_engine(DEFAULT_MODEL_DIR, METHODS[METHOD])
    whole = tokens_alone(engine, make_request(prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert list(choice.model_extra["token_ids"]) == whole
    assert choice.text and response.usage.completion_tokens == MAX_TOKENS
