"""One accepted prompt on its way through the mesh (Generation): its request id, its sampling, whether a
detokenizer holds it, and the latency metrics its chunks feed.

Its own module because the submission (generation.py) and the answer (answer.py) both carry it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.gateway import metrics
from services.gateway.aggregate import Api
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from shared.schemas import Chunk, SamplingParams

ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}
STREAM_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
RESPONSE_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}


@dataclass
class Generation:
    """One accepted prompt on its way through the mesh, with its n choices."""

    api: Api
    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    sampling: SamplingParams
    started: float  # monotonic, for latency metrics
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    opened: bool = False  # its DetokOpen went out: from then on a detokenizer may hold it, and must be told to let go
    detok_id: str = ""  # the detokenizer that took it
    saw_first_chunk: bool = False
    last_chunk_at: float = 0.0  # monotonic

    def envelope(self, model: str, stream: bool) -> dict:
        return {
            "id": ID_PREFIX[self.api] + self.request_id,
            "object": (STREAM_OBJECT if stream else RESPONSE_OBJECT)[self.api],
            "created": self.created,
            "model": model,
        }

    def observe(self, chunk: Chunk) -> None:
        now = time.monotonic()
        if not self.saw_first_chunk:
            self.saw_first_chunk = True
            metrics.TIME_TO_FIRST_CHUNK.labels(self.api).observe(now - self.started)
        elif chunk.num_tokens:
            # The histogram counts tokens, so each of the chunk's tokens is one observation of the shared gap.
            per_token = (now - self.last_chunk_at) / chunk.num_tokens
            inter_token = metrics.INTER_TOKEN_LATENCY.labels(self.api)
            for _ in range(chunk.num_tokens):
                inter_token.observe(per_token)
        self.last_chunk_at = now
        if chunk.final and chunk.usage is not None:
            metrics.REQUEST_DURATION.labels(self.api).observe(time.monotonic() - self.started)
            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(chunk.usage.completion_tokens)
