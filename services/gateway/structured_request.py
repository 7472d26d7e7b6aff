"""What a request constrains its output to, in every spelling clients use: OpenAI's `response_format`
(`json_object`, `json_schema` with `strict`; vLLM's `structural_tag`), vLLM's `structured_outputs` object and its
older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. One constraint per request; each becomes a
shared.structured.StructuredOutput, compiled by the gateway against the model's tokenizer before the request is
queued, so a schema the grammar engine cannot compile is a 400 naming the problem.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.structured import StructuredError, StructuredKind, StructuredOutput, check, grammar_of, ll_tokenizer
from services.gateway.errors import bad_request, param_name
from services.gateway.structural_tag import StructuralTag, TagStructure, structural_tag_lark

COMPILED_KEPT = 256  # constraints whose compilation the gateway remembers
# vLLM's per-request grammar engine choice: any that this server's engine (llguidance) stands in for is accepted.
BACKENDS = {None, "auto", "guidance", "llguidance"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # A JSON schema: OpenAI's `schema`; some clients send it as `json_schema` inside, which vLLM reads too.
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # honoured in both values: the output always follows the schema exactly

    @model_validator(mode="before")
    @classmethod
    def _schema_under_either_name(cls, value: Any) -> Any:
        if isinstance(value, dict) and "json_schema" in value:
            value = dict(value)
            inner = value.pop("json_schema")
            if value.setdefault("schema", inner) != inner:
                raise ValueError("response_format.json_schema has both `schema` and `json_schema`, and they differ")
        return value


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (vLLM's): services/gateway/structural_tag.py
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None
    format: dict | None = None  # xgrammar's newer structural tag formats: refused by name

    @field_validator("json_schema")
    @classmethod
    def _schema_given(cls, value: JsonSchemaFormat | None) -> JsonSchemaFormat | None:
        if value is not None and value.schema_ is None:
            raise ValueError("response_format.json_schema needs a `schema`")
        return value

    @model_validator(mode="after")
    def _tag_fields_with_their_type(self) -> "ResponseFormat":
        stray = [name for name in ("structures", "triggers", "format") if getattr(self, name) is not None]
        if stray and self.type != "structural_tag":
            raise ValueError(f'{", ".join(stray)} belong to type "structural_tag", not {self.type!r}')
        return self


class StructuredOutputsOptions(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None  # vLLM takes it as JSON text; its object is taken too


def check_backend(value: str | None) -> str | None:
    """guided_decoding_backend: vLLM's per-request grammar engine choice."""
    if value not in BACKENDS:
        raise ValueError(
            f"guided_decoding_backend {value!r} is not available: this server's grammar engine is llguidance "
            f"(accepted: {sorted(b for b in BACKENDS if b)})"
        )
    return value


def structured_output(body: Any, block_open: str | None = None) -> tuple[str, StructuredOutput] | None:
    """The request's one output constraint with the parameter that set it, or None; a 400 when it sets several.
    block_open: the text tag of a reasoning block the answer may open with, which a structural tag's free text does
    not open with (reasoning/parser.opening_tag)."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", StructuredOutput(kind="json_object")))
        elif response_format.type == "structural_tag":
            found.append(("response_format", _structural_tag("response_format", response_format.model_dump(
                by_alias=True, exclude_none=True, exclude={"json_schema"}), block_open)))
        elif response_format.json_schema is None:
            raise bad_request('response_format of type "json_schema" needs a `json_schema` object',
                              param="response_format")
        else:
            found.append(("response_format", _schema("response_format", response_format.json_schema.schema_)))
    if body.structured_outputs is not None:
        found += _options(body.structured_outputs, block_open)
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(body, name)
        if value is not None:
            found.append((name, _constraint(name, name.removeprefix("guided_"), value)))
    if len(found) > 1:
        raise bad_request(
            f"a request takes one output constraint, got {len(found)}: {', '.join(name for name, _ in found)}",
            param=found[1][0],
        )
    return found[0] if found else None


def is_structural_tag(body: Any) -> bool:
    """Whether the request's output constraint is a structural tag."""
    response_format, options = body.response_format, body.structured_outputs
    return (response_format is not None and response_format.type == "structural_tag") or (
        options is not None and options.structural_tag is not None)


