"""The gateway's view of a response's chunks (services/gateway/router.py): chunks already waiting are taken at once
and said to be waiting, so that the stream writes them to the client together (services/gateway/answer.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.errors import OpenAIError
from services.gateway.liveness import Liveness
from services.gateway.router import ResponseStream
from shared.schemas import Chunk, Usage

REQUEST = "a" * 32
OTHER = "b" * 32


def _chunk(seq: int, final: bool = False) -> Chunk:
    usage = Usage(prompt_tokens=1, completion_tokens=seq + 1, total_tokens=seq + 2) if final else None
    return Chunk(request_id=REQUEST, seq=seq, final=final, choice={"index": 0, "text": str(seq)}, usage=usage)


def test_waiting_chunks_come_at_once_and_say_so() -> None:
    async def scenario() -> list[tuple[int, bool]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        stream = ResponseStream([REQUEST], queue, idle_timeout_s=5.0, liveness=Liveness(nc=None))
        for seq in range(3):
            queue.put_nowait(_chunk(seq))
        seen = []
        for _ in range(3):
            chunk = await stream.__anext__()
            seen.append((chunk.seq, stream.has_ready))
        later = asyncio.get_running_loop().call_later(0.05, queue.put_nowait, _chunk(3, final=True))
        last = await stream.__anext__()  # none waiting: waits for it
        seen.append((last.seq, stream.has_ready))
        later.cancel()
        assert stream.finished
        return seen

    assert asyncio.run(scenario()) == [(0, True), (1, True), (2, False), (3, False)]


def test_a_failure_comes_after_the_chunks_already_in_and_finals_are_told() -> None:
    """A prompt that could not be submitted (submission.py) ends the response once what arrived before is read."""
    async def scenario() -> tuple[list[int], list[str], OpenAIError]:
        queue: asyncio.Queue[Chunk | OpenAIError] = asyncio.Queue()
        ended: list[str] = []
        stream = ResponseStream([REQUEST, OTHER], queue, 5.0, Liveness(nc=None), on_final=ended.append)
        queue.put_nowait(_chunk(0))
        queue.put_nowait(_chunk(1, final=True))
        stream.fail(OpenAIError(503, "no room", type="service_unavailable"))
        seen = [(await stream.__anext__()).seq for _ in range(2)]
        with pytest.raises(OpenAIError) as info:
            await stream.__anext__()
        return seen, ended, info.value

    seen, ended, error = asyncio.run(scenario())
    assert seen == [0, 1] and ended == [REQUEST] and error.status == 503
