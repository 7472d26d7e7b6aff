"""Structured output: what a request constrains its output to (a JSON schema, any JSON object, a regex, one of some
strings, a grammar), and the one compiler the gateway and the worker share, llguidance.

llguidance (chosen over xgrammar): a Rust grammar engine with a small abi3 wheel and no torch or transformers
dependency, which reads tokenizer.json directly, computes a token bitmask in tens of microseconds, rolls back
consumed tokens, validates a draft's longest valid prefix in one call, and reports the tokens a grammar forces
(`compute_ff_tokens`): what speculation needs from a grammar engine, in the gateway (to refuse a schema by name
before queueing it) and in the worker. The gateway validates against the same tokenizer the worker masks with.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Literal

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
import orjson
from pydantic import BaseModel, ConfigDict, Field

from shared.json_schema import closed_objects
from shared.tokenizer import TOKENIZER_FILE

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# Where a reasoning model's <think> block stands before the constrained answer (the gateway's --reasoning-parser):
# the answer may open with one (qwen3, mistral), or starts inside one its prompt opened (deepseek_r1).
ThinkFirst = Literal["may_open", "inside"]
# A block's tag: its text, or the id of the special token it is (Mistral's [THINK], a control token).
ThinkTag = str | int
DEFAULT_THINK_TAGS: tuple[ThinkTag, ThinkTag] = ("<think>", "</think>")
CONSTRAINT_GRAMMAR = "constraint"  # the request's own grammar, under a reasoning block's
ANSWER_GRAMMAR = "answer"  # StructuredOutput.answer's, referred to as `@answer`
# Up to two line breaks between the block and the answer, as templates write them (any number let a sampled answer
# spend its whole budget on line breaks).
LAYOUT_LARK = '("\\n" "\\n"?)?'
# Compact JSON, no free whitespace between tokens: what OpenAI's strict mode returns, and what lets the grammar
# force every key and punctuation token (free drafts, see services/worker/grammar/).
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}
MAX_SPEC_CHARS = 1 << 20  # a schema, regex, choice list or grammar longer than this is refused


class StructuredError(ValueError):
    """A constraint the grammar engine cannot compile: refused before it is queued."""


class StructuredOutput(BaseModel):
    """The output's constraint: `spec` is the JSON schema (json_schema), the regex, the choices as a JSON list, or
    the grammar (Lark, or GBNF as vLLM's guided_grammar takes it); empty for json_object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: StructuredKind
    spec: str = Field("", max_length=MAX_SPEC_CHARS)
    think_first: ThinkFirst | None = None  # the constraint holds after a reasoning block; None: from the first token
    think_tags: tuple[ThinkTag, ThinkTag] = DEFAULT_THINK_TAGS  # the block's opening and closing tags
    # A grammar's `@answer`: the answer a request constrains beside its tools (an answer in its response_format, or
    # tool calls), compiled as a grammar of its own
    answer: StructuredOutput | None = None

    @property
    def key(self) -> str:
        """Names the compiled grammar in caches: a hash of the kind, spec, reasoning block and answer."""
        answer = self.answer.key if self.answer is not None else ""
        text = f"{self.kind}\0{self.spec}\0{self.think_first}\0{self.think_tags}\0{answer}"
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def choice_regex(choices: list) -> str:
    """A regex matching exactly the choices' strings. One lexeme, not a rule of one alternative each: llguidance's
    parser holds every alternative in each row (refused past 2,000 at the first token), where its lexer compiles the
    alternation lazily; 60,000 choices compile in 0.4 s instead of 3.2 s and mask in 1 ms instead of 430 ms. Each
    choice is written literally (lark_regex_literal), so none reads as regex syntax."""
    return "(" + "|".join(lark_regex_literal(str(choice)) for choice in choices) + ")"


def grammar_of(structured: StructuredOutput) -> str:
    """llguidance's grammar for the constraint (not yet checked against a tokenizer: see check)."""
    grammar = _constraint_grammar(structured)
    if structured.answer is not None:
        grammar = _with_answer(grammar, _constraint_grammar(structured.answer))
    if structured.think_first is None:
        return grammar
    return _after_reasoning(grammar, think_lark(structured.think_first, *structured.think_tags))


def think_lark(think_first: ThinkFirst, open_tag: ThinkTag, close_tag: ThinkTag) -> str:
    """The reasoning block's grammar before the constraint: the opening tag (optional where the prompt opened the
    block), its text up to the first closing tag, then the layout. A text tag ends a lazy lexeme, as the reasoning
    parser reads the text; a special token ends the text lexeme, which never holds one."""
    opening = f"<[{open_tag}]>" if isinstance(open_tag, int) else orjson.dumps(open_tag).decode()
    if isinstance(close_tag, int):
        thought = f"thought: /(.|\\n)*/ <[{close_tag}]>\n"
    else:
        thought = f"thought[lazy]: /(.|\\n)*{lark_regex_literal(close_tag)}/\n"
    start = "start: think @constraint" + (" | @constraint" if think_first == "may_open" else "")
    optional = "?" if think_first == "inside" else ""
    return f"{start}\nthink: {opening}{optional} thought {LAYOUT_LARK}\n{thought}"


def lark_regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/: every character but a letter or digit as its code point, so
    none reads as syntax, the regex's own slash or a line break included."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def not_opening_with(block_open: str | None) -> str:
    """What a Lark token adds (`& ~/.../`) to leave out text that opens, after any whitespace, with `block_open`: a
    reasoning block's text tag (reasoning/parser.opening_tag), so that the lexer does not take the block for that
    text, the longer match, and lose the block's grammar. Nothing for None."""
    return "" if block_open is None else f" & ~/\\s*{lark_regex_literal(block_open)}(.|\\n)*/"


def _top_level(grammar: str) -> dict:
    """A grammar as llguidance's TopLevelGrammar: llguidance writes a Lark grammar as its text, the others as a
    TopLevelGrammar's JSON."""
    return orjson.loads(grammar) if grammar.startswith("{") else {"grammars": [{"lark_grammar": grammar}]}


def _with_answer(grammar: str, answer: str) -> str:
    """A grammar whose `@answer` is the answer's grammar (named so beside it)."""
    top, answer_top = _top_level(grammar), _top_level(answer)
    answer_top["grammars"][0]["name"] = ANSWER_GRAMMAR
    return orjson.dumps({**top, "grammars": [*top["grammars"], *answer_top["grammars"]]}).decode()


def _after_reasoning(grammar: str, reasoning_lark: str) -> str:
    """The constraint's grammar behind an optional reasoning block, vLLM's structured outputs under a reasoning
    parser: the model may think first, and its answer (what the parser leaves as content) follows the constraint."""
    top = _top_level(grammar)
    top["grammars"][0]["name"] = CONSTRAINT_GRAMMAR
    reasoning = {"name": "reasoning", "json_schema": None, "lark_grammar": reasoning_lark}
    return orjson.dumps({**top, "grammars": [reasoning, *top["grammars"]]}).decode()


def _constraint_grammar(structured: StructuredOutput) -> str:
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json_schema":
            schema = orjson.dumps(closed_objects(orjson.loads(spec))).decode()
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            any_object = orjson.dumps(ANY_OBJECT).decode()
            return llguidance.LLMatcher.grammar_from_json_schema(any_object, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(choice_regex(orjson.loads(spec)))
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
    except (ValueError, orjson.JSONDecodeError, GbnfToLarkError) as exc:
        raise StructuredError(str(exc)) from exc


@functools.cache
def ll_tokenizer(model_dir: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance reads it (built once per process: ~10 ms for a small vocabulary, more for
    a large one); vocab_size: the model's logits, which may exceed the tokenizer's own tokens."""
    text = (Path(model_dir) / TOKENIZER_FILE).read_text(encoding="utf-8")
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids))


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raises StructuredError naming the problem if the grammar does not compile for this tokenizer."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise StructuredError(error)
