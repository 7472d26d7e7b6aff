"""Tool calls on a Llama 3 checkpoint through the whole mesh (`specmesh up`, real processes and NATS, the openai
client): its template names the format (a call as `{"name": ..., "parameters": ...}`), a forced call comes back as
OpenAI's tool_calls, the same whole and streamed, its arguments streamed as they are written, and a conversation
holding an earlier call and its result renders and is answered. A tiny random Llama: the grammar, not the weights,
makes the calls."""

from __future__ import annotations

import openai
import pytest

from services.gateway.tools.formats import Llama3Json
from services.mesh_process import Mesh
from tests.test_e2e_tool_calls_mistral import MESSAGES, TIME, WEATHER, family_fixtures, family_tests

pytestmark = pytest.mark.e2e

CONTROL_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  Llama3Json.python_tag)
# Written for this test after Llama 3.1's template: the tools in the first user turn, an assistant's call as a JSON
# object with its arguments under "parameters", a tool's result in the ipython role.
TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>\n\n"
    "{% if loop.first and tools %}{{ tools | tojson }}\n\n{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{\"name\": \"{{ call.function.name }}\", \"parameters\": {{ call.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


mesh, client = family_fixtures("llama", CONTROL_TOKENS, TEMPLATE)
test_a_forced_call_comes_back_as_tool_calls_whole_and_streamed, test_a_conversation_with_an_earlier_call_renders = (
    family_tests(max_tokens=96))  # a random model's integers run long


def test_a_forced_calls_arguments_stream_before_the_answer_ends(client: openai.OpenAI, mesh: Mesh) -> None:
    """The arguments come in pieces, the first before the chunk that finishes the answer."""
    stream = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=96, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )
    pieces = []
    for chunk in stream:
        for choice in chunk.choices:
            pieces += [(entry.function.arguments, choice.finish_reason) for entry in choice.delta.tool_calls or ()
                       if entry.function.arguments]
    assert len(pieces) > 1 and pieces[0][1] is None, pieces
