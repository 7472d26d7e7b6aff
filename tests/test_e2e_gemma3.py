"""A Gemma 3 checkpoint through the whole mesh (`specmesh up` on its defaults: ngram drafts, prefix caching, chunked
prefill; real processes and NATS, the openai client): greedy text over a context of many sliding windows equals
transformers' generate, whole and streamed, and a chat in Gemma's turn format renders and is answered. A tiny random
Gemma 3 (a sliding layer and a full one) with this project's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from services.mesh_process import Mesh
from shared.tokenizer import Tokenizer
from tests.demomeshfixture import client_of, running_mesh
from tests.methodfixture import PROMPT_TEXTS
from tests.modelfixture import MISTRAL_WINDOW, make_tiny_model_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

CONTROL_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Written for this test after Gemma's turn format: a system message opens the first user turn, the assistant is
# "model".
TEMPLATE = (
    "{% set first = 0 %}{% set system = '' %}"
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content + '\\n\\n' %}{% set first = 1 %}"
    "{% endif %}{% for message in messages[first:] %}"
    "<start_of_turn>{{ 'model' if message.role == 'assistant' else message.role }}\n"
    "{{ system if loop.first else '' }}{{ message.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PROMPT = "".join(PROMPT_TEXTS)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", CONTROL_TOKENS, TEMPLATE)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Mesh]:
    yield from running_mesh(tmp_path_factory, "--max-num-seqs", "4", model=model)


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return client_of(mesh)


def _transformers_text(model: Path, prompt: list[int]) -> str:
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
    return Tokenizer(model).decode(out[0, len(prompt):].tolist())


def test_greedy_text_is_transformers_whole_and_streamed(client: openai.OpenAI, mesh: Mesh, model: Path) -> None:
    prompt = Tokenizer(model).encode(PROMPT)
    assert len(prompt) + MAX_TOKENS > 4 * MISTRAL_WINDOW
    expected = _transformers_text(model, prompt)
    request = dict(model=mesh.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**request)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(prompt)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **request)
                       if chunk.choices)
    assert streamed == expected


def test_a_chat_in_gemmas_turns_is_answered(client: openai.OpenAI, mesh: Mesh, model: Path) -> None:
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "a loop"}]
    reply = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    rendered = "<start_of_turn>user\nAnswer in code.\n\na loop<end_of_turn>\n<start_of_turn>model\n"
    assert reply.usage.prompt_tokens == len(Tokenizer(model).encode(rendered, add_special_tokens=False))
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
