"""The engine split over two real ranks (gloo, two processes) against the whole model in one: the same greedy
tokens for every drafting method, and the same seeded samples; and a rank that dies fails the engine loudly,
mid-step or idle, instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.worker.engine import kv_budget
from services.worker.engine.engine import Engine
from services.worker.engine_process import EngineError, EngineProcess
from services.worker.tensor_parallel.errors import RankFailed
from services.worker.tensor_parallel.leader import LeaderRunner
from shared.config import EngineConfig
from shared.schemas import WorkRequest
from tests.methodfixture import METHODS, make_engine, make_request, run, tokens_of
from tests.modelfixture import make_tiny_model_dir

TP = 2
MAX_TOKENS = 16
SEED = 11
PROMPTS = ([1, 40, 41, 42, 43, 44, 40, 41, 42], [1, 300, 301, 302, 303], [1, 7, 8, 9, 10, 11, 12, 13, 14, 7, 8, 9])
# The method table's configs, on the demo model (which has an MTP module, and an EAGLE-3 head beside it). Suffix
# decoding is left out: its drafts come from the leader's tables, and the split model verifies them as it does ngram's.
TP_METHODS = ("naive", "ngram", "mtp", "eagle3")
DEATH_TIMEOUT_S = 30.0


def _requests() -> list[WorkRequest]:
    greedy = [make_request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    seeded = [make_request(p, max_tokens=MAX_TOKENS, temperature=0.8, seed=SEED, ignore_eos=True) for p in PROMPTS]
    return greedy + seeded


def _tokens(engine: Engine) -> list[list[int]]:
    requests = _requests()
    steps = run(engine, {0: requests})
    return [tokens_of(steps, r) for r in requests]


@pytest.fixture
def split_engine() -> Iterator[Callable[[str], Engine]]:
    """Builds TP engines and closes their groups after the test."""
    engines: list[Engine] = []

    def build(method: str, model_dir: Path = Path(EngineConfig().model), **overrides) -> Engine:
        engine = make_engine(model_dir, METHODS[method], tensor_parallel_size=TP, **overrides)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.runner.close()


@pytest.mark.parametrize("method", TP_METHODS)
def test_two_ranks_give_the_tokens_of_one(method: str, split_engine) -> None:
    whole = _tokens(make_engine(Path(EngineConfig().model), METHODS[method]))
    engine = split_engine(method)
    assert isinstance(engine.runner, LeaderRunner)
    assert _tokens(engine) == whole
    cache = engine.runner.cache  # each rank's: what the KV budget plans for a rank (engine/kv_budget.py)
    allocated = cache.nbytes + cache.boundary_hidden.numel() * cache.boundary_hidden.element_size()
    assert allocated == kv_budget._block_cost(engine.config)[0] * (cache.num_blocks + 1)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced-experts", "whole-experts"])
def test_two_ranks_give_the_tokens_of_one_under_routed_experts(split_engine, tmp_path: Path, expert_parallel) -> None:
    model_dir = make_tiny_model_dir(tmp_path, "qwen3_moe")
    whole = _tokens(make_engine(model_dir, METHODS["ngram"]))
    assert _tokens(split_engine("ngram", model_dir, enable_expert_parallel=expert_parallel)) == whole


def test_a_rank_that_dies_mid_run_fails_the_next_step_loudly(split_engine) -> None:
    engine = split_engine("ngram")
    engine.add_request(make_request(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    engine.step()
    follower = engine.runner.followers.processes[0]
    os.kill(follower.pid, signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(RankFailed, match=f"rank 1 died \\(exit code {-signal.SIGKILL}\\)"):
        while engine.has_work():
            engine.step()
    assert time.monotonic() - began < DEATH_TIMEOUT_S


def _children(pid: int) -> list[int]:
    """The process's children (the engine process's: its follower rank)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_a_rank_that_dies_while_the_engine_idles_fails_the_engine_process() -> None:
    config = EngineConfig(max_num_seqs=2, max_model_len=256, tensor_parallel_size=TP)
    engine = await EngineProcess.start(config, worker_id=3, torch_threads=1)
    try:
        (follower,) = _children(engine.process.pid)
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(EngineError, match="RankFailed: tensor-parallel rank 1 died"):
            async with asyncio.timeout(DEATH_TIMEOUT_S):
                async for _ in engine.results():
                    pass
    finally:
        await engine.close()
