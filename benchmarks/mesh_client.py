"""The benchmarks' client of the mesh: streamed completions kept `streams` at a time, with when each chunk arrived,
and the inter-token gaps read from them (benchmarks/speculation.py's docstring defines them).

A light aiohttp SSE client, not the openai client, whose parsing would take CPU time from the mesh on a small
machine.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson

from services.detokenizer.incremental import IncrementalDecoder, TokenTable

HTTP_TIMEOUT_S = 600.0


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    text: str
    arrivals: list[tuple[float, int]]  # per SSE chunk: (perf_counter when it arrived, characters of text so far)


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, dict]]:
    """Each SSE event of a streamed completion with when it arrived (perf_counter); an error event raises."""
    response.raise_for_status()
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        at = time.perf_counter()
        event = orjson.loads(line[len(b"data: "):])
        if "error" in event:
            raise RuntimeError(f"the mesh failed a request: {event['error']}")
        yield at, event


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> Stream:
    pieces: list[str] = []
    arrivals: list[tuple[float, int]] = []
    length = 0
    async with session.post(url, json=body) as response:
        async for at, event in sse_events(response):
            piece = event["choices"][0]["text"]
            pieces.append(piece)
            length += len(piece)
            arrivals.append((at, length))
    return Stream("".join(pieces), arrivals)


async def mesh_streams(
    base_url: str, model: str, prompts: list[list[int]], streams: int, max_tokens: int, temperature: float = 0.0
):
    """Every prompt streamed, `streams` at a time; returns the streams and the wall time. Sampled requests get seed
    i, the i-th prompt's, so that an in-process engine can draw the same tokens (shared/seeds.py)."""
    limit = asyncio.Semaphore(streams)
    url = f"{base_url}/completions"
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int, ids: list[int]) -> Stream:
            async with limit:
                body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
                        "stream": True, "ignore_eos": True}
                if temperature > 0:
                    body["seed"] = i
                return await stream_completion(session, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        return results, time.perf_counter() - started


def token_ends(table: TokenTable, tokens: list[int]) -> tuple[str, list[int]]:
    """The text of the tokens as the detokenizer renders it, and where each token's text ends in it."""
    decoded = IncrementalDecoder(table).step(tokens, final=True)
    return decoded.text, [end for _, end in decoded.spans]


def inter_token_gaps(stream: Stream, ends: list[int]) -> list[float]:
    """Per token after the first chunk: its chunk's gap to the previous chunk that brought tokens, divided by the
    tokens its chunk brought (the module docstring's definition)."""
    gaps: list[float] = []
    seen, previous = 0, None
    for at, length in stream.arrivals:
        arrived = bisect.bisect_right(ends, length)
        if arrived == seen:
            continue
        if previous is not None:
            gaps += [(at - previous) / (arrived - seen)] * (arrived - seen)
        seen, previous = arrived, at
    return gaps


def first_chunk_tokens(stream: Stream, ends: list[int]) -> int:
    """Tokens the stream's first chunk brought (found from its text, as inter_token_gaps does)."""
    return bisect.bisect_right(ends, stream.arrivals[0][1])
