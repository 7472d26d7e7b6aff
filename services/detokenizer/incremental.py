"""Turning a request's token ids into text as they arrive, and naming single tokens for logprobs.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens, so text is decoded from the
concatenated token bytes with an incremental UTF-8 decoder: an incomplete character stays buffered until
the token that completes it arrives, and only bytes that can never become valid UTF-8 turn into U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.tokenizer import Tokenizer

INCOMPLETE_BYTES_PREFIX = "bytes:"  # OpenAI's spelling for a token that is not valid UTF-8 on its own


@dataclass(frozen=True)
class TokenTable:
    """What the detokenizer needs to know about the vocabulary, loaded once per process."""

    token_bytes: Sequence[bytes]  # per id; b"" for special tokens
    special_names: dict[int, str]  # special id -> its literal text, only shown among top logprobs
    leading_spaces: int = 0  # spaces the tokenizer's decoder drops from the start of a text (SentencePiece)
    # The tokenizer's own EOS: a finish on it has no stop_reason, one on any other stop token names the token
    eos_token_id: int | None = None
    # display() of each id asked for so far: logprobs name the same few thousand tokens over and over.
    _displayed: dict[int, tuple[str, list[int]]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> "TokenTable":
        names = {i: tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.special_ids}
        return cls(tokenizer.token_bytes, names, tokenizer.leading_spaces_stripped, tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_names

    def display(self, token_id: int) -> tuple[str, list[int]]:
        """The `token` string and `bytes` list of a logprobs entry for one token.

        A token that is a fragment of a UTF-8 character cannot be shown as text, so, as OpenAI does, it is
        spelled as its escaped bytes; the `bytes` list lets a client reassemble the character. The result is
        shared between calls: read it, never change it.
        """
        shown = self._displayed.get(token_id)
        if shown is None:
            shown = self._displayed[token_id] = self._spell(token_id)
        return shown

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        if token_id in self.special_names:
            name = self.special_names[token_id]
            return name, list(name.encode("utf-8"))
        raw = self.token_bytes[token_id]
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return INCOMPLETE_BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw), list(raw)


@dataclass(frozen=True)
class DecodedStep:
    """The text one step's tokens added, and where each token's characters lie in the whole output."""

    text: str
    spans: list[tuple[int, int]]  # per token: [start, end) character offsets in the request's output


class IncrementalDecoder:
    """Decodes one request's output; call `step` per engine step and `finish` once at the end."""

    def __init__(self, table: TokenTable, shown_special: Iterable[int] = (), starts_text: bool = False) -> None:
        """shown_special: the special tokens whose text this text shows; starts_text: these tokens begin the text (a
        prompt, not an output after it), whose first spaces the tokenizer's decoder drops
        (TokenTable.leading_spaces), as decoding the prompt whole does."""
        self._table = table
        self._strip = table.leading_spaces if starts_text else 0
        # Special tokens have no bytes of their own: generated text leaves them out, except the tags of a tool-call
        # format that writes them as tokens, and a prompt echoed as sent shows their literal text.
        names = table.special_names
        self._special = {i: names[i].encode() for i in shown_special if i in names}
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.length = 0  # characters produced so far

    def step(self, token_ids: Sequence[int], final: bool = False) -> DecodedStep:
        """Decodes the tokens of one step together; with `final`, flushes bytes no token will complete.

        Bytes are fed token by token so each character is attributed to the token that completes it;
        the concatenated text is the same as decoding the step's bytes in one call.
        """
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        start = self.length
        for token_id in token_ids:
            piece = self._decoder.decode(self._special.get(token_id) or self._table.token_bytes[token_id])
            if self._strip and piece:
                cut = min(self._strip, len(piece) - len(piece.lstrip(" ")))
                piece = piece[cut:]
                self._strip = 0 if piece else self._strip - cut
            pieces.append(piece)
            spans.append((start, start + len(piece)))
            start += len(piece)
        if final:
            tail = self._decoder.decode(b"", final=True)
            if tail:
                pieces.append(tail)
                if spans:
                    spans[-1] = (spans[-1][0], spans[-1][1] + len(tail))
                start += len(tail)
        self.length = start
        return DecodedStep("".join(pieces), spans)
