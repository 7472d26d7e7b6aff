"""Tool calls on a Granite checkpoint through the whole mesh (`specmesh up`, real processes and NATS, the openai
client): its template names the format, a forced call is written after the <|tool_call|> token and comes back as
OpenAI's tool_calls, the same whole and streamed, and a conversation holding an earlier call and its result renders
and is answered. A tiny random Granite: the grammar, not the weights, makes the calls."""

from __future__ import annotations

import pytest

from services.gateway.tools.granite import CALL_TAG
from tests.test_e2e_tool_calls_mistral import family_fixtures, family_tests

pytestmark = pytest.mark.e2e

CONTROL_TOKENS = (CALL_TAG, "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")
# Written for this test after Granite 3.x's templates: roles between their tags, the assistant's calls as one JSON
# array after <|tool_call|>, a tool's result in a role of its own.
TEMPLATE = (
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>{% endif %}"
    "{% for message in messages %}<|start_of_role|>{{ message.role }}<|end_of_role|>"
    "{% if message.tool_calls %}<|tool_call|>{{ message.tool_calls | map(attribute='function') | list | tojson }}"
    "{% else %}{{ message.content }}{% endif %}<|end_of_text|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)


mesh, client = family_fixtures("granite", CONTROL_TOKENS, TEMPLATE)
test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed, test_a_conversation_with_an_earlier_call_renders = (
    family_tests(max_tokens=96))  # a random model's integers run long
