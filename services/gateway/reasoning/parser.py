"""A reasoning model's thinking set apart from its answer: `--reasoning-parser`, vLLM's option and parser names.

The model thinks inside `<think>...</think>` and answers after it. A chat message carries the thinking as `reasoning`
(vLLM's current name) and `reasoning_content` (DeepSeek's API and vLLM before it: clients read one or the other), and
the answer as `content`; a stream sends each piece in the delta field it belongs to, as soon as it is known.

- `qwen3`: the answer may open with the block (after blank lines); one that does not is all answer, as Qwen3 writes
  with `enable_thinking` false.
- `deepseek_r1`: the chat template opens the block in the prompt, so the answer starts inside it (an opening tag the
  model writes again is dropped); without a closing tag, all of it is reasoning.
- `mistral`: Magistral's `[THINK]...[/THINK]`, read as qwen3's block is. Its tags are control tokens, which generated
  text leaves out: a request read for reasoning tells its detokenizer to keep them (shown_special_ids).

Line breaks around the thinking are layout, not text, as the chat templates themselves write them back: those just
inside the tags and those that open the answer are dropped. The whole answer and the streamed one read the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from services.gateway.tags import THINK_CLOSE, THINK_OPEN, opens_with, partial_suffix
from shared.structured import ThinkFirst, ThinkTag

LAYOUT = "\n"  # the line breaks around the thinking


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened the block: the answer begins as reasoning
    closed: bool = False  # the prompt holds the whole block (thinking turned off): the answer is all content
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE
    # The tags' ids where the tokenizer has them as special tokens (for_tokenizer), which generated text leaves out
    # unless the detokenizer is told to keep them; None where a tag is text.
    tag_ids: tuple[int | None, int | None] = (None, None)

    def for_tokenizer(self, special_tokens: dict[str, int]) -> "ReasoningFormat":
        """The format with its tags' special token ids, where the tokenizer has them."""
        return replace(self, tag_ids=(special_tokens.get(self.open_tag), special_tokens.get(self.close_tag)))

    @property
    def shown_special_ids(self) -> tuple[int, ...]:
        """The special tokens the answer's text must keep for the block to be read."""
        return tuple(i for i in self.tag_ids if i is not None)

    @property
    def grammar_tags(self) -> tuple[ThinkTag, ThinkTag]:
        """The tags as an output constraint's grammar matches them (shared/structured.py): the token where there is
        one, else the text."""
        return tuple(text if i is None else i for text, i in zip((self.open_tag, self.close_tag), self.tag_ids))

    def for_chat(self, prompt_end: str, continued: str | None) -> "ReasoningFormat":
        """The format of one chat's answer, from the end of its rendered prompt: a block the prompt opens (a
        template that starts the thinking) puts the answer inside it, one it closes (Qwen3's enable_thinking false)
        leaves none to write. An answer continuing its final message (`continued`, continue_final_message) starts
        inside a block only where that message left one open."""
        if continued is not None:
            return replace(self, starts_inside=continued.rfind(self.open_tag) > continued.rfind(self.close_tag))
        end = prompt_end.rstrip()
        if end.endswith(self.close_tag):
            return replace(self, starts_inside=False, closed=True)
        if end.endswith(self.open_tag):
            return replace(self, starts_inside=True)
        return self

    @property
    def think_first(self) -> ThinkFirst | None:
        """Where the block stands before an output constraint, which holds for what follows it
        (shared/structured.py); None where the prompt closed it."""
        if self.closed:
            return None
        return "inside" if self.starts_inside else "may_open"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where there is none."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text, final=True)
        return reasoning or None, content or None


def opening_tag(reasoning: ReasoningFormat | None) -> str | None:
    """The text tag of a reasoning block an answer may open with, where an output constraint's grammar follows the
    block's (shared/structured.py); None where there is no such block, or its tag is a token, which no text holds. A
    constraint that takes free text must not let it open with this tag: the lexer would take the block for that
    text (the longer match) and lose the block's grammar."""
    if reasoning is None or reasoning.think_first != "may_open" or reasoning.tag_ids[0] is not None:
        return None
    return reasoning.open_tag


FORMATS = {
    f.name: f for f in (
        ReasoningFormat("qwen3", starts_inside=False),
        ReasoningFormat("deepseek_r1", starts_inside=True),
        # Magistral: [THINK] and [/THINK] are control tokens (tokenizer v13), which the answer may open with.
        ReasoningFormat("mistral", starts_inside=False, open_tag="[THINK]", close_tag="[/THINK]"),
        # Seed-OSS: its thinking (and its budget reflections inside it) between text tags
        ReasoningFormat("seed_oss", starts_inside=False, open_tag="<seed:think>", close_tag="</seed:think>"),
    )
}


