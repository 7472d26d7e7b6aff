"""The latency metrics one response feeds: its time to first token and duration once per request, however many
prompts it holds, and the gaps between tokens per choice, as the client of each choice sees them."""

from __future__ import annotations

import time

from services.gateway import metrics
from shared.schemas import Chunk


class ResponseLatency:
    def __init__(self, api: str, started: float) -> None:
        """`api`: the metrics' label, the endpoint's kind (chat, completion or responses)."""
        self._api = api
        self._started = started  # monotonic: when the request was received
        self._first_seen = False
        # By (prompt's request id, choice index): when the choice's last chunk came. Choices generate side by side,
        # so a gap measured across them would be the step's time divided by n.
        self._last_chunk_at: dict[tuple[str, int], float] = {}
        self._inter_token = metrics.INTER_TOKEN_LATENCY.labels(api)

    def observe(self, chunk: Chunk) -> None:
        now = time.monotonic()
        if not self._first_seen:
            self._first_seen = True
            metrics.TIME_TO_FIRST_CHUNK.labels(self._api).observe(now - self._started)
        key = (chunk.request_id, chunk.choice["index"])
        last = self._last_chunk_at.get(key)
        if last is not None and chunk.num_tokens:
            # The histogram counts tokens, so each of the chunk's tokens is one observation of the shared gap.
            per_token = (now - last) / chunk.num_tokens
            for _ in range(chunk.num_tokens):
                self._inter_token.observe(per_token)
        self._last_chunk_at[key] = now
        if chunk.final and chunk.usage is not None:
            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(chunk.usage.completion_tokens)

    def finished(self) -> None:
        """Every prompt's last chunk has come."""
        metrics.REQUEST_DURATION.labels(self._api).observe(time.monotonic() - self._started)
