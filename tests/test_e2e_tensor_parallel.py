"""`specmesh up --tensor-parallel-size 2 --prefill-tensor-parallel-size 1` with a prefill and a decode worker,
through the real mesh and the official openai client: the unsplit prefill worker hands each request to the decode
worker, whose engine runs split over two ranks, and the answer is the greedy tokens of the whole model in one process.
(A split engine against the whole one for every method, and handoffs between differently split engines both ways:
tests/test_tensor_parallel_engine.py, tests/test_tensor_parallel_handoff.py.)"""

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
    """A prefill worker on one process hands each request to a decode worker split over two (--tensor-parallel-size
    applies to every worker, --prefill-tensor-parallel-size overrides it for prefill): every step after the first
    token, MTP drafts included, runs on the split model."""
    m = start_mesh(
        tmp_path_factory.mktemp("mesh"), "--max-num-seqs", "2", "--max-model-len", "256",
        "--prefill-workers", "1", "--decode-workers", "1", "--tensor-parallel-size", "2",
        "--prefill-tensor-parallel-size", "1", "--speculative-config", METHODS[METHOD].config().model_dump_json(),
    )
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


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


def test_a_split_decode_worker_serves_the_whole_models_greedy_tokens(mesh: Mesh) -> None:
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
    assert _metric(mesh.metrics_urls["worker-1"], "specmesh_worker_handoffs_total", 'outcome="imported"') == 1
    workers = {
        command.split("--role ")[1].split()[0]: pid for pid, command in mesh.children().items()
        if "--role " in command and "spawn_main" not in command
    }
    assert {role: len(_engine_ranks(pid)) for role, pid in workers.items()} == {"prefill": 1, "decode": 2}
