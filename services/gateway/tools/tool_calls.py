"""Tool calls out of a chat answer, in OpenAI's shapes: a whole message's `tool_calls`, or a stream's deltas.

Streamed, each call goes out as soon as its parts are known, whatever the chunking: its index, id and name once its
name is written, then its arguments: a Hermes, Qwen3-Coder or Mistral v11 call's as they are written (made compact
as the whole answer's are, arguments.py), the others' when the answer ends; text outside calls streams as content,
holding back only what could be the start of a call. One chunk may carry several tokens or several whole calls (speculative decoding
accepts many tokens a step): each call gets its own entry, by index, in order.
"""

from __future__ import annotations

from typing import Any

from services.gateway.tags import opens_with, partial_suffix
from services.gateway.tools.call import LAYOUT, separated
from services.gateway.tools.formats import OpenedCall, ToolFormat

TOOL_CALLS_FINISH = "tool_calls"


def message_with_calls(
    message: dict, finish_reason: str | None, format: ToolFormat, parallel: bool = True, named: bool = False
) -> str | None:
    """Moves the calls in a whole answer's content into message["tool_calls"]; returns the finish reason
    (`tool_calls` when the answer called tools and stopped on its own, unless tool_choice `named` the function: then
    `stop`, as OpenAI and vLLM answer). Without `parallel` (parallel_tool_calls false) only the first call is kept:
    under tool_choice auto nothing constrains the answer to one."""
    content, calls = format.split(message.get("content") or "")
    if not calls:
        return finish_reason
    calls = calls if parallel else calls[:1]
    message["content"] = content or None
    message["tool_calls"] = [
        {"id": format.new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    return _finish(finish_reason, named)


def _finish(finish_reason: str | None, named: bool) -> str | None:
    return TOOL_CALLS_FINISH if finish_reason == "stop" and not named else finish_reason


class ToolCallStream:
    """One streamed choice's text, split into content and tool-call deltas."""

    def __init__(self, format: ToolFormat) -> None:
        self.format = format
        self._buffer = ""
        self._inside = False  # within a call's block
        self._calls = 0  # calls started
        self._after_call = False  # nothing but whitespace since the last call (tools/formats.TextAroundCalls)
        self._held_space = ""  # whitespace at the end of the text so far: layout if a call follows it
        self._sent = ""  # the last character of content sent, to tell whether text after a call needs separating
        self._ids: list[str] = []
        self._arguments: OpenedCall | None = None  # the open call's, once its name went out, until it closes
        self._pieces: str | None = None  # Mistral from v11: the text after the first tag, once it calls
        self._held = ""  # Llama 3 JSON: the answer from where a call may begin
        # Hermes: whether the answer is in its leading reasoning block (None: not known yet), where tags are text
        self._reasoning: bool | None = None

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to stream, tool_calls delta entries) for the next piece of the answer's text."""
        if self.format.streams_pieces:
            return self._feed_pieces(text, final)
        if self.format.streams_whole:
            return self._feed_whole(text, final)
        return self._feed_blocks(text, final)

    def finish_reason(self, finish_reason: str | None, named: bool = False) -> str | None:
        return _finish(finish_reason, named) if self.called else finish_reason

    def _feed_blocks(self, text: str, final: bool) -> tuple[str, list[dict]]:
        fmt = self.format
        self._buffer += text
        reasoning = self._take_reasoning(final)
        if reasoning is None or self._reasoning:  # not known yet, or all of it reasoning so far
            return reasoning or "", []
        content, deltas = [reasoning], []
        self._sent = (self._sent + reasoning)[-1:]
        while True:
            if not self._inside:
                start = self._buffer.find(fmt.open_tag)
                if start < 0:
                    if final and self.called and self._after_call and fmt.dangling_tag(self._buffer):
                        self._buffer = ""  # as Hermes.split drops it from a whole answer
                    keep = 0 if final else partial_suffix(self._buffer, fmt.open_tag)
                    content.append(self._text(self._buffer[: len(self._buffer) - keep], final))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._text(self._buffer[:start], final=False))
                self._buffer = self._buffer[start + len(fmt.open_tag) :]
                self._inside, self._arguments = True, None
                continue
            end = self._buffer.find(fmt.close_tag)
            if end < 0:
                if self._arguments is None and (opened := fmt.opened_call(self._buffer)) is not None:
                    deltas.append(self._open_call(opened.name))
                    self._arguments = opened
                if self._arguments is not None:
                    readable = len(self._buffer) - (0 if final else partial_suffix(self._buffer, fmt.close_tag))
                    deltas += self._arguments_delta(self._arguments.read(self._buffer[:readable]))
                if final:  # cut short (max_tokens): a named call keeps the arguments written so far
                    partial = fmt.partial_call(self._buffer)
                    if partial is None:
                        # After calls, the start of a next one cut before its name is dropped.
                        content.append(self._text("" if self.called else fmt.open_tag + self._buffer, final=True))
                    else:
                        self._called()
                        if self._arguments is None:  # its name did not go out yet
                            deltas.append(self._open_call(partial.name))
                        deltas += self._arguments_delta(self._rest_of(partial.arguments))
                    self._buffer, self._inside = "", False
                break
            block, self._buffer = self._buffer[:end], self._buffer[end + len(fmt.close_tag) :]
            self._inside = False
            call = fmt.parse_block(block) or fmt.partial_call(block)  # as a whole answer reads it
            if call is None:
                content.append(self._text(fmt.open_tag + block + fmt.close_tag, final=False))
                continue
            self._called()
            if self._arguments is None:  # its name did not go out yet
                deltas.append(self._open_call(call.name))
            deltas += self._arguments_delta(self._rest_of(call.arguments))
        return "".join(content), deltas

    def _rest_of(self, arguments: str) -> str:
        """A call's arguments as the whole answer reads them, less what went out as they were written (a prefix of
        them: arguments.CompactJson); the call is over."""
        reader, self._arguments = self._arguments, None
        sent = reader.sent if reader is not None else ""
        if not arguments.startswith(sent):
            raise AssertionError(f"streamed arguments {sent!r} are not the start of the call's {arguments!r}")
        return arguments[len(sent) :]

    def _arguments_delta(self, arguments: str) -> list[dict]:
        return [{"index": self._calls - 1, "function": {"arguments": arguments}}] if arguments else []

    def _text(self, piece: str, final: bool) -> str:
        """What goes out of a piece of text outside calls: the line breaks after a call are dropped, and those it
        ends with are held until what follows tells (dropped before a call, sent before more text or at the end)."""
        text, self._held_space = self._held_space + piece, ""
        if self._after_call:
            text = separated(self._sent, text.lstrip(LAYOUT))
            self._after_call = not text
        if not final:
            body = text.rstrip(LAYOUT)
            self._held_space, text = text[len(body) :], body
        self._sent = (self._sent + text)[-1:]
        return text

    def _called(self) -> None:
        """A block turned out to be a call: the whitespace before it was layout."""
        self._held_space = ""
        self._after_call = True

    def _take_reasoning(self, final: bool) -> str | None:
        """The buffer's part of a leading reasoning block, streamed as content, tags included, and never read for
        calls (as Hermes.split reads a whole answer); None while it is not known yet whether the answer opens with
        one."""
        fmt = self.format
        if self._reasoning is None:  # a format without reasoning tags reads them as text
            self._reasoning = fmt.think_open is not None and opens_with(self._buffer, fmt.think_open, final)
            if self._reasoning is None:
                return None
        if not self._reasoning:
            return ""
        end = self._buffer.find(fmt.think_close)
        if end < 0:
            keep = 0 if final else partial_suffix(self._buffer, fmt.think_close)
            cut = len(self._buffer) - keep
        else:
            cut = end + len(fmt.think_close)
            self._reasoning = False
        reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return reasoning

    def _open_call(self, name: str) -> dict:
        self._calls += 1
        self._ids.append(self.format.new_call_id())
        return {"index": self._calls - 1, "id": self._ids[-1], "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _feed_pieces(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Mistral: as _feed_whole until the first call after the tag opens (its name and the `{` of its arguments
        written, from v11); from there each piece between tags is a call whose name and arguments go out as they
        are written, or (after the calls) nothing, as the whole answer reads it (Mistral.split)."""
        tag = self.format.open_tag
        content = ""
        if self._pieces is None:
            held = self._held + text
            start = held.find(tag)
            if start < 0 or self.format.opened_call(_first_piece(held[start + len(tag) :], tag)) is None:
                return self._feed_whole(text, final)
            content, _ = self._feed_whole(text, final=False)  # the text before the tag, as it streams
            start = self._held.find(tag)
            self._pieces, self._held, text = self._held[start + len(tag) :], "", ""
        self._pieces += text
        deltas: list[dict] = []
        while True:
            end = self._pieces.find(tag)
            readable = end if end >= 0 else len(self._pieces) - (0 if final else partial_suffix(self._pieces, tag))
            piece = self._pieces[:readable]
            if self._arguments is None and (opened := self.format.opened_call(piece)) is not None:
                deltas.append(self._open_call(opened.name))
                self._arguments = opened
            if self._arguments is not None:
                deltas += self._arguments_delta(self._arguments.read(piece))
            if end < 0 and not final:
                return content, deltas
            # The piece is over: its call as the whole answer reads it (the one it opened: what opened on part of
            # the piece opens on all of it), or the calls of an array after the calls, or nothing
            for call in self.format.later_calls(piece):
                if self._arguments is None:
                    deltas.append(self._open_call(call.name))
                deltas += self._arguments_delta(self._rest_of(call.arguments))
            if end < 0:
                self._pieces = ""
                return content, deltas
            self._pieces = self._pieces[end + len(tag) :]

    def _feed_whole(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Llama 3 JSON and Mistral: text streams as content up to where a call may begin (format.content_until);
        from there the answer is held to its end, then read as a whole answer is: calls and the text before them,
        or all content."""
        self._held += text
        if final:
            held, self._held = self._held, ""
            content, calls = self.format.split(held)
            if not calls:
                return held, []
            deltas = []
            for call in calls:
                deltas.append(self._open_call(call.name))
                deltas.append({"index": self._calls - 1, "function": {"arguments": call.arguments}})
            return content, deltas
        cut = self.format.content_until(self._held)
        streamed, self._held = self._held[:cut], self._held[cut:]
        return streamed, []


