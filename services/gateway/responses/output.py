"""A response's output items, built from its chat answer as it streams: the reasoning item, the message with its
output text, the function calls, each opened when its first piece arrives and closed when the next item starts or
the answer ends, with the Responses API's streaming events on the way (`response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`).

It reads the chat stream's choices once the reasoning parser and the tool-call reader have split them (the same
readers a chat answer goes through), so a response and a chat completion of one generation say the same. A whole
(non-streaming) response is the same items with the events left unsent.

Logprobs (and specmesh's draft_logprobs) go with the output text: a chunk's entries go out with the text it carries,
or with the next text where it carried none (a piece held back in case a stop string or tag starts there), and the
last of them with the text's end. The entries of a chunk that carried only reasoning or a call are not the answer
text's, and are not shown; where one chunk carries reasoning, or a call, beside the text, the text's are the entries
at its end (or its start) whose tokens' bytes make up the text.
"""

from __future__ import annotations

import uuid
import time
from typing import Any

from shared.schemas import Usage

LENGTH = "length"  # chat's finish reason when the budget ran out
MAX_OUTPUT_TOKENS = "max_output_tokens"  # the Responses API's name for it
LOGPROBS = "logprobs"
LOGPROB_KEYS = (LOGPROBS, "draft_logprobs")

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_error(error: dict[str, Any]) -> dict[str, Any]:
    """An API error body's `error` as a response object carries it: OpenAI's `code` (the type where there is none)
    and `message`."""
    return {"code": error.get("code") or error.get("type"), "message": error.get("message")}


