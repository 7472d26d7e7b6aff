"""Tool calls on a Qwen3-Coder checkpoint through the whole mesh (`specmesh up`, real processes and NATS, the openai
client): its template names the format, a forced call is written as XML and comes back as OpenAI's tool_calls with
its values typed by the tools' schemas, the same whole and streamed (the arguments as they are written), and a
conversation holding an earlier call, its arguments written back as XML elements, renders and is answered. A tiny
random Qwen3-MoE (Qwen3-Coder's architecture): the grammar, not the weights, makes the calls."""

from __future__ import annotations

import pytest

from tests.test_e2e_tool_calls_mistral import family_fixtures, family_tests

pytestmark = pytest.mark.e2e

CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>")
# Written for this test after Qwen3-Coder's template: the assistant's calls as <tool_call> blocks of XML, a
# parameter per argument (an object or list as its JSON), a tool's result in <tool_response> within a user turn.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set call = call.function %}"
    "\n<tool_call>\n<function={{ call.name }}>\n"
    "{% for name, value in call.arguments | items %}<parameter={{ name }}>\n"
    "{{ value | tojson if value is mapping or (value is sequence and value is not string) else value }}"
    "\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


mesh, client = family_fixtures("qwen3_moe", CONTROL_TOKENS, TEMPLATE)
test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed, test_a_conversation_with_an_earlier_call_renders = (
    family_tests(max_tokens=180))  # the tags take a tiny tokenizer many tokens
