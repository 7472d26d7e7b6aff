"""`specmesh up --tensor-parallel-size 2` through the real mesh and the official openai client: its worker's engine
runs split over two ranks and answers with the greedy tokens of the whole model in one process; and with
`--prefill-tensor-parallel-size 2`, a prefill worker split over two ranks hands its requests to an unsplit decode
worker, which goes on with those tokens."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from services.process_tree import descendants
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


def _metric(url: str, name: str, labels: str) -> float:
    """The sum of a counter's samples whose labels contain `labels`, from a service's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def _engine_ranks(worker_pid: int) -> list[int]:
    """The processes a worker's engine runs its model in: the engine process, and its other ranks (all started by
    multiprocessing's spawn)."""
    return [pid for pid, command in descendants(worker_pid).items() if "spawn_main" in command]


def test_a_split_worker_serves_the_whole_models_greedy_tokens(mesh: Mesh) -> None:
    _greedy_tokens_are_the_whole_models(mesh.base_url, mesh.model)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """`specmesh up` with a prefill worker split over two ranks and an unsplit decode worker."""
    m = start_mesh(
        tmp_path_factory.mktemp("disaggregated"), "--max-num-seqs", "2", "--max-model-len", "256",
        "--prefill-workers", "1", "--decode-workers", "1", "--prefill-tensor-parallel-size", "2",
        "--speculative-config", METHODS[METHOD].config().model_dump_json(),
    )
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


def test_a_split_prefill_worker_hands_off_to_an_unsplit_decode_worker(disaggregated: Mesh) -> None:
    _greedy_tokens_are_the_whole_models(disaggregated.base_url, disaggregated.model)
    decode = disaggregated.metrics_urls["worker-1"]
    assert _metric(decode, "specmesh_worker_handoffs_total", 'outcome="imported"') == 1
    # The prefill worker's engine runs two ranks, the decode worker's one
    workers = {
        command.split("--role ")[1].split()[0]: pid for pid, command in disaggregated.children().items()
        if "--role " in command and "spawn_main" not in command
    }
    assert {role: len(_engine_ranks(pid)) for role, pid in workers.items()} == {"prefill": 2, "decode": 1}