class ResponseOutput:
    """One response: its envelope (`shown`: the request's parameters as the response object echoes them), its
    output items, and the events that report them."""

    def __init__(
        self, response_id: str, created_at: int, shown: dict[str, Any], with_draft_logprobs: bool = False,
    ) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.shown = shown
        self.with_draft_logprobs = with_draft_logprobs
        self.output: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}  # output index by item id
        self.status = "in_progress"
        self.completed_at: int | None = None  # Unix seconds, once completed
        self.incomplete_details: dict[str, str] | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, int] = {}  # chat's tool-call index -> output index
        self._held: dict[str, list] = {key: [] for key in LOGPROB_KEYS}  # entries waiting for output text

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            **self.shown,
            "output": self.output,
            "usage": self.usage,
        }

    def started(self) -> list[Event]:
        return [self._event("response.created", response=_copy(self.snapshot())), *self.progressing()]

    def queued(self) -> list[Event]:
        """A background response's first events: it exists, and waits to run."""
        return [self._event("response.created", response=_copy(self.snapshot())),
                self._event("response.queued", response=_copy(self.snapshot()))]

    def progressing(self) -> list[Event]:
        self.status = "in_progress"
        return [self._event("response.in_progress", response=_copy(self.snapshot()))]

    def feed(self, choice: dict[str, Any]) -> list[Event]:
        """The events of one chat stream choice, in the order its text had them: the rest of the call already open
        (its arguments go out as they are written), then its delta's reasoning, content, and new calls."""
        delta = choice.get("delta") or {}
        events: list[Event] = []
        for key in LOGPROB_KEYS:
            self._held[key] += (choice.get(key) or {}).get("content") or []
        reasoning, content, calls = delta.get("reasoning"), delta.get("content"), delta.get("tool_calls") or []
        continuing = self._continuing(calls)
        calls = calls[len(continuing) :]
        for call in continuing:  # before the text after it closes its item
            events += self._call(call)
        after_reasoning = bool(reasoning) or (self._open is not None and self._open["type"] == "reasoning")
        if reasoning:
            events += self._reasoning(reasoning)
        if content:
            if after_reasoning or (continuing and not calls):  # the reasoning's, or the call's, tokens come first
                self._held[LOGPROBS] = _covering(self._held[LOGPROBS], content, from_end=True)
            if calls:  # the new calls' tokens come after the text
                self._held[LOGPROBS] = _covering(self._held[LOGPROBS], content, from_end=False)
            events += self._text(content)
        elif reasoning or calls or continuing:
            self._held = {key: [] for key in LOGPROB_KEYS}
        for call in calls:
            events += self._call(call)
        return events

    def _continuing(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The entries a chunk opens with that carry the rest of the function call already open."""
        open_call = self._open if self._open is not None and self._open["type"] == "function_call" else None
        taken = 0
        while (taken < len(calls) and open_call is not None and "id" not in calls[taken]
               and self._calls.get(calls[taken]["index"]) == self._index[open_call["id"]]):
            taken += 1
        return calls[:taken]

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[Event]:
        """Closes the open item and the response: `response.completed`, or `response.incomplete` when the budget ran
        out (max_output_tokens)."""
        incomplete = finish_reason == LENGTH
        if self._open is not None and self._open["type"] == "message":
            # Tokens whose text a stop string cut, or a final chunk that carried none: the answer text's all the same
            self._text_part_takes_held(self._open["content"][0])
        events = self._close("incomplete" if incomplete else "completed")
        self.usage = usage
        if incomplete:
            self.status = "incomplete"
            self.incomplete_details = {"reason": MAX_OUTPUT_TOKENS}
            return events + [self._event("response.incomplete", response=self.snapshot())]
        self.status = "completed"
        self.completed_at = int(time.time())
        return events + [self._event("response.completed", response=self.snapshot())]

    def fail(self, error: dict[str, Any]) -> list[Event]:
        """`response.failed`, with the error OpenAI's way (`code`, `message`)."""
        events = self._close("incomplete")
        self.status = "failed"
        self.error = response_error(error)
        return events + [self._event("response.failed", response=self.snapshot())]

    def cancel(self) -> list[Event]:
        """Closes the open item, cancelled midway; the Responses API has no event for the response's own end."""
        events = self._close("incomplete")
        self.status = "cancelled"
        return events

    def _reasoning(self, text: str) -> list[Event]:
        events = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self._close("completed")
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            events += self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"].append(dict(part))
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]

    def _text(self, text: str) -> list[Event]:
        events = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._close("completed")
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            events += self._add(item)
            part = self._empty_text()
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"].append(self._empty_text())
        part = item["content"][0]
        part["text"] += text
        delta = {"delta": text, "logprobs": [], **self._text_part_takes_held(part)}
        return events + [self._event("response.output_text.delta", **self._where(), content_index=0, **delta)]

    def _text_part_takes_held(self, part: dict[str, Any]) -> dict[str, list]:
        """The held entries go to the output text part (where it shows them); returns them by key."""
        taken = {}
        for key in LOGPROB_KEYS:
            entries, self._held[key] = self._held[key], []
            if key in part:
                part[key] += entries
                taken[key] = entries
        return taken

    def _empty_text(self) -> dict[str, Any]:
        # OpenAI's part always lists logprobs: empty unless asked for
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        if self.with_draft_logprobs:
            part["draft_logprobs"] = []
        return part

    def _call(self, entry: dict[str, Any]) -> list[Event]:
        events = []
        function = entry.get("function") or {}
        if "id" in entry:  # a new call: its id and name come first
            events += self._close("completed")
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": entry["id"],
                    "name": function.get("name", ""), "arguments": ""}
            events += self._add(item)
            self._calls[entry["index"]] = self._index[item["id"]]
        if arguments := function.get("arguments"):
            item = self.output[self._calls[entry["index"]]]
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(item),
                                      delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self._index[item["id"]] = len(self.output)
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def _close(self, status: str) -> list[Event]:
        """The open item's closing events, with its status."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        events = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            events += [
                self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                self._event("response.content_part.done", **where, content_index=0, part=dict(part)),
            ]
        elif item["type"] == "message":
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                            logprobs=part.get("logprobs", [])),
                self._event("response.content_part.done", **where, content_index=0, part=_copy(part)),
            ]
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        return events + [self._event("response.output_item.done", output_index=where["output_index"],
                                     item=_copy(item))]

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = item or self._open
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _covering(entries: list[dict[str, Any]], text: str, from_end: bool) -> list[dict[str, Any]]:
    """The entries at the end (or the start) of `entries` whose tokens' bytes cover `text`: a chunk's tokens of the
    answer text, where the chunk also carried reasoning before it or a call after it."""
    need, have, picked = len(text.encode()), 0, []
    for entry in reversed(entries) if from_end else entries:
        if have >= need:
            break
        picked.append(entry)
        have += len(entry.get("bytes") or entry["token"].encode())
    return picked[::-1] if from_end else picked


def _copy(value: Any) -> Any:
    """A copy of an item as it stands: later pieces change the item, never an event already made."""
    if isinstance(value, dict):
        return {key: _copy(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def responses_usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    """Chat's usage under the Responses API's names; specmesh's `speculative` summary when the request asked."""
    body: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }
    if usage.speculative is not None:
        body["speculative"] = usage.speculative.model_dump()
    return body
