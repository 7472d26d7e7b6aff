"""Messages exchanged between services over NATS (JSON, via orjson).

Binary frames (worker -> detokenizer) are not here: see shared/frames.py.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.frames import MAX_CHOICES, MAX_TOP_K
from shared.structured import StructuredOutput

# Choices one request may ask for, whoever sent it: the worker copies the prompt for each choice, so a forged request
# with the wire format's limit (MAX_CHOICES) could take gigabytes. The gateway's --max-n may not exceed it.
MAX_REQUEST_CHOICES = 256
MAX_CACHE_SALT_CHARS = 1024  # a prefix-cache salt names a tenant; longer is a mistake, not a need
assert MAX_REQUEST_CHOICES <= MAX_CHOICES

NO_PENALTY = 0.0  # presence and frequency penalties: OpenAI's neutral value
MAX_PENALTY = 2.0  # OpenAI's and vLLM's bound on |presence_penalty| and |frequency_penalty|
NO_REPETITION_PENALTY = 1.0  # vLLM's neutral repetition_penalty (a factor)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on |logit_bias|
MAX_BAD_WORDS = 128  # bad_words per request: each a few tokens, checked against every scored row
MAX_BAD_WORD_TOKENS = 32
MAX_LAYOUT_IDS = 64  # a vocabulary's tokens of line breaks alone
# Temperatures below this are greedy, as vLLM's are: logits divided by them overflow float32 (to NaN probabilities
# below ~1e-37), and above the overflow they sample what greedy picks but for exact ties.
GREEDY_BELOW = 1e-5
# Frames and the engine's index tensors hold token ids, counts and lengths as int32: every such field stays inside it,
# so no value can overflow where it lands (the worker narrows token ids to its vocabulary, shared/request_limits.py).
MAX_INT32 = 2**31 - 1
# A resumed choice's TARGET records count on from its next_seq_no in a u32 field: half of its range leaves room.
MAX_RESUMED_SEQ_NO = 2**31
MAX_WORKER_ID = 2**32 - 1  # a frame header's worker id is a u32
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, raw: bytes):
        return cls.model_validate(orjson.loads(raw))


class SpeculationParams(_Message):
    """A request's own speculation settings: the API's `speculative` object."""

    # Drafts per step, at most the worker's own setting (the gateway refuses more); None: the worker's setting.
    num_speculative_tokens: int | None = Field(None, ge=0)
    # Report this request's drafted and accepted tokens in usage.speculative: the worker sends a DRAFT record for
    # every step that drafted, which the detokenizer counts.
    return_stats: bool = False
    # OpenAI's predicted outputs: tokens the answer is expected to mostly repeat, drafted wherever it follows them
    # (services/worker/drafting/prediction.py); they change the number of steps, never a token.
    prediction_token_ids: tuple[TokenId, ...] | None = None  # None: no prediction; (): an empty one


class ThinkingBudget(_Message):
    """vLLM's thinking_token_budget with what the worker needs to hold it: the reasoning block's tags as tokens, and
    where the block stands when the output begins (services/worker/sampling/thinking_budget.py)."""

    budget: int = Field(ge=0, le=MAX_INT32)  # tokens the block may hold; then its closing tag is forced
    open_id: TokenId
    close_id: TokenId
    starts_inside: bool  # the prompt opened the block
    layout_ids: tuple[TokenId, ...] = Field((), max_length=MAX_LAYOUT_IDS)  # line breaks that may precede it


class SamplingParams(_Message):
    """What the worker needs to generate. Validated here so a worker never sees nonsense."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0 = greedy, and so is anything below GREEDY_BELOW
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT32)  # 0 = whole vocabulary
    seed: int | None = Field(None, ge=0, lt=2**63)
    # 0: only the prompt is scored (echo with prompt logprobs), nothing generated
    max_tokens: int = Field(16, ge=0, le=MAX_INT32)
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)  # None: no logprobs; n: the chosen token + top-n
    # vLLM's logprob_token_ids: a generated token's top-n slots hold these tokens instead, in this order (then
    # `logprobs` is their count); draft and prompt logprobs keep their top-n
    logprob_token_ids: tuple[TokenId, ...] = Field((), max_length=MAX_TOP_K)
    include_draft_logprobs: bool = False
    # None: none; n: each prompt token after the first with its logprob and the top-n at the position before it
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    # What changes the target's logits before temperature (services/worker/sampling/penalties.py), and min_p.
    presence_penalty: float = Field(NO_PENALTY, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(NO_PENALTY, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(NO_REPETITION_PENALTY, gt=0.0, allow_inf_nan=False)
    # Stop tokens (EOS included unless ignore_eos) are masked before this many.
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[TokenId, float] = Field(default_factory=dict)  # token id -> added to its logit
    # vLLM's allowed_token_ids: every other token's logit is -inf (None: the whole vocabulary)
    allowed_token_ids: tuple[TokenId, ...] | None = Field(None, min_length=1)
    # vLLM's bad_words, as token ids: a word's last token is -inf wherever the output so far ends with the rest
    bad_words_token_ids: tuple[
        Annotated[tuple[TokenId, ...], Field(min_length=1, max_length=MAX_BAD_WORD_TOKENS)], ...
    ] = Field((), max_length=2 * MAX_BAD_WORDS)  # a word's tokens alone and after a space
    thinking_budget: ThinkingBudget | None = None
    speculative: SpeculationParams = SpeculationParams()
    # The output's constraint (response_format, guided_*, tool_choice): shared/structured.py
    structured: StructuredOutput | None = None

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        return 0.0 if value < GREEDY_BELOW else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        if bad := {t: b for t, b in value.items() if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS}:
            raise ValueError(f"logit_bias values must lie in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bad}")
        return value

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @model_validator(mode="after")
    def _named_logprobs_counted(self) -> "SamplingParams":
        if self.logprob_token_ids and self.logprobs != len(self.logprob_token_ids):
            raise ValueError(
                f"logprobs ({self.logprobs}) must equal the number of logprob_token_ids ({len(self.logprob_token_ids)})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty, logit_bias, allowed_token_ids, bad_words, thinking budget or min_tokens changes this
        request's logits."""
        return (
            self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
            or self.thinking_budget is not None
            or self.presence_penalty != NO_PENALTY
            or self.frequency_penalty != NO_PENALTY
            or self.repetition_penalty != NO_REPETITION_PENALTY
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )


class ChoiceProgress(_Message):
    """Where one unfinished choice of a handed-back request stands."""

    index: int = Field(ge=0)
    output_token_ids: tuple[TokenId, ...] = ()  # tokens already streamed
    next_seq_no: int = Field(0, ge=0, le=MAX_RESUMED_SEQ_NO)  # seq_no of the choice's next TARGET record


MAX_DELIVERY_ID_CHARS = 64  # a stream name and a sequence number
MAX_SHOWN_SPECIAL_IDS = 16  # a tool-call format has a few tags


class HandoffTicket(BaseModel):
    """On a request a prefill worker hands to a decode worker (services/worker/handoff/): the transfer that carried
    its KV blocks there. One that failed leaves the decode worker nothing whole to take: it drops what arrived and
    recomputes the blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transfer_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    from_worker: int = Field(ge=0, le=MAX_WORKER_ID)
    # The work-queue delivery the prefill worker held (takeover.delivery_id): this handoff supersedes it, so that
    # one redelivered because the prefill worker died before acknowledging it is not taken for a lost request.
    superseded: str | None = Field(None, max_length=MAX_DELIVERY_ID_CHARS)


class WorkRequest(_Message):
    """gateway -> worker: one prompt and its `n` choices, run on one worker so that they share its prefill.

    A worker that must leave before a request finishes re-queues it with its progress: each unfinished choice's
    tokens so far and next record number (`progress`), and the seed it drew, so that the next worker continues the
    same output. Choice i samples with shared.seeds.choice_seed(sampling.seed, i).
    """

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    prompt_token_ids: tuple[TokenId, ...] = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_REQUEST_CHOICES)
    progress: tuple[ChoiceProgress, ...] = ()  # a resumed request's unfinished choices; empty: all n from the start
    # The detokenizer that owns this request's output (set by the gateway; empty only for in-process use).
    detok_id: str = Field("", pattern=r"^[0-9a-zA-Z_-]{0,64}$")
    sampling: SamplingParams
    created: float
    # Names this request's cached blocks apart: only requests with the same salt share them (vLLM's cache_salt)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    handoff: HandoffTicket | None = None  # set by the prefill worker that hands it to a decode worker

    @model_validator(mode="after")
    def _progress_names_choices(self) -> "WorkRequest":
        indices = [p.index for p in self.progress]
        if len(set(indices)) != len(indices) or any(i >= self.n for i in indices):
            raise ValueError(f"progress must name distinct choices below n={self.n}, got {indices}")
        return self

    def choices(self) -> tuple[ChoiceProgress, ...]:
        """The choices to run and where each starts."""
        return self.progress or tuple(ChoiceProgress(index=i) for i in range(self.n))

    @property
    def num_choices(self) -> int:
        """How many choices are to run: all n, or a resumed request's unfinished ones."""
        return len(self.progress) or self.n


class RequestAddress(BaseModel):
    """Whose a work-queue message is: read from one that fails WorkRequest's validation, so that the worker can still
    end the request at its detokenizer."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    detok_id: str = Field(pattern=r"^[0-9a-zA-Z_-]{1,64}$")


class DetokOpen(_Message):
    """gateway -> detokenizer: how to turn this request's frames into chunks and where to send them."""

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    reply_subject: str
    api: Literal["chat", "completion"]
    stop: tuple[str, ...] = ()
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    include_draft_logprobs: bool = False
    speculative_stats: bool = False  # usage.speculative: count the request's DRAFT records
    num_prompt_tokens: int = Field(ge=1)
    n: int = Field(1, ge=1, le=MAX_REQUEST_CHOICES)  # choices, each assembled on its own (records carry the choice index)
    return_token_ids: bool = False  # each chunk's choice lists the token ids it covers (vLLM's `token_ids`)
    tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' entries) comes first
    # The echoed prompt shows its special tokens' text: a prompt sent as token ids is echoed as sent, special tokens
    # included (a text prompt is echoed without those the tokenizer added).
    echo_special_tokens: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)  # vLLM's prompt_logprobs: top-n per prompt token
    prompt_token_ids: tuple[int, ...] = ()  # given exactly when echo or prompt_logprobs needs the prompt
    # The request's prediction, to count what its answer used; None: it has none (an empty one still counts zeros)
    prediction_token_ids: tuple[int, ...] | None = None
    # Special tokens whose text the output keeps, where generated text leaves the others out: the tags of a
    # tool-call format that writes them as control tokens (Mistral's [TOOL_CALLS]), on a request read for calls
    shown_special_ids: tuple[TokenId, ...] = Field((), max_length=MAX_SHOWN_SPECIAL_IDS)
    # vLLM's include_stop_str_in_output: the stop string, or the stop token's text, ends the output instead of
    # being cut from it
    include_stop_str_in_output: bool = False
    # vLLM's skip_special_tokens: false shows every generated special token's text, with its logprobs entry
    skip_special_tokens: bool = True
    # vLLM's min_tokens: no stop string may end in the text of the first min_tokens tokens (the worker holds back
    # stop tokens and EOS until then)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)

    def to_bytes(self) -> bytes:
        """Without the fields at their defaults: a detokenizer of an earlier version, which refuses fields it does
        not know, still reads a newer gateway's opening of a request that uses none of the newer options (a rolling
        upgrade has both for a while)."""
        return orjson.dumps(self.model_dump(mode="json", exclude_defaults=True))

    @model_validator(mode="after")
    def _prompt_when_needed(self) -> "DetokOpen":
        needed = self.echo or self.prompt_logprobs is not None
        if needed and len(self.prompt_token_ids) != self.num_prompt_tokens:
            raise ValueError(
                f"echo and prompt_logprobs need the {self.num_prompt_tokens} prompt token ids, "
                f"got {len(self.prompt_token_ids)}"
            )
        if not needed and self.prompt_token_ids:
            raise ValueError("prompt_token_ids are sent only with echo or prompt_logprobs")
        return self


class DetokReady(_Message):
    """detokenizer -> gateway, the reply to DetokOpen: this detokenizer owns the request."""

    detok_id: str = Field(pattern=r"^[0-9a-zA-Z_-]{1,64}$")


class WorkerState(_Message):
    """worker -> gateways and workers, every WORKER_STATE_PERIOD_S (services/worker/routing.py): that it is alive, what
    its prefix cache's block names are made of, and how busy it is. Gateways route by it; workers adopt the routed
    requests of one whose state stopped coming."""

    worker_id: int = Field(ge=0, le=MAX_WORKER_ID)
    epoch: int = Field(ge=0)  # drawn at start: a new one means the worker's cache started empty
    revision: str = Field(max_length=64)  # the model revision its block names start from (shared/prefix_hash.py)
    block_size: int = Field(ge=1)
    caching: bool
    max_num_seqs: int = Field(ge=1)
    in_flight: int = Field(ge=0)  # sequences it holds (running or waiting), one per choice
    routed_backlog: int = Field(ge=0)  # routed requests waiting in its own queue
    draining: bool = False  # takes no more requests; gone once its last state says so
    role: Literal["both", "prefill", "decode"] = "both"  # prefill/decode disaggregation (services/worker/handoff/)


class ProgressQuery(_Message):
    """worker -> detokenizer: this worker takes over a request another worker lost; how far did its output get?"""

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    worker_id: int = Field(ge=0, le=MAX_WORKER_ID)  # its frames' worker id: from now on the only one taken
    # A decode worker taking a request its prefill worker (this id) handed it (services/worker/handoff/): planned, so
    # not a migration, neither counted nor bounded by --max-migrations, when that worker still owns the request
    handoff_from: int | None = Field(None, ge=0, le=MAX_WORKER_ID)
    delivery: str | None = Field(None, max_length=MAX_DELIVERY_ID_CHARS)  # the message it holds (takeover.delivery_id)
    superseded: str | None = Field(None, max_length=MAX_DELIVERY_ID_CHARS)  # a handoff's HandoffTicket.superseded


class TakeOver(StrEnum):
    """What the owning detokenizer tells a worker that asks to take a request over."""

    CONTINUE = "continue"  # continue each unfinished choice from its progress
    CLOSED = "closed"  # the request is over (finished, cancelled, or never opened here): drop it
    REFUSED = "refused"  # it lost its worker too often (--max-migrations): the detokenizer ended it with an error


class ProgressReport(_Message):
    """detokenizer -> worker, the reply to ProgressQuery."""

    outcome: TakeOver
    progress: tuple[ChoiceProgress, ...] = ()  # with CONTINUE: every unfinished choice, as its client has seen it
    migrations: int = Field(0, ge=0)  # times the request has been taken over, this one included


class HeldQuery(_Message):
    """gateway -> detokenizer: which of these requests, silent for a while, do you still hold? And detokenizer ->
    gateway: which of these requests do you still wait for?"""

    request_ids: tuple[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")], ...] = Field(min_length=1)


class HeldReport(_Message):
    """The reply to HeldQuery: those of the requests the one asked holds."""

    request_ids: tuple[str, ...] = ()


class Cancel(_Message):
    request_id: str
    reason: Literal["client_disconnected", "stop_string", "error", "taken_over"]
    choice: int | None = Field(None, ge=0)  # None: every choice of the request; else that one only
    # taken_over: this worker lost the request to another (it stalled past ack_wait) and still runs it; only it
    # drops the request, and without settling its message, which is the new owner's now
    worker_id: int | None = Field(None, ge=0, le=MAX_WORKER_ID)


class SpeculativeUsage(_Message):
    """A request's own speculation summary, `usage.speculative` (with `speculative.return_stats`), in the words of
    vLLM's per-request spec-decode metrics. Position i is the i-th draft of a step (0-based)."""

    num_spec_steps: int = Field(ge=0)  # steps that verified at least one draft
    num_draft_tokens: int = Field(ge=0)
    num_accepted_draft_tokens: int = Field(ge=0)
    mean_acceptance_length: float  # tokens per speculative step: 1 + accepted / steps (1.0 when none)
    draft_acceptance_rate: float  # accepted / drafted (0.0 when nothing was drafted)
    num_draft_tokens_per_position: tuple[int, ...]  # drafts made at position i
    num_accepted_tokens_per_position: tuple[int, ...]  # of those, the accepted ones
    acceptance_rate_per_position: tuple[float, ...]  # their ratio
    acceptance_histogram: tuple[int, ...]  # index j: steps that accepted exactly j drafts


class PromptTokensDetails(_Message):
    cached_tokens: int = Field(0, ge=0)  # prompt tokens whose cache the worker found computed (prefix caching)


class CompletionTokensDetails(_Message):
    """OpenAI's, for a request with a prediction (shared/prediction.py)."""

    accepted_prediction_tokens: int = Field(ge=0)  # the prediction's tokens the answer has
    rejected_prediction_tokens: int = Field(ge=0)  # the others

    def __add__(self, other: "CompletionTokensDetails") -> "CompletionTokensDetails":
        return CompletionTokensDetails(
            accepted_prediction_tokens=self.accepted_prediction_tokens + other.accepted_prediction_tokens,
            rejected_prediction_tokens=self.rejected_prediction_tokens + other.rejected_prediction_tokens,
        )


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = None  # only for a request with a prediction
    speculative: SpeculativeUsage | None = None  # only when the request asked (speculative.return_stats)


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
    request_error: bool = False  # the error is the request's own (its constraint failed at run time): a 400, not a 500

    @model_validator(mode="after")
    def _usage_on_final(self) -> "Chunk":
        if self.final and self.usage is None and self.error is None:
            raise ValueError("the final chunk carries usage or an error")
        return self
