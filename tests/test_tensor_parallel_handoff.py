"""Prefill/decode disaggregation between engines split over different numbers of ranks (gloo, real processes): a
handoff carries every KV head, gathered from the prefill engine's ranks and cut anew for the decode engine's, so a
prefill worker split over two ranks hands its requests to an unsplit decode worker and the other way round, and the
two emit the tokens (and drafts) of one unsplit engine, greedy and seeded, under MTP (whose module's cache and trunk
states travel too) and plain decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.handoff.format import decode, trim
from services.worker.tensor_parallel.leader import LeaderRunner
from shared.config import EngineConfig
from tests.handofffixture import decode_request, run_prefill
from tests.methodfixture import METHODS, encode_prompts, make_engine, make_request, outputs_of, run

TP = 2
NUM_TOKENS = 16
BLOCK_SIZE = 16
PROMPT_TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SAMPLINGS = {
    "greedy": dict(temperature=0.0, ignore_eos=True), "seeded": dict(temperature=1.0, seed=11, ignore_eos=True),
}
LOGPROB_TOLERANCE = 1e-4  # split sums differ from whole ones in the last float bits


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    prompt = encode_prompts(Path(EngineConfig().model), [PROMPT_TEXT])[0]
    assert len(prompt) > BLOCK_SIZE and len(prompt) % BLOCK_SIZE  # a full block and a partial last one travel
    return prompt


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """Builds engines on the demo model and closes the split ones' groups after the test (a process belongs to one
    group at a time)."""
    built: list[Engine] = []

    def build(method: str, role: str, tensor_parallel_size: int = 1) -> Engine:
        engine = make_engine(
            Path(EngineConfig().model), METHODS[method], role=role, block_size=BLOCK_SIZE,
            tensor_parallel_size=tensor_parallel_size,
        )
        built.append(engine)
        return engine

    yield build
    for engine in built:
        if isinstance(engine.runner, LeaderRunner):
            engine.runner.close()


def _record(outputs) -> list[tuple]:
    return [(o.offset, o.tokens, o.draft_tokens) for o in outputs]


def _logprobs(outputs) -> torch.Tensor:
    return torch.cat([torch.as_tensor(o.target.logprobs).flatten() for o in outputs])


@pytest.mark.parametrize("method", ["naive", "mtp"])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(TP, 1), (1, TP)], ids=["split-prefill", "split-decode"])
def test_a_handoff_between_differently_split_workers_emits_what_one_engine_does(
    prefill_tp: int, decode_tp: int, method: str, engines, prompt: list[int]
) -> None:
    """Each sampling in turn through the same three engines (their ranks are started once): the second request finds
    the prompt's blocks cached on every engine, and its handoff still carries what one engine emits."""
    whole = engines(method, "both")
    prefill, decode_engine = engines(method, "prefill", prefill_tp), engines(method, "decode", decode_tp)
    for sampling in SAMPLINGS.values():
        options = dict(max_tokens=NUM_TOKENS, logprobs=2, include_draft_logprobs=True, **sampling)
        alone = make_request(prompt, **options)
        expected = outputs_of(run(whole, {0: [alone]}), alone)
        request = make_request(prompt, **options)
        first, seq, payload = run_prefill(prefill, request)
        kv = next(s for s in decode(payload).meta.sections if s.name == "0.kv")
        assert kv.shape[-2] == prefill.runner.model.config.num_key_value_heads  # every head, split prefill or not
        resumed = decode_request(request, seq)
        decode_engine.add_request(resumed, payload)
        rest = outputs_of(run(decode_engine, {}), resumed)
        assert _record(first + rest) == _record(expected), sampling
        torch.testing.assert_close(_logprobs(first + rest), _logprobs(expected), atol=LOGPROB_TOLERANCE, rtol=0)
    assert decode_engine.scheduler.handoffs_imported == len(SAMPLINGS)


def test_a_split_decode_worker_keeps_the_blocks_it_holds_and_writes_the_rest(engines, prompt: list[int]) -> None:
    prefill, decode_engine = engines("mtp", "prefill"), engines("mtp", "decode", TP)
    options = dict(max_tokens=NUM_TOKENS, **SAMPLINGS["greedy"])
    warm = make_request(prompt, **options)
    expected = [t for o in outputs_of(run(decode_engine, {0: [warm]}), warm) for t in o.tokens]
    request = make_request(prompt, **options)
    first, seq, payload = run_prefill(prefill, request)
    held = (len(prompt) - 1) // BLOCK_SIZE
    resumed = decode_request(request, seq)
    decode_engine.add_request(resumed, trim(payload, held))
    rest = outputs_of(run(decode_engine, {}), resumed)
    assert [t for o in first + rest for t in o.tokens] == expected
    assert (decode_engine.scheduler.handoffs_imported, decode_engine.scheduler.handoffs_recomputed) == (1, 0)
