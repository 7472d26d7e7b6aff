"""A Responses request as the chat request it stands for: `instructions` and `input` items become chat messages, and
the Responses parameters chat's (`max_output_tokens` is `max_completion_tokens`, `text.format` is `response_format`).

The items are read as OpenAI's Responses API defines them: messages (text parts only: the model reads text),
`function_call` items (the assistant's earlier calls, joined into one assistant message with the text before them),
`function_call_output` items (a `tool` message answering the call), and `reasoning` items (the thinking before the
assistant's next message, which templates write back where they keep it).
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.protocol import shown
from services.gateway.responses.request import EXTENSIONS, ResponsesAllowedTools, ResponsesRequest

USER = "user"
ASSISTANT = "assistant"
TOOL = "tool"
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
REFUSAL_PART = "refusal"  # an assistant's refusal, given back as its text
# Chat's parameter names as a Responses request spells them, for errors the chat path reports.
RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


class InputError(ValueError):
    """An input item the conversation cannot hold; `param` names it as the API does (input.[2].content)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_body(request: ResponsesRequest, data: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request's JSON body; `data` is the raw Responses body (its extensions pass on as given), `messages`
    the conversation: the stored responses' it continues (previous_response_id), then its own input's. The
    instructions go first."""
    if request.instructions is not None:
        messages = [{"role": "system", "content": request.instructions}, *messages]
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    optional = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": [tool.for_chat() for tool in request.tools] if request.tools else None,
        "tool_choice": _tool_choice(request),
        "response_format": request.text.format.for_chat() if request.text and request.text.format else None,
        "user": request.user,
    }
    body.update({name: value for name, value in optional.items() if value is not None})
    if (count := request.logprobs_count) is not None:
        body.update(logprobs=True, top_logprobs=count)
    body.update({name: data[name] for name in EXTENSIONS if name in data})
    return body


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice == "auto" and not request.tools:  # the Responses API's default, even with nothing to call: chat's none
        return None
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, ResponsesAllowedTools):
        return choice.for_chat()
    return {"type": "function", "function": {"name": choice.name}}


def input_messages(items: Any, earlier_calls: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The chat messages `input` stands for: a string, or a list of items. A call's output must answer a call made
    before it, in these items or `earlier_calls` (the ids of the calls in the conversation it continues)."""
    if isinstance(items, str):
        return [{"role": USER, "content": items}]
    if not isinstance(items, list):
        raise InputError(f"input must be a string or a list of items, got {shown(items)}", "input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they belong to
    calls = set(earlier_calls)
    for i, item in enumerate(items):
        where = f"input.[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where} must be an object, got {shown(item)}", where)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            if message["role"] == ASSISTANT and reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
            elif reasoning:  # its turn ended without an answer after it
                messages.append(_thought(reasoning))
            reasoning = []
            messages.append(message)
        elif kind == "function_call":
            calls.add(_add_call(messages, item, where, reasoning))
            reasoning = []
        elif kind == "function_call_output":
            if reasoning:
                messages.append(_thought(reasoning))
                reasoning = []
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise InputError(f"No tool call found for function call output with call_id {call_id}.",
                                 f"{where}.call_id")
            messages.append({
                "role": TOOL, "tool_call_id": call_id,
                "content": _text(item.get("output"), f"{where}.output"),
            })
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise InputError(
                    f"{where} carries encrypted_content, which this server never writes: send the reasoning's text "
                    "as its `content`", f"{where}.encrypted_content",
                )
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text(parts, f"{where}.content"))
        elif kind == "item_reference":
            raise InputError(
                f"{where} refers to an item by id; this server finds earlier items only through "
                "previous_response_id: send the item itself", f"{where}.type",
            )
        else:
            raise InputError(
                f"{where} has type {kind!r}: this server takes messages, function_call, function_call_output and "
                "reasoning items (it runs no hosted tools)", f"{where}.type",
            )
    if reasoning:
        messages.append(_thought(reasoning))
    return messages


def _thought(reasoning: list[str]) -> dict[str, Any]:
    """Thinking with no answer after it, kept on an assistant turn of its own."""
    return {"role": ASSISTANT, "content": "", "reasoning_content": "\n".join(reasoning)}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InputError(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {shown(role)}", f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str, reasoning: list[str]) -> str:
    """An earlier call joins the assistant message it follows (the text or calls before it in the same turn); returns
    its call id."""
    call = {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == ASSISTANT and not reasoning:
        last.setdefault("tool_calls", []).append(call)
        return call["id"]
    message: dict[str, Any] = {"role": ASSISTANT, "content": "", "tool_calls": [call]}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    messages.append(message)
    return call["id"]


def check_calls_answered(messages: list[dict[str, Any]]) -> None:
    """A conversation's every call has its output in it, or the model would answer as if the call had not been
    made: OpenAI's 400, naming the first call left without one (a response that ended in calls is continued with
    their outputs). A call cut short by max_output_tokens, whose arguments are no JSON object, could not be run:
    clients drop it (LangChain's invalid_tool_calls), and it needs none."""
    answered = {m["tool_call_id"] for m in messages if m["role"] == TOOL}
    for message in messages:
        for call in message.get("tool_calls") or ():
            if call["id"] not in answered and _runnable(call["function"]["arguments"]):
                raise InputError(f"No tool output found for function call {call['id']}.", "input")


def _runnable(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def call_ids(messages: list[dict[str, Any]]) -> frozenset[str]:
    """The ids of the calls the assistant made in a conversation's chat messages."""
    return frozenset(call["id"] for m in messages for call in m.get("tool_calls") or ())


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InputError(f"{where}.{key} must be a string, got {shown(value)}", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A content field's text: a string, or text parts joined with line breaks (the model reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where} must be a string or a list of text parts, got {shown(content)}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == REFUSAL_PART and isinstance(part.get(REFUSAL_PART), str):
            texts.append(part[REFUSAL_PART])
            continue
        if kind not in TEXT_PARTS:
            raise InputError(
                f"{where}.[{j}] has type {kind!r}: this model reads text only, as parts "
                '{"type": "input_text", "text": "..."}', f"{where}.[{j}].type",
            )
        if not isinstance(part.get("text"), str):
            raise InputError(f"{where}.[{j}] needs a string \"text\", got {shown(part)}", f"{where}.[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)
