"""Prompt lists, `n`, chat as clients send it and vLLM's response extensions, through the whole mesh (real
processes, real NATS, the demo model) with the official openai client and LangChain's completions LLM."""

from __future__ import annotations

import openai
import pytest

from services.mesh_process import Mesh
from shared.seeds import choice_seed, worker_seed
from tests.demomeshfixture import client, mesh, tokenizer  # noqa: F401  (fixtures are used by name)

pytestmark = pytest.mark.e2e

PROMPTS = ["def read_config(path):\n", "import os\n"]
MAX_TOKENS = 8
SEED = -7  # negative: the API takes any int64
SAMPLED = dict(temperature=0.9, max_tokens=MAX_TOKENS, seed=SEED)
N = 3
TOKEN_ID_PREFIX = "token_id:"


def _texts(response) -> list[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def test_prompt_list_with_n_is_prompt_major_and_seeded(client: openai.OpenAI, mesh: Mesh, tokenizer) -> None:
    r = client.completions.create(model=mesh.model, prompt=PROMPTS, n=N, **SAMPLED)
    assert sorted(c.index for c in r.choices) == list(range(len(PROMPTS) * N))
    texts = _texts(r)
    # Choice i of prompt p is choice p * n + i, and samples with the seed derived for choice i (shared/seeds.py).
    for p, prompt in enumerate(PROMPTS):
        for i in range(N):
            seed = choice_seed(worker_seed(SEED), i)
            alone = client.completions.create(model=mesh.model, prompt=prompt, **(SAMPLED | dict(seed=seed)))
            assert alone.choices[0].text == texts[p * N + i], (p, i)
    assert len(set(texts[:N])) > 1, "sampled choices should differ"
    assert _texts(client.completions.create(model=mesh.model, prompt=PROMPTS, n=N, **SAMPLED)) == texts
    # The prompt is counted once per prompt, the completion tokens of every choice.
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == len(PROMPTS) * N * MAX_TOKENS
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_choices_equal_the_whole_response(client: openai.OpenAI, mesh: Mesh) -> None:
    whole = client.completions.create(model=mesh.model, prompt=PROMPTS, n=N, **SAMPLED)
    stream = client.completions.create(
        model=mesh.model, prompt=PROMPTS, n=N, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **SAMPLED,
    )
    texts = [""] * len(PROMPTS) * N
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens  # usage on every chunk
    assert texts == _texts(whole)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].usage.completion_tokens == whole.usage.completion_tokens


def test_greedy_choices_are_all_equal_on_both_endpoints(client: openai.OpenAI, mesh: Mesh) -> None:
    r = client.completions.create(model=mesh.model, prompt=PROMPTS[0], n=N, max_tokens=MAX_TOKENS, temperature=0)
    assert len(set(_texts(r))) == 1
    chat = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "a function that adds"}], n=2,
        max_tokens=MAX_TOKENS, temperature=0, logprobs=True, extra_body={"include_draft_logprobs": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert all("draft_logprobs" in c.model_extra for c in chat.choices)


def test_token_id_prompts_and_returned_token_ids(client: openai.OpenAI, mesh: Mesh, tokenizer) -> None:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    r = client.completions.create(
        model=mesh.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    for choice, prompt_ids in zip(sorted(r.choices, key=lambda c: c.index), ids):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt_ids
        assert len(extra["token_ids"]) == MAX_TOKENS and tokenizer.decode(extra["token_ids"]) == choice.text
        # logprobs 0: the chosen token only, named by its id.
        assert choice.logprobs.tokens == [f"{TOKEN_ID_PREFIX}{t}" for t in extra["token_ids"]]
        assert choice.logprobs.top_logprobs == [{t: lp} for t, lp in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs)]
    streamed = client.completions.create(
        model=mesh.model, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids[0]
    assert "prompt_token_ids" not in chunks[1].choices[0].model_extra
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == r.choices[0].model_extra["token_ids"]


def test_chat_as_clients_send_it(client: openai.OpenAI, mesh: Mesh, tokenizer) -> None:
    messages = [
        {"role": "developer", "content": "Answer in Python."},
        {"role": "user", "name": "ada", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "two"}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "3"},
        {"role": "reviewer", "content": "keep it short"},
    ]
    r = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    rendered = tokenizer.decode(r.model_extra["prompt_token_ids"])
    # developer is the system role; text parts are joined with line breaks; tool and custom roles reach the template
    # as given.
    assert "# system: Answer in Python." in rendered and "# user: add\n# two" in rendered  # the template comments lines
    assert "# tool: 3" in rendered and "# reviewer: keep it short" in rendered and rendered.endswith("# assistant:\n")
    assert tokenizer.decode(r.choices[0].model_extra["token_ids"]).startswith(r.choices[0].message.content)


def test_chat_echo_continues_the_final_message(client: openai.OpenAI, mesh: Mesh) -> None:
    start = "def add(a, b):"
    messages = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": start}]
    continued = dict(continue_final_message=True, add_generation_prompt=False)
    r = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=continued | {"echo": True},
    )
    plain = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=continued
    )
    assert r.choices[0].message.content == start + plain.choices[0].message.content
    stream = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body=continued | {"echo": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def test_langchain_openai_llm_invoke_and_batch(mesh: Mesh, client: openai.OpenAI) -> None:
    """LangChain's completions LLM sends `"prompt": [...]` even for one prompt."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        base_url=mesh.base_url, api_key="unused", model=mesh.model, max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0,
    )
    expected = [
        client.completions.create(model=mesh.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    assert llm.invoke(PROMPTS[0]) == expected[0]
    assert llm.batch(PROMPTS) == expected
