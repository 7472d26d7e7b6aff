"""--reasoning-parser through the whole mesh with the real openai client: `specmesh up --reasoning-parser deepseek_r1`
on the demo model, whose prompt is taken to open the <think> block. The demo model never closes it, so its whole
answer is reasoning: whole and streamed answers carry it in `reasoning` and `reasoning_content` with no content,
include_reasoning false leaves it out, an output constraint holds only after the block (the model thinks freely
first), an earlier answer's reasoning goes back into the conversation, and a continued message goes on as content.
How answers that close the block split, and the constraint after it, are tested without a model
(tests/test_reasoning.py)."""

from __future__ import annotations

import openai
import pytest

from services.mesh_process import Mesh
from tests.demomeshfixture import client_of, running_mesh

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Describe the weather in Paris as a record."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    yield from running_mesh(tmp_path_factory, "--max-num-seqs", "4", "--max-model-len", "512",
                            "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return client_of(mesh)


def _create(client: openai.OpenAI, mesh: Mesh, **body):
    return client.chat.completions.create(
        model=mesh.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **body
    )


def test_an_answer_inside_its_block_is_reasoning_whole_and_streamed(mesh: Mesh, client: openai.OpenAI) -> None:
    whole = _create(client, mesh).choices[0]
    reasoning = whole.message.model_extra["reasoning"]
    assert reasoning and whole.message.model_extra["reasoning_content"] == reasoning
    assert whole.message.content is None and whole.finish_reason == "length"
    streamed, content = "", ""
    for chunk in _create(client, mesh, stream=True):
        if chunk.choices:
            streamed += (chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""
            content += chunk.choices[0].delta.content or ""
    assert (streamed, content) == (reasoning, "")
    hidden = _create(client, mesh, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning" not in (hidden.model_extra or {}) and hidden.content is None
    # The reasoning goes back into the conversation, as the chat template reads it.
    again = client.chat.completions.create(
        model=mesh.model, messages=MESSAGES + [whole.message.model_dump(exclude_none=True)], max_tokens=2
    )
    assert again.choices[0].message.model_extra["reasoning"]


def test_a_constraint_holds_after_the_reasoning_not_from_the_first_token(mesh: Mesh, client: openai.OpenAI) -> None:
    constrained = _create(client, mesh, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    # The block never closes, so the answer the choice constrains never begins: the model thought freely.
    thought = constrained.message.model_extra["reasoning"]
    assert constrained.finish_reason == "length" and constrained.message.content is None
    assert thought not in ("yes", "no") and len(thought) > len("yes")


def test_a_continued_message_goes_on_as_content_not_in_the_block_a_new_answer_opens(
    mesh: Mesh, client: openai.OpenAI
) -> None:
    """continue_final_message: the answer goes on from the message (one that left a block open goes on inside it:
    tests/test_reasoning.py; the demo template renders no assistant message with a block as written)."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The weather in Paris is"}]
    answer = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    ).choices[0].message
    assert answer.content and "reasoning" not in (answer.model_extra or {})


def test_a_response_carries_the_reasoning_as_its_reasoning_item(mesh: Mesh, client: openai.OpenAI) -> None:
    """POST /v1/responses: the thinking is a `reasoning` item, every token of it counted as reasoning (the demo model
    never closes the block), and the stream's reasoning_text deltas add up to it."""
    asked = dict(model=mesh.model, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0)
    response = client.responses.create(**asked)
    chat = _create(client, mesh).choices[0].message
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text == chat.model_extra["reasoning"]
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == MAX_TOKENS
    events = list(client.responses.create(**asked, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text
    assert events[-1].response.output[0].content[0].text == deltas


def test_a_responses_text_logprobs_are_its_texts_tokens(mesh: Mesh, client: openai.OpenAI) -> None:
    """The tokens of the closing tag are the reasoning's (counted in reasoning_tokens), not the output text's: the
    text's logprobs spell the text. The bias makes the demo model write `</think>` early (its tokens 2613 395 958
    30), then go on as the answer."""
    response = client.responses.create(
        model=mesh.model, input="hi", max_output_tokens=12, temperature=0, include=["message.output_text.logprobs"],
        extra_body={"logit_bias": {"2613": 10, "395": 10, "958": 10, "30": 10}},
    )
    reasoning, message = response.output
    entries = message.content[0].logprobs
    assert (reasoning.type, message.type) == ("reasoning", "message")
    assert "".join(e.token for e in entries).lstrip("\n") == message.content[0].text
    usage = response.usage
    assert usage.output_tokens_details.reasoning_tokens + len(entries) == usage.output_tokens
