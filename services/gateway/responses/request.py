"""The request body of POST /v1/responses (OpenAI's Responses API), validated.

A Responses request is a chat request in another shape: its `input` items become the conversation, its `text.format`
the output constraint, its flat function tools chat's nested ones (conversation.py builds the chat request from it).
What the Responses API offers beyond one generation (hosted tools, background runs, conversations kept by the server,
encrypted reasoning) is refused by name where a request asks for it; so is a parameter the mesh would have to
ignore.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from services.gateway.extensions import RESPONSES_REFUSED, Refused
from services.gateway.protocol import StreamOptions, check_stream_options
from services.gateway.structured_request import JsonSchemaFormat
from services.gateway.tools.tool_request import (
    FUNCTION_NAME, AllowedMode, check_choice_among, check_function_names, check_tool_choice_kind,
    tool_choice_union,
)
from shared.frames import MAX_TOP_K

OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value that adds to a generation
MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# vLLM's and specmesh's sampling and structured-output extensions, taken on a Responses request as on a chat request,
# where they are validated and honoured.
EXTENSIONS = (
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "include_draft_logprobs", "include_stop_str_in_output", "skip_special_tokens", "thinking_token_budget",
    "speculative", "cache_salt", "chat_template_kwargs", "structured_outputs",
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FunctionTool(Strict):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # As chat's (under auto a strict function's calls follow its schema, forced ones always), but on by default:
    # the Responses API's default, where chat's is off. OpenAI's strict mode also makes every property required;
    # specmesh follows the schema as written, so an optional property stays optional.
    strict: bool = True

    @field_validator("strict", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        return True if value is None else value

    def for_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class FunctionReference(BaseModel):
    """A function named among allowed_tools, flat; a whole tool definition is taken (its name read), as OpenAI's."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class ResponsesAllowedTools(Strict):
    """allowed_tools in the Responses API's flat shape: the mode and the functions beside the type. Another kind of
    tool among them is refused, as in `tools`: this server runs no hosted tools."""

    type: Literal["allowed_tools"]
    mode: AllowedMode
    tools: list[FunctionReference] = Field(min_length=1)

    def for_chat(self) -> dict[str, Any]:
        tools = [{"type": "function", "function": {"name": tool.name}} for tool in self.tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": self.mode, "tools": tools}}


ResponsesToolChoice = tool_choice_union(NamedFunctionChoice, ResponsesAllowedTools)


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following a schema (name, schema, strict beside the
    type, where chat nests them under `json_schema`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> "TextFormat":
        if self.type == "json_schema":
            JsonSchemaFormat.model_validate(
                {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
            )
            if self.schema_ is None:
                raise ValueError('a format of type "json_schema" needs a `schema`')
        elif {"name", "description", "schema_", "strict"} & self.model_fields_set:
            raise ValueError(f'name, schema, description and strict belong to type "json_schema", not {self.type!r}')
        return self

    def for_chat(self) -> dict[str, Any]:
        """Chat's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"the model has no verbosity setting (only the neutral \"medium\"), got {value!r}")
        return value


class ReasoningOptions(Strict):
    """`reasoning`: the model's thinking is its own; its effort and summaries are not settings here."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                f"the model has no reasoning-effort setting; a chat template that reads one takes it through "
                f"chat_template_kwargs, got {value!r}"
            )
        return value

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(f"reasoning is not summarized here; the reasoning item carries all of it, got {value!r}")
        return value


# Responses fields that ask for something this server does not do: any value but a neutral one is a 400.
REFUSED = {
    rule.name: rule
    for rule in (
        Refused(
            "max_tool_calls", (), "the calls of an answer are bounded by parallel_tool_calls and max_output_tokens"
        ),
        Refused("conversation", (), "the server keeps no conversations; send the items, or previous_response_id"),
        Refused("prompt", (), "the server keeps no prompt templates"),
        Refused("truncation", ("disabled",), "an input longer than the context is refused, never cut"),
        Refused("context_management", (), "the server does not compact conversations"),
    )
}


_ALL_REFUSED = REFUSED | RESPONSES_REFUSED


def check_refused(data: dict[str, Any]) -> None:
    """A 400 naming the first refused field (the Responses API's, or vLLM's extension) that asks for something."""
    for name, rule in _ALL_REFUSED.items():
        rule.check(data.get(name))


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str
    input: Any  # a string or items, read (and checked) by conversation.py, which names a bad item
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True  # a stored response is kept for previous_response_id (store.py)
    previous_response_id: str | None = Field(None, min_length=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # how long OpenAI keeps a cached prefix; the prefix cache's own here
    service_tier: str | None = None
    # Declared for the response object, which shows it; refused unless neutral by check_refused
    truncation: str | None = None
    background: bool = False  # answered at once, run on, polled (background.py)

    @field_validator("stream", "store", "parallel_tool_calls", "background", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """null asks for the default, as OpenAI's API and client take it."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tools.[{i}] has type {kind!r}: this server runs no hosted tools, only functions the client "
                    'calls ({"type": "function", "name": ..., "parameters": ...})'
                )
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[FunctionTool] | None) -> list[FunctionTool] | None:
        check_function_names([tool.name for tool in value or ()])
        return value

    _tool_choice_kind = field_validator("tool_choice", mode="before")(check_tool_choice_kind)

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: ResponsesToolChoice | None, info: ValidationInfo) -> Any:
        if isinstance(value, NamedFunctionChoice):
            chosen = [value.name]
        else:
            chosen = [tool.name for tool in value.tools] if isinstance(value, ResponsesAllowedTools) else []
        check_choice_among(value, chosen, [tool.name for tool in info.data.get("tools") or ()])
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        for item in value or ():
            if item != OUTPUT_TEXT_LOGPROBS:
                raise ValueError(
                    f"{item!r} cannot be included: this server runs no hosted tools and keeps no encrypted reasoning "
                    f"(the one value it takes is {OUTPUT_TEXT_LOGPROBS!r})"
                )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                    f"{MAX_METADATA_VALUE_CHARS}, got the key {key[:MAX_METADATA_KEY_CHARS]!r}"
                )
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        check_stream_options(value, info)
        if value is not None and (value.include_usage is not None or value.continuous_usage_stats is not None):
            raise ValueError("a Responses stream reports usage on its last event; stream_options takes only "
                             "include_obfuscation")
        return value

    @property
    def logprobs_count(self) -> int | None:
        """Top alternatives per output token, or None: no logprobs. `top_logprobs` alone asks for them too."""
        if OUTPUT_TEXT_LOGPROBS in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    @property
    def tool_choice_shown(self) -> Any:
        """`tool_choice` as the response object shows it: OpenAI's default is auto."""
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def text_shown(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        shown_format = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
        return {"format": shown_format, "verbosity": "medium"}  # the only verbosity taken


RESPONSES = "responses"  # the endpoint's name among the gateway's request bodies (request_body.py)
RESPONSES_FIELDS = frozenset(ResponsesRequest.model_fields) | frozenset(EXTENSIONS) | frozenset(_ALL_REFUSED)
