"""Messages exchanged between services over NATS (JSON, via orjson).

Binary frames (worker -> detokenizer) are not here: see shared/frames.py.
"""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.frames import MAX_TOP_K


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, raw: bytes):
        return cls.model_validate(orjson.loads(raw))


class SamplingParams(_Message):
    """What the worker needs to generate. Validated here so a worker never sees nonsense."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = whole vocabulary
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int = Field(16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)  # None: no logprobs; n: the chosen token + top-n
    include_draft_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class WorkRequest(_Message):
    """gateway -> worker. `output_token_ids` holds tokens already streamed, so another worker can resume.

    A worker that must leave before a request finishes re-queues it with its progress: the tokens so far,
    the next record number and the seed it drew, so that the next worker continues the same output.
    """

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    output_token_ids: tuple[int, ...] = ()
    next_seq_no: int = Field(0, ge=0)  # seq_no of the next TARGET record: non-zero when a request resumes
    # The detokenizer that owns this request's output (set by the gateway; empty only for in-process use).
    detok_id: str = Field("", pattern=r"^[0-9a-zA-Z_-]{0,64}$")
    sampling: SamplingParams
    created: float


class DetokOpen(_Message):
    """gateway -> detokenizer: how to turn this request's frames into chunks and where to send them."""

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    reply_subject: str
    api: Literal["chat", "completion"]
    stop: tuple[str, ...] = ()
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    include_draft_logprobs: bool = False
    num_prompt_tokens: int = Field(ge=1)


class DetokReady(_Message):
    """detokenizer -> gateway, the reply to DetokOpen: this detokenizer owns the request."""

    detok_id: str = Field(pattern=r"^[0-9a-zA-Z_-]{1,64}$")


class Cancel(_Message):
    request_id: str
    reason: Literal["client_disconnected", "stop_string", "error"]


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Chunk(_Message):
    """detokenizer -> gateway: one OpenAI choice (stream shape) for one request.

    `seq` counts a request's chunks from 0 so the gateway can detect loss; the last one has `final`
    set, and a stream that ends without it is a detected failure.
    """

    request_id: str
    seq: int = Field(ge=0)
    final: bool = False
    choice: dict  # OpenAI choice in stream shape: chat {"delta", "logprobs", ...}; completion {"text", ...}
    num_tokens: int = 0  # tokens this chunk covers
    usage: Usage | None = None  # set on the final chunk
    error: str | None = None

    @model_validator(mode="after")
    def _usage_on_final(self) -> "Chunk":
        if self.final and self.usage is None and self.error is None:
            raise ValueError("the final chunk carries usage or an error")
        return self
