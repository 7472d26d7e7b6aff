"""vLLM's request extensions, and OpenAI fields, that specmesh does not declare in its request models: each is refused
by name unless it holds its neutral value (the one that asks for nothing specmesh would fail to do), or accepted and
logged once when it cannot change what is generated. docs/api.md lists every vLLM extension, these and the
honoured ones.

Checked on the raw JSON body, before the request models see it, so that a value specmesh would otherwise drop (a
field its models do not declare) is never silently ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.gateway.aggregate import Api
from services.gateway.errors import bad_request

log = logging.getLogger(__name__)

ANY_API: tuple[Api, ...] = ("chat", "completion")


@dataclass(frozen=True)
class Refused:
    """A field specmesh does not implement: any value but a neutral one is a 400 naming it."""

    name: str
    neutral: tuple[Any, ...]  # JSON values that ask for nothing (null is always neutral)
    why: str  # what specmesh does instead, for the error message
    apis: tuple[Api, ...] = ANY_API

    def check(self, value: Any) -> None:
        """A 400 naming the field unless `value` is null or neutral (JSON true is not 1, nor false 0)."""
        if value is not None and not any(
            n == value and isinstance(value, bool) == isinstance(n, bool) for n in self.neutral
        ):
            raise bad_request(f"'{self.name}' is not supported by this server: {self.why}", param=self.name)


@dataclass(frozen=True)
class Ignored:
    """A field whose value cannot change the generated tokens or their text: accepted, logged once."""

    name: str
    why: str


# Chat's tool-calling fields (tools/), with the values that offer no tool
TOOL_CALLING: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
}

# vLLM's extensions of every generation request: refused on a Responses request too (RESPONSES_REFUSED)
VLLM_REFUSED = (
    Refused("use_beam_search", (False,), "beam search is not implemented; sample several choices with n instead"),
    Refused("length_penalty", (1, 1.0), "it weighs beam search's candidates, and beam search is not implemented"),
    Refused("early_stopping", (False,), "it ends beam search, and beam search is not implemented"),
    Refused("logits_processors", ([],), "custom logits processors are not supported"),
    Refused("priority", (0,), "requests are admitted in arrival order, round robin over clients"),
    Refused("mm_processor_kwargs", ({},), "the model reads text only"),
    Refused("kv_transfer_params", ({},), "KV cache transfer is the mesh's own (prefill/decode handoff)"),
    Refused("vllm_xargs", ({},), "no plugin here reads extra arguments"),
    Refused("guided_whitespace_pattern", (), "JSON is generated compact, with no free whitespace"),
    Refused("structural_tag", (), "a structural tag goes in response_format (type \"structural_tag\") or "
            "structured_outputs.structural_tag"),
)
RESPONSES_REFUSED: dict[str, Refused] = {rule.name: rule for rule in VLLM_REFUSED}

REFUSED: dict[tuple[str, Api], Refused] = {
    (rule.name, api): rule
    for rule in (
        *VLLM_REFUSED,
        Refused("prompt_embeds", (), "prompts are taken as text or token ids only", ("completion",)),
        Refused("chat_template", (), "the model's own chat template renders every chat", ("chat",)),
        Refused("documents", ([],), "the chat template is given no documents", ("chat",)),
        Refused("media_io_kwargs", ({},), "the model reads text only", ("chat",)),
        # OpenAI's own chat fields that the request models do not declare: refused in the same way.
        Refused(
            "functions", (), "the legacy functions are not supported; offer them as tools, each "
            '{"type": "function", "function": {...}}', ("chat",),
        ),
        Refused(
            "function_call", ("none", "auto"), "the legacy function_call is not supported; name the function in "
            "tool_choice", ("chat",),
        ),
        Refused("best_of", (1,), "one candidate is generated per choice; ask for more choices with n", ("chat",)),
        Refused("modalities", (["text"],), "the model writes text only", ("chat",)),
        Refused("audio", (), "the model writes text only", ("chat",)),
        Refused(
            "reasoning_effort", (), "the model has no reasoning-effort setting; a chat template that reads one takes "
            "it through chat_template_kwargs", ("chat",),
        ),
        Refused("verbosity", (), "the model has no verbosity setting", ("chat",)),
        Refused("web_search_options", (), "the server does not search the web", ("chat",)),
        # Chat's tool calling, which a completion (a prompt with no chat template to render tools) has not.
        *(
            Refused(name, neutral, "tools are offered on /v1/chat/completions, whose chat template renders them",
                    ("completion",))
            for name, neutral in TOOL_CALLING.items()
        ),
    )
    for api in rule.apis
}

IGNORED: dict[str, Ignored] = {
    rule.name: rule
    for rule in (
        Ignored(
            "spaces_between_special_tokens",
            "a tokenizer.json tokenizer writes shown special tokens without spaces between them, as vLLM's fast "
            "detokenizer does whatever this says",
        ),
        Ignored("request_id", "the response's id is the mesh's own"),
        # OpenAI's chat fields that ask for nothing a generation would show.
        Ignored("store", "completions are not stored for later retrieval"),
        Ignored("metadata", "it tags stored completions, and none are stored"),
        Ignored("service_tier", "every request is served on the one tier this server has"),
        Ignored("prompt_cache_key", "prefix caching and prefix-aware routing find a cached prompt by its tokens"),
        Ignored("safety_identifier", "no usage-policy monitoring runs here"),
    )
}

# Fields of structured output (docs/api.md has their own section): handled there, never reported here as unknown.
STRUCTURED_OUTPUT = frozenset({
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "structured_outputs",
})


def known_names(api: Api) -> frozenset[str]:
    """Field names this module, or the structured-output and tool-calling code, answers for on `api`."""
    refused = {name for name, rule_api in REFUSED if rule_api == api}
    tools = TOOL_CALLING.keys() if api == "chat" else set()
    return frozenset(refused) | IGNORED.keys() | STRUCTURED_OUTPUT | tools


class Extensions:
    """Refuses a request's unsupported vLLM extensions and logs the ignored ones, each name once per process."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def check(self, data: dict[str, Any], api: Api) -> None:
        for name, value in data.items():
            if (rule := REFUSED.get((name, api))) is not None:
                rule.check(value)
            elif (ignored := IGNORED.get(name)) is not None and name not in self._logged:
                self._logged.add(name)
                log.warning("ignoring the request field %r: %s (logged once)", name, ignored.why)