def holds_free_text(body: Any) -> bool:
    """Whether the request's output constraint may let the answer be any text: a structural tag around its
    structures, a regex or a grammar. Beside tools under `auto` such text could write a call's tag, which the format
    would read as a call no grammar checked; JSON cannot (its strings escape what a tag needs) and a choice's
    strings are the client's."""
    options = body.structured_outputs
    return is_structural_tag(body) or body.guided_regex is not None or body.guided_grammar is not None or (
        options is not None and (options.regex is not None or options.grammar is not None))


def _options(options: StructuredOutputsOptions, block_open: str | None) -> list[tuple[str, StructuredOutput]]:
    found = []
    for name, value in (("json", options.json_), ("regex", options.regex), ("choice", options.choice),
                        ("grammar", options.grammar)):
        if value is not None:
            found.append((f"structured_outputs.{name}", _constraint(f"structured_outputs.{name}", name, value)))
    if options.json_object:
        found.append(("structured_outputs.json_object", StructuredOutput(kind="json_object")))
    if options.structural_tag is not None:
        found.append(("structured_outputs.structural_tag",
                      _structural_tag("structured_outputs.structural_tag", options.structural_tag, block_open)))
    return found


def _structural_tag(param: str, value: dict | str, block_open: str | None) -> StructuredOutput:
    """The structural tag as its grammar (structural_tag.py); a 400 naming the parameter where it is malformed."""
    try:
        raw = orjson.loads(value) if isinstance(value, str) else value
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"{param} is not JSON: {exc}", param=param) from None
    if isinstance(raw, dict) and "format" in raw:
        raise bad_request(
            f"{param}.format: xgrammar's structural tag formats are not implemented; send `structures` (begin, "
            "schema, end) and `triggers`", param=f"{param}.format",
        )
    try:
        tag = StructuralTag.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = param_name(tuple(error["loc"]))
        raise bad_request(f"{param}: {error['msg']}", param=f"{param}.{where}" if where else param) from None
    return _structured(param, "grammar", structural_tag_lark(tag, block_open))


def _constraint(param: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        return _schema(param, value)
    if kind == "choice":
        if not value:
            raise bad_request(f"{param} needs at least one string", param=param)
        return _structured(param, "choice", orjson.dumps(value).decode())
    return _structured(param, "regex" if kind == "regex" else "grammar", value)


def _schema(param: str, schema: dict | str) -> StructuredOutput:
    return _structured(param, "json_schema", schema if isinstance(schema, str) else orjson.dumps(schema).decode())


def _structured(param: str, kind: StructuredKind, spec: str) -> StructuredOutput:
    """The constraint, or a 400 naming the parameter where StructuredOutput refuses it (a spec over its length)."""
    try:
        return StructuredOutput(kind=kind, spec=spec)
    except ValidationError as exc:
        raise bad_request(f"{param}: {exc.errors()[0]['msg']}", param=param) from None


def compiled(
    constraint: tuple[str, StructuredOutput] | None, model_dir: Path, vocab_size: int, eos_ids: frozenset[int]
) -> StructuredOutput | None:
    """The constraint once compiled as the worker will compile it (shared/structured.py); a 400 naming the parameter
    and what does not compile."""
    if constraint is None:
        return None
    param, structured = constraint
    problem = _problem(structured, Path(model_dir), vocab_size, tuple(sorted(eos_ids)))
    if problem is not None:
        raise bad_request(f"{param} does not compile: {problem}", param=param)
    return structured


@functools.lru_cache(maxsize=COMPILED_KEPT)
def _problem(structured: StructuredOutput, model_dir: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> str | None:
    """What keeps the constraint from compiling, or None; kept by the constraint (an agent framework sends the same
    few schemas again and again)."""
    try:
        check(grammar_of(structured), ll_tokenizer(model_dir, vocab_size, eos_ids))
    except StructuredError as exc:
        return str(exc)
    return None
