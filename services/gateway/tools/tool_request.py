"""The tool fields of a chat request, validated: `tools`, `tool_choice` and `parallel_tool_calls`, as the OpenAI
API defines them (a function's `parameters` is a JSON schema; a forced call follows it exactly, and so, under
`auto`, does a `strict` function's call: ToolFields.limits_calls). tool_choice `allowed_tools` narrows the
functions the answer may call to some of the tools while the chat template still shows them all, so that the
prompt, and the prefix cache, stay those of the other turns."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from shared.json_schema import closed_objects

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
# OpenAI: "omitting parameters defines a function with an empty parameter list" (vLLM reads `{}` so too)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_ARGUMENTS = {"type": "object"}  # what a function that is not strict takes under plain `auto`
CLOSED_SCHEMAS_KEPT = 256  # functions' closed schemas remembered
MAX_KEPT_SCHEMA_CHARS = 64 * 1024  # a larger one is closed for each request: what is kept stays tens of MB


@dataclass(frozen=True)
class Forced:
    """tool_choice `required` or named: a grammar makes the answer calls and nothing else, so what is left of it
    outside calls is the markup of a call cut short (max_tokens), never content."""

    name: str | None = None  # the function tool_choice named; its call stands even when cut before its name


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
            return copy.deepcopy(NO_ARGUMENTS)
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


AllowedMode = Literal["auto", "required"]


class FunctionReference(BaseModel):
    """A function named among allowed_tools. OpenAI takes whole tool definitions there, as a client may pass its
    filtered `tools` on: what beside the name is read from `tools`, not from here."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)


