"""vLLM's structural tags: free text in which each trigger opens a tagged JSON value.

A request sends structures (`begin`, a JSON `schema`, `end`) and triggers: the output is text, and wherever a
trigger appears in it, the text goes on as one structure whose `begin` starts with that trigger, its JSON following
the schema, closed by its `end`; then text again. Outside a structure the text never holds a trigger. This is how
a client keeps a model's own tool-call spelling (`<function=get_weather>{...}</function>`) exact while it may still
write prose around it. Compiled to one Lark grammar for llguidance (shared/structured.py), checked there like any
grammar. xgrammar's newer structural-tag formats (`format`) are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.json_schema import closed_objects
from shared.structured import JSON_OPTIONS, lark_regex_literal, not_opening_with

TEXT_LEXEME = "TEXT"  # text that holds no trigger


class TagStructure(BaseModel):
    """One structure: its `begin`, JSON following `schema` (JSON text is taken too; none: any JSON value, as vLLM's
    optional schema), its `end`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    end: str

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_text_or_none(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"schema is not JSON: {exc}") from None
        return value


class StructuralTag(BaseModel):
    """The structures and their triggers; every structure's `begin` starts with a trigger, and no trigger holds
    another (the text before a structure ends at its first trigger, so one inside another could never begin)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1)
    triggers: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _every_structure_triggered(self) -> "StructuralTag":
        for i, trigger in enumerate(self.triggers):
            if not trigger:
                raise ValueError(f"triggers[{i}] is empty")
            for j, other in enumerate(self.triggers):
                if i != j and trigger in other:
                    raise ValueError(f"triggers[{i}] {trigger!r} is part of triggers[{j}] {other!r}")
        for i, structure in enumerate(self.structures):
            if self.trigger_of(structure) is None:
                raise ValueError(f"structures[{i}].begin {structure.begin!r} starts with none of the triggers")
        return self

    def trigger_of(self, structure: TagStructure) -> str | None:
        return next((t for t in self.triggers if structure.begin.startswith(t)), None)


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def structural_tag_lark(tag: StructuralTag, block_open: str | None = None) -> str:
    """The Lark grammar of the output: pieces of text each ending in a trigger and followed by the rest of a
    structure it begins, then text with no trigger. A piece is one lazy lexeme, ending at its first trigger (a
    greedy one would run past it and find no way out: the text may not hold it). block_open: the text tag of a
    reasoning block the answer may open with (reasoning/parser.opening_tag), which no text here opens with, so the
    lexer does not take the block for text and lose its grammar."""
    any_trigger = "(" + "|".join(lark_regex_literal(t) for t in tag.triggers) + ")"
    not_a_block = not_opening_with(block_open)
    lines = [f"{TEXT_LEXEME}: /(.|\\n)+/ & ~/(.|\\n)*{any_trigger}(.|\\n)*/{not_a_block}"]
    pieces = []
    for i, trigger in enumerate(tag.triggers):
        structures = [s for s in tag.structures if tag.trigger_of(s) == trigger]
        if not structures:
            continue  # a trigger no structure begins with: the text may never hold it
        rests = []
        for structure in structures:
            schema = {**closed_objects(structure.schema_), "x-guidance": JSON_OPTIONS}
            parts = (_literal(structure.begin[len(trigger):]), f"%json {json.dumps(schema)}", _literal(structure.end))
            rests.append(" ".join(filter(None, parts)))
        lines += [
            f"opened_{i}[lazy]: OPENED_{i}",
            f"OPENED_{i}: /(.|\\n)*{lark_regex_literal(trigger)}/ & ~/(.|\\n)*{any_trigger}(.|\\n)+/{not_a_block}",
            f"rest_{i}: {' | '.join(rests)}",
        ]
        pieces.append(f"opened_{i} rest_{i}")
    head = ["start: piece* " + TEXT_LEXEME + "?", "piece: " + " | ".join(pieces)]
    return "\n".join(head + lines) + "\n"
