"""The tool fields of a chat request, validated: `tools`, `tool_choice` and `parallel_tool_calls`, as the OpenAI
API defines them (a function's `parameters` is a JSON schema; `strict` is honoured by construction: a forced call
follows the schema exactly)."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.json_schema import closed_objects

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
ANY_ARGUMENTS = {"type": "object"}  # a function without `parameters` takes any object
CLOSED_SCHEMAS_KEPT = 256  # functions' closed schemas remembered
MAX_KEPT_SCHEMA_CHARS = 64 * 1024  # a larger one is closed for each request: what is kept stays tens of MB


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' schema as a forced call follows it: objects closed to keys they do not list
        (shared/json_schema.py); closed once for every request that offers the same parameters (an agent sends its
        tools every turn), a fresh copy each time, which callers may change."""
        if not self.parameters:
            return dict(ANY_ARGUMENTS)
        # The standard library's JSON: a schema may hold integers past 64 bits, which orjson refuses. Keys in order:
        # the output follows it.
        key = json.dumps(self.parameters, separators=(",", ":"))
        if len(key) > MAX_KEPT_SCHEMA_CHARS:
            return closed_objects(copy.deepcopy(self.parameters))  # it may hand back what it was given
        return copy.deepcopy(_closed_schema(key))


@functools.lru_cache(maxsize=CLOSED_SCHEMAS_KEPT)
def _closed_schema(parameters: str) -> dict[str, Any]:
    """The closed schema of the parameters (their JSON); never handed out itself, only copies."""
    return closed_objects(json.loads(parameters))


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """As chat templates read it (Qwen2.5's and Llama 3.x's take OpenAI's shape)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


TOOL_CHOICE_MODES = ("none", "auto", "required")


def check_tool_choice_kind(value: Any) -> Any:
    """Before the union is tried: a tool_choice of another kind (OpenAI's allowed_tools, a hosted tool's, a custom
    tool's) or an unknown mode is refused saying what is taken, rather than with each union member's complaint."""
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(
            f"a tool_choice of type {value.get('type')!r} is not supported: this server calls functions only; send "
            f"one of {', '.join(TOOL_CHOICE_MODES)} or a function to call by name"
        )
    if isinstance(value, str) and value not in TOOL_CHOICE_MODES:
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or a function, got {value!r}")
    return value


def check_tools(tools: list[Tool] | None) -> list[Tool] | None:
    check_function_names([tool.function.name for tool in tools or ()])
    return tools


def check_function_names(names: list[str]) -> None:
    """The offered functions' names, in either API's shape of tools: no two alike."""
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have distinct function names, got {names}")


def check_tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> ToolChoice | None:
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    check_choice_among(choice, named, [tool.function.name for tool in tools or ()])
    return choice


def check_choice_among(choice: Any, named: str | None, names: list[str]) -> None:
    """tool_choice against the offered functions, in either API's shape: a named function must be among them,
    "required" needs one."""
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names function {named!r}, which is not among the tools {names}")
    if choice == "required" and not names:
        raise ValueError('tool_choice "required" needs at least one tool')


class ToolFields(BaseModel):
    """What a chat request says about tools; `tool_choice` defaults as OpenAI's does: auto with tools, else none."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> "ToolFields":
        check_tools(self.tools)
        check_tool_choice(self.tool_choice, self.tools)
        return self

    @property
    def mode(self) -> Literal["none", "auto", "required", "named"]:
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def callable(self) -> list[FunctionDefinition]:
        """The functions the output may call: the named one, or every tool."""
        functions = [tool.function for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in functions if f.name == self.tool_choice.function.name]
        return functions

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.mode != "none"

    @property
    def forced_calls_parallel(self) -> bool:
        """Whether a forced answer may make several calls: under tool_choice `required` with parallel_tool_calls; a
        named function is called once, as OpenAI and vLLM answer."""
        return self.mode == "required" and self.parallel_tool_calls

    @property
    def forces_calls(self) -> bool:
        """Whether a grammar makes the output calls and nothing else."""
        return self.mode in ("required", "named")
