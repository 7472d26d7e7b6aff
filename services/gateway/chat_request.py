"""The request body of POST /v1/chat/completions, validated: the messages and how they are rendered.

Its own module because the conversation (roles, content parts, vLLM's rendering options) is chat's alone; what
both endpoints share is GenerationRequest (protocol.py).
"""

from __future__ import annotations

import json

from typing import Any

from functools import cached_property

from pydantic import Field, ValidationInfo, field_validator

from services.gateway.prediction import Prediction
from services.gateway.protocol import Body, GenerationRequest, joined_text_parts
from services.gateway.tools.call import CallIds
from services.gateway.tools.tool_request import (
    Tool, ToolChoice, ToolFields, check_tool_choice, check_tool_choice_kind, check_tools,
)
from shared.frames import MAX_TOP_K
from shared.tokenizer import TEMPLATE_VARIABLES

DEVELOPER_ROLE = "developer"  # the OpenAI SDK's current name for the system role
SYSTEM_ROLE = "system"
ASSISTANT_ROLE = "assistant"
AS_SENT = CallIds()  # call ids as the client sent them


class ChatMessage(Body):
    """One message. Any role reaches the chat template as given (`tool` and custom roles included), except
    `developer`, which is the system role under the OpenAI SDK's newer name."""

    role: str = Field(min_length=1)
    # Normalized to a string; null (or missing) only on an assistant message, one that called tools.
    content: Any = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # on `tool` messages: the call they answer
    tool_calls: list[dict] | None = None  # on an assistant message: the calls it made, rendered by the template
    # On an assistant message: its thinking, as a reasoning parser set it apart (either name; templates read the
    # second)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # OpenAI's legacy call on an assistant message: refused, as the legacy functions are (extensions.py), since the
    # template would show an assistant turn without the call it made
    function_call: Any = None

    @field_validator("function_call")
    @classmethod
    def _no_legacy_call(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "the legacy function_call is not supported; send the call in tool_calls, each "
                '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
            )
        return None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str:
        """Text parts are joined with line breaks (protocol.joined_text_parts); null, and refusal parts, only on an
        assistant message."""
        assistant = info.data.get("role") == ASSISTANT_ROLE
        if value is None:
            if not assistant:
                raise ValueError("content may be null only on an assistant message")
            return ""
        return joined_text_parts(value, refusals=assistant)

    def for_template(self, call_ids: CallIds = AS_SENT) -> dict[str, str]:
        """The message as the chat template reads it, the ids of calls as `call_ids` hands them to it."""
        message = {"role": SYSTEM_ROLE if self.role == DEVELOPER_ROLE else self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = call_ids.template_call_id(self.tool_call_id)
        if self.tool_calls:
            message["tool_calls"] = [_for_template(call, call_ids) for call in self.tool_calls]
        if (reasoning := self.reasoning_content or self.reasoning) is not None:
            message["reasoning_content"] = reasoning
        return message


def _for_template(call: dict, call_ids: CallIds) -> dict:
    """An earlier call as templates read it: OpenAI sends its arguments as a JSON string, and templates write them
    with `arguments | tojson` (Llama 3.x, Qwen2.5), which would quote that string again; vLLM hands them the
    object, and so does this. Arguments that are not JSON stay the string they are."""
    if isinstance(call.get("id"), str):
        call = {**call, "id": call_ids.template_call_id(call["id"])}
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    # Tool calling (tools/)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # null is the default, as vLLM and the Responses endpoint take it
    # vLLM's extensions for rendering the conversation.
    add_generation_prompt: bool = True  # open an assistant turn after the messages
    # vLLM extension: the tokenizer's special tokens (BOS) too, on top of those the template writes
    add_special_tokens: bool = False
    continue_final_message: bool = False  # leave the final message open, to be continued
    echo: bool = False  # the answer starts with the final message's content when that message is the assistant's
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out of the answer
    prediction: Prediction | None = None  # OpenAI's predicted outputs (prediction.py)
    # More variables for the chat template (Qwen3's enable_thinking, ...); the ones specmesh sets are refused
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        return check_tools(value)

    _tool_choice_kind = field_validator("tool_choice", mode="before")(check_tool_choice_kind)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        return check_tool_choice(value, info.data.get("tools"))

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_is_parallel(cls, value: Any) -> Any:
        return True if value is None else value

    @cached_property
    def tool_fields(self) -> ToolFields:
        return ToolFields(tools=self.tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template shows them to the model: under tool_choice "none" too, where the model
        knows them and calls none, as OpenAI's and vLLM's do (vLLM before 0.10 hid them)."""
        tools = self.tool_fields.tools
        return [tool.for_template() for tool in tools] if tools else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_template_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if taken := sorted(set(value or ()) & TEMPLATE_VARIABLES):
            raise ValueError(
                f"{', '.join(taken)}: the chat template gets these from the request itself (messages, tools, "
                "add_generation_prompt) or from the model (bos_token, eos_token); set them there"
            )
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _not_both_open(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "set add_generation_prompt to false to continue the final message"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self, call_ids: CallIds | None = None) -> list[dict[str, str]]:
        """The conversation as the chat template expects it, earlier calls' ids as the tool-call format (if any)
        hands them to it."""
        return [m.for_template(call_ids or AS_SENT) for m in self.messages]

    @property
    def echoed_text(self) -> str:
        """What the answer starts with under vLLM's chat `echo`: the final message's content, when that message is
        the assistant's (the one being continued); nothing otherwise."""
        final = self.messages[-1]
        return final.content if self.echo and final.role == ASSISTANT_ROLE else ""
