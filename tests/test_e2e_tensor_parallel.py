"""`specmesh up --tensor-parallel-size 2` through the real mesh and the official openai client: its worker's engine
runs split over two ranks and answers with the greedy tokens of the whole model in one process; and a prefill
worker split over two ranks hands its requests to an unsplit decode worker, which goes on with those tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from tests.methodfixture import METHODS, make_engine, make_request, tokens_alone
from tests.natsfixture import running_nats_server
from tests.test_drain import Service

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


def _greedy_tokens_are_the_whole_models(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    prompt_ids = list(choice.model_extra["prompt_token_ids"])
    engine = make_engine(DEFAULT_MODEL_DIR, METHODS[METHOD])
    whole = tokens_alone(engine, make_request(prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert list(choice.model_extra["token_ids"]) == whole
    assert choice.text and response.usage.completion_tokens == MAX_TOKENS


def test_a_split_worker_serves_the_whole_models_greedy_tokens(mesh: Mesh) -> None:
    _greedy_tokens_are_the_whole_models(mesh.base_url, mesh.model)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """A prefill worker split over two ranks, an unsplit decode worker: its gateway and decode worker."""
    options = ("--torch-threads", "1", "--max-num-seqs", "2", "--max-model-len", "256",
               "--speculative-config", METHODS[METHOD].config().model_dump_json())
    with ExitStack() as stack:
        nats = stack.enter_context(running_nats_server(tmp_path_factory.mktemp("disaggregated")))
        services = [
            Service("worker", nats, *options, "--worker-id", "1", "--role", "prefill", "--tensor-parallel-size", "2"),
            Service("worker", nats, *options, "--worker-id", "2", "--role", "decode"),
            Service("detokenizer", nats),
            Service("gateway", nats),
        ]
        stack.callback(lambda: [service.kill() for service in services])
        yield services[3], services[1]


def test_a_split_prefill_worker_hands_off_to_an_unsplit_decode_worker(disaggregated) -> None:
    gateway, decode = disaggregated
    _greedy_tokens_are_the_whole_models(f"http://127.0.0.1:{gateway.port}/v1", DEFAULT_MODEL_DIR.name)
    assert decode.metric("specmesh_worker_handoffs_total", 'outcome="imported"') == 1
