"""Chat templates render as Hugging Face's renderer (the one vLLM uses) renders them, compared with transformers on
the same tokenizer directory: `tojson` keeps keys in their order and does not escape HTML, loop controls and
`strftime_now` exist, and an earlier call's arguments reach the template as an object, so templates that write them
with `| tojson` (Llama 3.x, Qwen2.5) do not quote them twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.gateway.chat_request import ChatCompletionRequest
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import TOKENIZER_FILE, Tokenizer

transformers = pytest.importorskip("transformers")

# The parts of Llama 3.1's and Qwen2.5's templates that these renderers could disagree on.
TEMPLATE = (
    "{{ bos_token }}Today is {{ strftime_now('%d %b %Y') }}.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'stop' %}{% break %}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] or '' }}\n"
    "{% for call in message['tool_calls'] or [] %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}\n'
    "{% endfor %}{% endfor %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather <city> & more",
           "parameters": {"type": "object", "properties": {"zeta": {"type": "string"}, "city": {"type": "string"}}}}}


def test_a_chat_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    body = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "zeta": "<z>"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "stop", "content": "never rendered"},
    ])
    ours = Tokenizer(tmp_path)
    text = ours.decode(ours.apply_chat_template(body.chat(), tools=body.template_tools()), skip_special_tokens=False)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        body.chat(), tools=body.template_tools(), tokenize=False
    )
    assert text == theirs
    assert '"parameters": {"city": "Paris", "zeta": "<z>"}' in text and "never rendered" not in text
