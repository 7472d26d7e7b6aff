"""One accepted prompt on its way through the mesh (Generation): its request id, its sampling, whether a
detokenizer holds it.

Its own module because the submission (generation.py) and the answer (answer.py) both carry it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.gateway.aggregate import Api
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from shared.schemas import SamplingParams

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
    shown_special_ids: tuple[int, ...] = ()  # control tokens its text keeps (a tool-call format's tags)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    opened: bool = False  # its DetokOpen went out: from then on a detokenizer may hold it, and must be told to let go
    detok_id: str = ""  # the detokenizer that took it

    def envelope(self, model: str, stream: bool) -> dict:
        return {
            "id": ID_PREFIX[self.api] + self.request_id,
            "object": (STREAM_OBJECT if stream else RESPONSE_OBJECT)[self.api],
            "created": self.created,
            "model": model,
        }
