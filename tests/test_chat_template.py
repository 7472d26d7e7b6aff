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


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] | trim }}\n{% endfor %}"
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("template", [TEMPLATE, CHATML, TRIMMING], ids=["calls", "chatml", "trimming"])
@pytest.mark.parametrize("final", [
    {"content": "The answer is "},  # its trailing space kept where the template keeps it
    {"content": "end"},  # also a piece of the end-of-turn mark after it
    {"content": "<"},
    {"content": "Paris", "tool_calls": [CALL]},  # the calls the template writes after the content are not continued
], ids=["trailing-space", "end", "angle", "with-calls"])
def test_continue_final_message_cuts_where_transformers_cuts(tmp_path: Path, template: str, final: dict) -> None:
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", **final}],
        tools=[WEATHER], continue_final_message=True, add_generation_prompt=False,
    )
    ours = Tokenizer(tmp_path)
    text = ours.decode(ours.apply_chat_template(body.chat(), False, True, body.template_tools()),
                       skip_special_tokens=False)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        body.chat(), tools=body.template_tools(), continue_final_message=True, add_generation_prompt=False,
        tokenize=False,
    )
    assert text == theirs


def test_an_assistants_refusal_parts_are_its_text() -> None:
    """OpenAI's assistant messages hold text and refusal parts; both reach the template as the message's text."""
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"}, {"type": "text", "text": "."}]},
        {"role": "user", "content": "ok"},
    ])
    assert body.chat()[1]["content"] == "I cannot\n."
