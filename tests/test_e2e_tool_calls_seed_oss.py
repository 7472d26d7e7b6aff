"""Tool calls on a Seed-OSS checkpoint through the whole mesh (`specmesh up`, real processes and NATS, the openai
client): its template names the format, a forced call is written as Seed-OSS's XML, values inline, and comes back as
OpenAI's tool_calls typed by the tools' schemas, the same whole and streamed, and a conversation holding an earlier
call renders and is answered. A tiny random Seed-OSS (SeedOssForCausalLM): the grammar, not the weights, makes the
calls."""

from __future__ import annotations

import pytest

from tests.test_e2e_tool_calls_mistral import family_fixtures, family_tests

pytestmark = pytest.mark.e2e

CONTROL_TOKENS = ("<seed:bos>", "<seed:eos>")
# Written for this test after Seed-OSS's template: roles between its tags, the assistant's calls as
# <seed:tool_call> blocks of XML with values inline, a tool's result in a turn of its own.
TEMPLATE = (
    "{% if tools %}<seed:bos>system\n{{ tools | tojson }}<seed:eos>{% endif %}"
    "{% for message in messages %}<seed:bos>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set call = call.function %}"
    "<seed:tool_call>\n<function={{ call.name }}>\n"
    "{% for name, value in call.arguments | items %}<parameter={{ name }}>"
    "{{ value | tojson if value is mapping or (value is sequence and value is not string) else value }}"
    "</parameter>\n{% endfor %}</function>\n</seed:tool_call>{% endfor %}<seed:eos>{% endfor %}"
    "{% if add_generation_prompt %}<seed:bos>assistant\n{% endif %}"
)


mesh, client = family_fixtures("seed_oss", CONTROL_TOKENS, TEMPLATE)
test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed, test_a_conversation_with_an_earlier_call_renders = (
    family_tests(max_tokens=180))  # the tags take a tiny tokenizer many tokens
