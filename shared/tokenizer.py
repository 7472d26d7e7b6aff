"""A Hugging Face tokenizer directory loaded without `transformers`: encoding, chat template, token bytes.

The gateway encodes prompts and renders chats; the detokenizer needs the exact bytes of every token so
that it can decode incrementally and never split a UTF-8 character (see services/detokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# What a chat template is given by specmesh itself; a request's chat_template_kwargs may not set these
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)

TOKENIZER_FILE = "tokenizer.json"
# continue_final_message: written after the final message's content, to find where the rendered content ends. Its
# trailing space shows whether the template kept the content's own trailing whitespace or trimmed it.
CONTINUE_MARK = "SPECMESH_CONTINUES_HERE "


def _bytes_to_unicode() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable stand-ins for each of the 256 bytes, mapped back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_content(value: str | dict | None) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str) -> None:
    """What Hugging Face chat templates call to refuse a conversation (e.g. roles that do not alternate)."""
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON as the models' chat templates were written against (Hugging Face's renderer, which vLLM uses): keys in
    their order and no HTML escaping, where Jinja's own filter sorts keys and writes '<' as \\u003c."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """Today's date as a template writes it (Llama 3.x's system prompt): a global of Hugging Face's renderer."""
    return datetime.now().strftime(format)


class FinalMessageNotFound(ValueError):
    """continue_final_message: the rendered chat does not contain the final message's content as written."""


def _cut_at_mark(text: str, final: str) -> str:
    """The chat rendered with CONTINUE_MARK after the final message's content, cut where the content ends: before
    the mark, and before the content's trailing whitespace too where the template trimmed the mark's."""
    mark = CONTINUE_MARK.strip()
    end = text.rfind(mark)
    if not final.strip() or end < 0 or final.strip() not in text[:end]:
        raise FinalMessageNotFound(
            "continue_final_message: the chat template does not render the final message's content as written, so "
            "there is no place to continue it from"
        )
    return text[:end] if text.startswith(CONTINUE_MARK, end) else text[:end].rstrip()


def config_eos_ids(model_dir: Path) -> frozenset[int]:
    """The eos_token_id entries of config.json and generation_config.json (each an id, a list or absent; a
    vision-language config's text_config may hold config.json's, as transformers 5 saves Gemma 3's)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            data = json.loads(path.read_text())
            value = data.get("eos_token_id")
            if value is None and isinstance(data.get("text_config"), dict):
                value = data["text_config"].get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(ids)


def model_eos_ids(model_dir: Path) -> frozenset[int]:
    """What ends a sequence of this model: its tokenizer's EOS ids, or config.json's alone where the directory has
    no tokenizer (a shape loaded with random weights, which only the engine serves)."""
    if (Path(model_dir) / TOKENIZER_FILE).is_file():
        return Tokenizer(model_dir).eos_token_ids
    return config_eos_ids(model_dir)


class Tokenizer:
    """Wraps tokenizer.json plus the parts of tokenizer_config.json/config.json that serving needs."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self._config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_content(self._config.get("bos_token"))
        self.eos_token = _token_content(self._config.get("eos_token"))
        self.chat_template: str | None = self._config.get("chat_template")
        # The tokenizer's own EOS; the configs may name more (eos_token_ids holds them all)
        self.eos_token_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        self.eos_token_ids = self._eos_ids(model_dir)
        # Special tokens by their text ([TOOL_CALLS], <|im_end|>, ...): control tokens generated text leaves out
        self.special_tokens = {t["content"]: t["id"] for t in self._added_tokens() if t.get("special", False)}
        self.special_ids = frozenset(self.special_tokens.values())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _added_tokens(self) -> list[dict]:
        return json.loads(self._tok.to_str()).get("added_tokens", [])

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids = set(config_eos_ids(model_dir))
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids, as encode gives them; the tokenizer's own threads share the texts out."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Renders the chat and encodes it; the template places special tokens itself (add_special_tokens: the
        tokenizer's too, as vLLM's request field asks). With continue_final_message
        the text ends right after the final message's content (no end-of-turn marks), as Hugging Face cuts it.
        template_kwargs: more variables for the template (a request's chat_template_kwargs), none of
        TEMPLATE_VARIABLES. Raises jinja2's TemplateError when the template refuses the messages."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        final = messages[-1]["content"] if continue_final_message else ""
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_MARK}]
        # One mapping, not keywords: a template variable named like render's own parameters ("self") is a variable
        text = self._chat_template.render({
            **(template_kwargs or {}),
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        })
        if continue_final_message:
            text = _cut_at_mark(text, final)
        return self.encode(text, add_special_tokens=add_special_tokens)

    @cached_property
    def _chat_template(self) -> Template:
        """The chat template compiled once: compiling took ~2.8 of the 3.0 ms a chat prompt cost (demo model, 120
        words), ~45 us of gateway CPU per output token under 32 streams of 128 tokens. A compiled template renders
        from any thread."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        return env.from_string(self.chat_template)

    @cached_property
    def _decoders(self) -> list[dict]:
        """The steps of tokenizer.json's decoder (one, or those of its Sequence)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        return [decoder, *decoder.get("decoders", [])]

    @cached_property
    def leading_spaces_stripped(self) -> int:
        """Spaces the decoder takes off the start of a text: SentencePiece tokenizers (Llama 2, Mistral) write each
        word's space into its token ("▁Hello") and drop the first word's, by a Strip step after Fuse or by
        Metaspace's prepend scheme; byte-level ones keep every byte (0)."""
        for step in self._decoders:
            if step.get("type") == "Strip" and step.get("content") == " ":
                return step.get("start", 0)
            if step.get("type") == "Metaspace":
                prepends = step.get("prepend_scheme", "always") != "never" and step.get("add_prefix_space", True)
                return 1 if prepends else 0
        return 0

    def token_strs(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (byte-level pieces such as "Ġthe"), as vLLM's /tokenize
        returns them."""
        return [self._tok.id_to_token(i) for i in ids]

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token that is exactly this text (an added token, or a vocabulary entry), if any."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids[0] if len(ids) == 1 else None

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each token id stands for; special tokens map to b"" (they are never rendered)."""
        kinds = {step.get("type") for step in self._decoders}
        byte_level = "ByteLevel" in kinds
        alphabet = _bytes_to_unicode()
        table = [b""] * self.vocab_size
        for piece, idx in self._tok.get_vocab(with_added_tokens=True).items():
            if idx in self.special_ids:
                continue
            if byte_level and all(c in alphabet for c in piece):
                table[idx] = bytes(alphabet[c] for c in piece)
            elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                table[idx] = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
            else:
                table[idx] = piece.replace("\u2581", " ").encode("utf-8")  # Metaspace
        return table
