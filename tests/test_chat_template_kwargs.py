"""A request's chat_template_kwargs are variables of the chat template: they change what it renders; the ones the
template gets from the request or the model cannot be set through them (tests/test_e2e_params.py checks the 400)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import TOKENIZER_FILE, Tokenizer
from services.gateway.chat_request import ChatCompletionRequest

GREETING_TEMPLATE = "{% if greeting %}{{ greeting }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_the_variables_reach_the_template(tmp_path: Path) -> None:
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": GREETING_TEMPLATE}))
    tokenizer = Tokenizer(tmp_path)
    messages = [{"role": "user", "content": "import os\n"}]
    assert tokenizer.decode(tokenizer.apply_chat_template(messages)) == "import os\n"
    greeted = tokenizer.apply_chat_template(messages, template_kwargs={"greeting": "# hello\n"})
    assert tokenizer.decode(greeted) == "# hello\nimport os\n"
    # The template is compiled once and rendered for every request: nothing of one render stays for the next.
    assert tokenizer.decode(tokenizer.apply_chat_template(messages)) == "import os\n"
    # A variable named as one of the renderer's own parameters is a variable, not a clash (it was a 500)
    assert tokenizer.decode(tokenizer.apply_chat_template(messages, template_kwargs={"self": 1})) == "import os\n"


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "bos_token"])
def test_the_templates_own_variables_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={name: 1})
