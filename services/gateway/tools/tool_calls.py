"""Tool calls out of a chat answer, in OpenAI's shapes: a whole message's `tool_calls`, or a stream's deltas.

Streamed, each call goes out as soon as its parts are known, whatever the chunking: its index, id and name once its
name is written, then its arguments as they are written (made compact as the whole answer's are, arguments.py);
text outside calls streams as content, holding back only what could be the start of a call. Hermes and Qwen3-Coder
blocks are read here; the formats whose calls follow an opening to the answer's end by calls_reader.CallsReader,
which reads whole answers too. One chunk may carry several tokens or several whole calls (speculative decoding
accepts many tokens a step): each call gets its own entry, by index, in order.
"""

from __future__ import annotations

from typing import Any

from services.gateway.tags import opens_with, partial_suffix
from services.gateway.tools.arguments import unsent
from services.gateway.tools.call import LAYOUT, ParsedCall, separated
from services.gateway.tools.call_sequence import Opened
from services.gateway.tools.calls_reader import CallsReader
from services.gateway.tools.formats import OpenedCall, ToolFormat
from services.gateway.tools.tool_request import Forced

TOOL_CALLS_FINISH = "tool_calls"


def message_with_calls(
    message: dict, finish_reason: str | None, format: ToolFormat, parallel: bool = True, forced: Forced | None = None,
) -> str | None:
    """Moves the calls in a whole answer's content into message["tool_calls"]; returns the finish reason
    (`tool_calls` when the answer called tools and stopped on its own, unless tool_choice named the function: then
    `stop`, as OpenAI and vLLM answer). Without `parallel` (parallel_tool_calls false) only the first call is kept:
    under tool_choice auto nothing constrains the answer to one."""
    content, calls = format.split(message.get("content") or "")
    if forced is not None:
        content = ""
        if not calls and forced.name is not None:
            calls = [ParsedCall(forced.name, "")]
        message["content"] = None
    if not calls:
        return finish_reason
    calls = calls if parallel else calls[:1]
    message["content"] = content or None
    message["tool_calls"] = [
        {"id": format.new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    return _finish(finish_reason, forced)


def _finish(finish_reason: str | None, forced: Forced | None) -> str | None:
    named = forced is not None and forced.name is not None
    return TOOL_CALLS_FINISH if finish_reason == "stop" and not named else finish_reason


class ToolCallStream:
    """One streamed choice's text, split into content and tool-call deltas."""

    def __init__(self, format: ToolFormat, forced: Forced | None = None) -> None:
        self.format = format
        self.forced = forced
        self._buffer = ""
        self._inside = False  # within a call's block
        self._calls = 0  # calls started
        self._after_call = False  # nothing but whitespace since the last call (tools/formats.TextAroundCalls)
        self._held_space = ""  # whitespace at the end of the text so far: layout if a call follows it
        self._sent = ""  # the last character of content sent, to tell whether text after a call needs separating
        self._ids: list[str] = []
        self._arguments: OpenedCall | None = None  # the open call's, once its name went out, until it closes
        self._reader = CallsReader(format) if format.calls_after_opening else None
        # Hermes: whether the answer is in its leading reasoning block (None: not known yet), where tags are text
        self._reasoning: bool | None = None

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to stream, tool_calls delta entries) for the next piece of the answer's text."""
        if self._reader is not None:
            content, deltas = self._feed_opened(text, final)
        else:
            content, deltas = self._feed_blocks(text, final)
        if self.forced is None:
            return content, deltas
        if final and not self.called and self.forced.name is not None:  # cut before its name was written
            deltas.append(self._open_call(self.forced.name))
        return "", deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _finish(finish_reason, self.forced) if self.called else finish_reason

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
        return unsent(arguments, reader.sent if reader is not None else "")

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

    def _feed_opened(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Llama 3 JSON, Granite and Mistral: their reader's content, and a delta for each call's name and each
        piece of its arguments as the reader knows them."""
        content, events = self._reader.feed(text, final)
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, Opened):
                deltas.append(self._open_call(event.name))
            else:
                deltas += self._arguments_delta(event.text)
        return content, deltas


def stream_delta(delta: dict[str, Any], content: str, calls: list[dict]) -> dict[str, Any]:
    """A chat chunk's delta with its content replaced by what is not a call, and its tool_calls entries."""
    delta = dict(delta)
    if content or not calls:
        delta["content"] = content
    else:
        delta.pop("content", None)
    if calls:
        delta["tool_calls"] = one_entry_per_call(calls)
    return delta


def one_entry_per_call(calls: list[dict]) -> list[dict]:
    """The entries of one chunk with a call's pieces joined (its opening and the first of its arguments, read from
    the same text): OpenAI and vLLM stream one entry per call in a delta, and a client may take each as a call's."""
    joined: list[dict] = []
    for entry in calls:
        if not joined or joined[-1]["index"] != entry["index"]:
            joined.append(entry)
            continue
        last, piece = joined[-1], entry.get("function", {})
        function = {**piece, **last.get("function", {})}
        function["arguments"] = last.get("function", {}).get("arguments", "") + piece.get("arguments", "")
        joined[-1] = {**entry, **last, "function": function}
    return joined


class StreamedToolCalls:
    """Every choice of a streamed chat answer read for tool calls: each chunk's choice with its delta split."""

    def __init__(self, format: ToolFormat, parallel: bool = True, forced: Forced | None = None) -> None:
        """parallel: false keeps the first call of each choice only; forced: what tool_choice forces (both as
        message_with_calls)."""
        self.format = format
        self.parallel = parallel
        self.forced = forced
        self._streams: dict[int, ToolCallStream] = {}

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        stream = self._streams.setdefault(choice["index"], ToolCallStream(self.format, self.forced))
        finish_reason = choice.get("finish_reason")
        delta = choice.get("delta") or {}
        content, calls = stream.feed(delta.get("content") or "", final=finish_reason is not None)
        if not self.parallel:
            calls = [entry for entry in calls if entry["index"] == 0]
        return {**choice, "delta": stream_delta(delta, content, calls),
                "finish_reason": stream.finish_reason(finish_reason)}