def _first_piece(after_tag: str, tag: str) -> str:
    """The text after the first tag up to the next: what decides whether the answer calls."""
    end = after_tag.find(tag)
    return after_tag if end < 0 else after_tag[:end]


def stream_delta(delta: dict[str, Any], content: str, calls: list[dict]) -> dict[str, Any]:
    """A chat chunk's delta with its content replaced by what is not a call, and its tool_calls entries."""
    delta = dict(delta)
    if content or not calls:
        delta["content"] = content
    else:
        delta.pop("content", None)
    if calls:
        delta["tool_calls"] = calls
    return delta


class StreamedToolCalls:
    """Every choice of a streamed chat answer read for tool calls: each chunk's choice with its delta split."""

    def __init__(self, format: ToolFormat, parallel: bool = True, named: bool = False) -> None:
        """parallel: false keeps the first call of each choice only; named: tool_choice named the function (both as
        message_with_calls)."""
        self.format = format
        self.parallel = parallel
        self.named = named
        self._streams: dict[int, ToolCallStream] = {}

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        stream = self._streams.setdefault(choice["index"], ToolCallStream(self.format))
        finish_reason = choice.get("finish_reason")
        delta = choice.get("delta") or {}
        content, calls = stream.feed(delta.get("content") or "", final=finish_reason is not None)
        if not self.parallel:
            calls = [entry for entry in calls if entry["index"] == 0]
        return {**choice, "delta": stream_delta(delta, content, calls),
                "finish_reason": stream.finish_reason(finish_reason, self.named)}
