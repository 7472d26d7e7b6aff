"""The gateway's latency metrics per response (services/gateway/latency.py), read from prometheus_client's registry:
one time to first token and one duration per request however many prompts it holds, and the gaps between tokens
taken per choice, not across choices that generate side by side."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.gateway.latency import ResponseLatency
from shared.schemas import Chunk, Usage

API = "completion"
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


def _count(name: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_count", {"api": API}) or 0.0


def _chunk(request_id: str, index: int, seq: int, final: bool = False) -> Chunk:
    return Chunk(
        request_id=request_id, seq=seq, final=final, choice={"index": index, "text": "x"}, num_tokens=1,
        usage=USAGE if final else None,
    )


def test_one_first_token_and_duration_per_response_and_gaps_per_choice() -> None:
    names = ("specmesh_gateway_time_to_first_token_seconds", "specmesh_gateway_request_duration_seconds",
             "specmesh_gateway_inter_token_latency_seconds")
    before = [_count(name) for name in names]
    latency = ResponseLatency(API, started=0.0)
    # Two prompts of two choices each, three one-token chunks a choice, interleaved as they arrive.
    for seq in range(3):
        for prompt in ("a" * 32, "b" * 32):
            for index in (0, 1):
                latency.observe(_chunk(prompt, index, seq, final=seq == 2))
    latency.finished()
    first, duration, gaps = (_count(name) - b for name, b in zip(names, before))
    assert (first, duration) == (1, 1)
    assert gaps == 4 * 2  # each of the four choices: two gaps between its three chunks