class Part(Enum):
    UNKNOWN = "unknown"  # whether the answer opens with the block is not known yet
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """One choice's answer, piece by piece, split into reasoning and content. A piece that could still turn into a
    tag, or line breaks that may turn out to be layout, are held back until the next piece tells."""

    def __init__(self, format: ReasoningFormat) -> None:
        self.format = format
        # Tags that are control tokens, kept in the text for this parser alone: any beyond the block's own (a stray
        # closing tag, a second block) are left out of both parts, as they would be of text the parser never read.
        tags = (format.open_tag, format.close_tag)
        self._control_tags = [tag for tag, i in zip(tags, format.tag_ids) if i is not None]
        self._part = Part.UNKNOWN
        self._buffer = ""
        self._reasoning_started = False  # text other than layout went out as reasoning
        self._content_started = False
        self._after_block = False  # the content follows a reasoning block: its opening line breaks are layout

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) to send for the next piece of the answer's text; `final` for its last piece."""
        self._buffer += text
        reasoning = content = ""
        if self._part is Part.UNKNOWN and self.format.closed:  # the prompt held the whole block
            self._part = Part.CONTENT
        if self._part is Part.UNKNOWN:
            opens = opens_with(self._buffer, self.format.open_tag, final, LAYOUT)
            if opens is None:
                return "", ""
            if opens:
                self._buffer = self._buffer.lstrip(LAYOUT)[len(self.format.open_tag) :]
                self._part = Part.REASONING
                self._after_block = True
            else:
                self._part = Part.REASONING if self.format.starts_inside else Part.CONTENT
                self._after_block = self.format.starts_inside
        if self._part is Part.REASONING:
            reasoning = self._take_reasoning(final)
        if self._part is Part.CONTENT:
            content = self._take_content(final)
        return reasoning, content

    def _take_reasoning(self, final: bool) -> str:
        close = self.format.close_tag
        end = self._buffer.find(close)
        if end >= 0:
            body, self._buffer = self._buffer[:end], self._buffer[end + len(close) :]
            self._part = Part.CONTENT
            return self._reasoning_text(body.rstrip(LAYOUT))
        if final:
            body, self._buffer = self._buffer.rstrip(LAYOUT), ""
            return self._reasoning_text(body)
        # Held: the start of a closing tag, and the line breaks before it, which are layout if the tag follows them.
        body = self._buffer[: len(self._buffer) - self._partial_tag(close)].rstrip(LAYOUT)
        self._buffer = self._buffer[len(body) :]
        return self._reasoning_text(body)

    def _reasoning_text(self, body: str) -> str:
        body = self._without_control_tags(body)
        if not self._reasoning_started:
            body = body.lstrip(LAYOUT)
            self._reasoning_started = bool(body)
        return body

    def _take_content(self, final: bool) -> str:
        cut = len(self._buffer) - (0 if final else self._partial_tag())
        text, self._buffer = self._without_control_tags(self._buffer[:cut]), self._buffer[cut:]
        if not self._content_started:
            text = text.lstrip(LAYOUT) if self._after_block else text
            self._content_started = bool(text)
        return text

    def _partial_tag(self, *tags: str) -> int:
        """How much of the buffer's end may still become one of `tags` or a control tag: held back, since a stop
        string the detokenizer holds back may cut a tag's text in two."""
        return max((partial_suffix(self._buffer, tag) for tag in (*tags, *self._control_tags)), default=0)

    def _without_control_tags(self, text: str) -> str:
        for tag in self._control_tags:
            text = text.replace(tag, "")
        return text


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A message's or delta's reasoning, under both names clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def message_with_reasoning(message: dict, format: ReasoningFormat, include: bool) -> None:
    """Moves a whole chat answer's reasoning out of message["content"]; with `include` false it is left out."""
    reasoning, message["content"] = format.split(message.get("content") or "")
    if reasoning is not None and include:
        message.update(reasoning_fields(reasoning))


class StreamedReasoning:
    """Every choice of a streamed chat answer split into reasoning and content: each chunk's choice with its delta
    rewritten. With `include` false the reasoning is left out."""

    def __init__(self, format: ReasoningFormat, include: bool) -> None:
        self.format = format
        self.include = include
        self._streams: dict[int, ReasoningStream] = {}

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        stream = self._streams.setdefault(choice["index"], ReasoningStream(self.format))
        delta = dict(choice.get("delta") or {})
        reasoning, content = stream.feed(delta.get("content") or "", final=choice.get("finish_reason") is not None)
        if reasoning and self.include:
            delta.update(reasoning_fields(reasoning))
            delta["content"] = content or None
        else:
            delta["content"] = content
        return {**choice, "delta": delta}
