"""Prefix caching through the whole mesh (`specmesh up` on its defaults, the demo model), driven by the official
openai client: a prompt sent again is served from the worker's cache, as `usage.prompt_tokens_details.cached_tokens`
says, streamed or not, with the same text and logprobs; `cache_salt` keeps requests apart, and an empty one is
refused by name."""

from __future__ import annotations

import openai
import pytest

from shared.config import EngineConfig
from tests.demomeshfixture import client, mesh, tokenizer  # noqa: F401  (fixtures are used by name)

pytestmark = pytest.mark.e2e

BLOCK_SIZE = EngineConfig.model_fields["block_size"].default
# Text no other test of the session sends, so that the first request finds nothing cached.
PROMPT = (
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n"
    "        self.entries = {}\n\n    def get(self, key):\n"
)
MAX_TOKENS = 16
LOGPROB_TOLERANCE = 1e-4


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_a_prompt_sent_again_is_served_from_the_cache(client: openai.OpenAI, mesh, tokenizer) -> None:  # noqa: F811
    prompt_len = len(tokenizer.encode(PROMPT))
    full_blocks = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert full_blocks >= 2 * BLOCK_SIZE
    answers = [
        client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
        for _ in range(2)
    ]
    assert [_cached(a.usage) for a in answers] == [0, full_blocks]
    assert answers[0].choices[0].text == answers[1].choices[0].text
    cold, hot = (a.choices[0].logprobs.token_logprobs for a in answers)
    assert hot == pytest.approx(cold, abs=LOGPROB_TOLERANCE)

    stream = client.completions.create(
        model=mesh.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert _cached(chunks[-1].usage) == full_blocks
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answers[0].choices[0].text


def test_a_chat_turn_finds_the_conversation_so_far_cached(client: openai.OpenAI, mesh) -> None:  # noqa: F811
    messages = [{"role": "user", "content": PROMPT + "# what does get return for a missing key?"}]
    first = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and put?"},
    ]
    second = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=4, temperature=0)
    assert _cached(second.usage) >= first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_a_salt_keeps_requests_apart(client: openai.OpenAI, mesh) -> None:  # noqa: F811
    prompt = PROMPT + "# salted\n"

    def cached(salt: str) -> int:
        answer = client.completions.create(
            model=mesh.model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return _cached(answer.usage)

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") > 0


def test_an_empty_salt_is_refused_by_name(client: openai.OpenAI, mesh) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt"