class ToolReference(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["function"]
    function: FunctionReference


class AllowedTools(BaseModel):
    """The functions an answer may call, among the tools: `required` calls one or more of them, `auto` may answer in
    text instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: AllowedMode
    tools: list[ToolReference] = Field(min_length=1)  # each in chat's nested shape, as a named tool_choice is


class AllowedToolsChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def names(self) -> list[str]:
        return [tool.function.name for tool in self.allowed_tools.tools]


TOOL_CHOICE_MODES = ("none", "auto", "required")
TOOL_CHOICE_TYPES = ("function", "allowed_tools")
MODE_MEMBER = "str"  # the tag of tool_choice's modes: a type's name, which error locations leave out (errors.py)
CHOICES_TAKEN = f"one of {', '.join(TOOL_CHOICE_MODES)}, a function to call by name, or allowed_tools"


def tool_choice_union(named: type[BaseModel], allowed: type[BaseModel]) -> Any:
    """tool_choice's type in an API's shapes: a mode, a function to call by name, or allowed_tools. The member is
    picked by `type`, so that a bad allowed_tools is told what is wrong with it, not what a named function lacks;
    each member is tagged with its class name, which error locations leave out."""
    members = {"function": named.__name__, "allowed_tools": allowed.__name__}

    def member(value: Any) -> str | None:
        if isinstance(value, str):
            return MODE_MEMBER
        if isinstance(value, BaseModel):  # a choice already validated, handed on (ToolFields)
            return type(value).__name__
        return members.get(value.get("type")) if isinstance(value, dict) else None

    return Annotated[
        Annotated[Literal["none", "auto", "required"], Tag(MODE_MEMBER)]
        | Annotated[named, Tag(named.__name__)]
        | Annotated[allowed, Tag(allowed.__name__)],
        Discriminator(member, custom_error_type="tool_choice", custom_error_message=f"send {CHOICES_TAKEN}"),
    ]


ToolChoice = tool_choice_union(NamedToolChoice, AllowedToolsChoice)


def check_tool_choice_kind(value: Any) -> Any:
    """Before the union is tried: a tool_choice of another kind (a hosted tool's, a custom tool's) or an unknown mode
    is refused saying what is taken, rather than with the literal's or the discriminator's complaint."""
    if isinstance(value, dict) and value.get("type") not in TOOL_CHOICE_TYPES:
        raise ValueError(
            f"a tool_choice of type {value.get('type')!r} is not supported: this server calls functions only; send "
            f"{CHOICES_TAKEN}"
        )
    if isinstance(value, str) and value not in TOOL_CHOICE_MODES:
        raise ValueError(f"tool_choice must be {CHOICES_TAKEN}, got {value!r}")
    return value


def check_tools(tools: list[Tool] | None) -> list[Tool] | None:
    check_function_names([tool.function.name for tool in tools or ()])
    return tools


def check_function_names(names: list[str]) -> None:
    """The offered functions' names, in either API's shape of tools: no two alike."""
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have distinct function names, got {names}")


def check_tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> ToolChoice | None:
    if isinstance(choice, NamedToolChoice):
        chosen = [choice.function.name]
    else:
        chosen = choice.names if isinstance(choice, AllowedToolsChoice) else []
    names = [tool.function.name for tool in tools or ()]
    check_choice_among(choice, chosen, names)
    if choice == "auto" and not names:  # as OpenAI and vLLM refuse it: there is nothing to call
        raise ValueError('tool_choice "auto" needs at least one tool; leave tool_choice out, or send "none"')
    return choice


def check_choice_among(choice: Any, chosen: list[str], names: list[str]) -> None:
    """tool_choice against the offered functions, in either API's shape: the functions it names (one to call, or
    those allowed) must be among them, "required" needs one."""
    for name in chosen:
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools {names}")
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
        """allowed_tools reads as its own mode: what differs is only which functions are callable."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if isinstance(self.tool_choice, AllowedToolsChoice):
            return self.tool_choice.allowed_tools.mode
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def functions(self) -> list[FunctionDefinition]:
        """Every tool's function, in the tools' order."""
        return [tool.function for tool in self.tools or ()]

    @property
    def callable(self) -> list[FunctionDefinition]:
        """The functions the output may call: the named one, the allowed ones (in the tools' order), or every tool."""
        functions = [tool.function for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in functions if f.name == self.tool_choice.function.name]
        if isinstance(self.tool_choice, AllowedToolsChoice):
            allowed = set(self.tool_choice.names)
            return [f for f in functions if f.name in allowed]
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

    @property
    def forced(self) -> Forced | None:
        """What tool_choice forces, as the answer's calls are read (tools/tool_calls.py)."""
        if not self.forces_calls:
            return None
        return Forced(self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None)

    @property
    def constrains(self) -> bool:
        """Whether the tools impose a grammar (tools/formats.tool_constraint)."""
        return self.forces_calls or self.limits_calls

    @property
    def limits_calls(self) -> bool:
        """Whether a grammar lets the output be text or calls of the callable functions: allowed_tools `auto`, or
        plain `auto` with a `strict` function, whose calls OpenAI's strict mode makes follow its schema. Under plain
        `auto` otherwise nothing stops the model from writing a call of any name, which would be read as one."""
        return self.mode == "auto" and (isinstance(self.tool_choice, AllowedToolsChoice) or self.strict)

    def beside_answer(self, answer_constrained: bool) -> bool:
        """Whether an answer constrained otherwise (response_format, ...) stands beside calls of the functions, the
        answer that or calls: under `auto`, with a function to call (tools/formats.tool_constraint)."""
        return answer_constrained and self.mode == "auto" and bool(self.callable)

    @property
    def strict(self) -> bool:
        """Whether a callable function is `strict`."""
        return any(f.strict for f in self.callable)

    @property
    def grammar_functions(self) -> list[FunctionDefinition]:
        """The callable functions as a grammar that lets the output be text or calls constrains them: under plain
        `auto` a function that is not `strict` takes any object, as it does without a grammar; under allowed_tools
        every call follows its schema, as a forced one does."""
        if isinstance(self.tool_choice, AllowedToolsChoice):
            return self.callable
        return [f if f.strict else f.model_copy(update={"parameters": ANY_ARGUMENTS}) for f in self.callable]

    @property
    def grammar_param(self) -> str:
        """The parameter that makes the tools' grammar: tool_choice, or under plain `auto` the tools' `strict`."""
        return "tool_choice" if self.forces_calls or isinstance(self.tool_choice, AllowedToolsChoice) else "tools"
