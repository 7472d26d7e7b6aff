"""Magistral's reasoning (`--reasoning-parser mistral`) through the whole mesh: its [THINK] and [/THINK] are control
tokens, which generated text leaves out, so a request read for reasoning has its detokenizer keep them; the block is
set apart as `reasoning`, whole, streamed and in a Responses reasoning item, and an output constraint holds after it,
its grammar matching the tags as tokens. A tiny random Mistral: under a constraint, logit_bias opens the block and
soon closes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import llguidance
import openai
import pytest

from services.gateway.reasoning.parser import FORMATS
from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from tests.demomeshfixture import client_of
from tests.modelfixture import make_tiny_model_dir

pytestmark = pytest.mark.e2e

MISTRAL = FORMATS["mistral"]
CONTROL_TOKENS = ("[INST]", "[/INST]", MISTRAL.open_tag, MISTRAL.close_tag)
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
REPORT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-magistral"), "mistral", CONTROL_TOKENS, TEMPLATE)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("mesh"), "--max-num-seqs", "4", "--reasoning-parser", "mistral",
                   model=model)
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return client_of(mesh)


def _follows(model_dir: Path, structured: StructuredOutput, token_ids: list[int]) -> bool:
    tokenizer = Tokenizer(model_dir)
    ll = ll_tokenizer(model_dir, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    matcher = llguidance.LLMatcher(ll, grammar_of(structured), log_level=0)
    return all(matcher.consume_token(t) for t in token_ids) and matcher.is_accepting()


def test_the_constraint_after_the_block_matches_its_tags_as_tokens_or_as_text(model: Path) -> None:
    tokenizer = Tokenizer(model)
    fmt = MISTRAL.for_tokenizer(tokenizer.special_tokens)
    think, done = fmt.tag_ids
    assert think is not None and done is not None and fmt.shown_special_ids == (think, done)
    constraint = StructuredOutput(kind="json_schema", spec=json.dumps(REPORT), think_first="may_open",
                                  think_tags=fmt.grammar_tags)
    text = tokenizer.encode("a thought\nand more", add_special_tokens=False)
    answer = tokenizer.encode('{"a":1}', add_special_tokens=False)
    assert _follows(model, constraint, [think, *text, done, *answer])
    assert _follows(model, constraint, [think, done, *answer]) and _follows(model, constraint, answer)
    assert not _follows(model, constraint, [think, think, done, *answer])  # a control token is no thought
    # A tokenizer without the control tokens (the demo's): the tags are text, read as <think> is.
    demo = Tokenizer(DEFAULT_MODEL_DIR)
    as_text = MISTRAL.for_tokenizer(demo.special_tokens)
    assert as_text.grammar_tags == ("[THINK]", "[/THINK]") and as_text.shown_special_ids == ()
    written = demo.encode('[THINK]hm[/THINK]\n{"a":1}', add_special_tokens=False)
    assert _follows(DEFAULT_MODEL_DIR, constraint.model_copy(update={"think_tags": as_text.grammar_tags}), written)


def _think_briefly(tokenizer: Tokenizer) -> dict[str, float]:
    """[THINK] first (the grammar lets it open the answer only), then [/THINK] likely within a few tokens."""
    think, done = MISTRAL.for_tokenizer(tokenizer.special_tokens).tag_ids
    return {str(think): 100.0, str(done): 4.5}


def test_an_answer_inside_the_block_is_reasoning_whole_and_streamed(mesh: Mesh, client: openai.OpenAI) -> None:
    """The answer goes on from an assistant message that opened the block (continue_final_message): all of it is
    reasoning until [/THINK], which this one does not reach."""
    params = dict(
        model=mesh.model, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "[THINK]I"}],
        max_tokens=6, temperature=1.0, seed=5,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    whole = client.chat.completions.create(**params).choices[0].message
    reasoning = whole.model_extra.get("reasoning")
    assert reasoning and whole.content is None, whole
    streamed_reasoning = streamed_content = ""
    for chunk in client.chat.completions.create(**params, stream=True):
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, "")


def test_an_output_constraint_holds_after_the_block(mesh: Mesh, client: openai.OpenAI, model: Path) -> None:
    bias = _think_briefly(Tokenizer(model))
    answer = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "hi"}], max_tokens=48, temperature=1.0, seed=5,
        logit_bias=bias, response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}},
    ).choices[0].message
    assert answer.model_extra.get("reasoning") and set(json.loads(answer.content)) == {"a"}, answer
    response = client.responses.create(
        model=mesh.model, input="hi", max_output_tokens=48, temperature=1.0, extra_body={"seed": 5, "logit_bias": bias},
        text={"format": {"type": "json_schema", "name": "report", "schema": REPORT}},
    )
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text == answer.model_extra["reasoning"]
    assert message.content[0].text == answer.content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens


def test_tags_the_block_does_not_own_are_left_out(mesh: Mesh, client: openai.OpenAI, model: Path) -> None:
    """The detokenizer keeps the tags for the parser alone: stray ones (here [/THINK] with no block, forced by the
    bias) never reach the answer, as they do not without the parser."""
    done = MISTRAL.for_tokenizer(Tokenizer(model).special_tokens).tag_ids[1]
    message = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={str(done): 100.0},
    ).choices[0].message
    assert not message.content and not (message.model_extra or {}).get("reasoning"), message


def test_thinking_token_budget_closes_the_block_after_that_many_tokens(mesh: Mesh, client: openai.OpenAI,
                                                                       model: Path) -> None:
    """The answer goes on inside a block its last message opened, the model kept from closing it (logit_bias): the
    budget closes it after 3 tokens, the rest is content, streamed as whole."""
    done = MISTRAL.for_tokenizer(Tokenizer(model).special_tokens).tag_ids[1]
    params = dict(
        model=mesh.model, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "[THINK]"}],
        max_tokens=10, temperature=0, logit_bias={str(done): -100.0},
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "thinking_token_budget": 3,
                    "return_token_ids": True, "ignore_eos": True},
    )
    choice = client.chat.completions.create(**params).choices[0]
    assert list(choice.token_ids).index(done) == 3
    reasoning, content = choice.message.model_extra.get("reasoning"), choice.message.content
    assert reasoning and content
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**params, stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in streamed) == reasoning
    assert "".join(d.content or "" for d in streamed) == content
    unbudgeted = client.chat.completions.create(**{**params, "extra_body": {**params["extra_body"],
                                                                            "thinking_token_budget": None}})
    assert done not in unbudgeted.choices[0].token_ids and unbudgeted.choices[0].message.content is None


def test_thinking_token_budget_is_refused_where_there_is_no_block_to_hold(mesh: Mesh, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=mesh.model, prompt="hi", max_tokens=2,
                                  extra_body={"thinking_token_budget": 3})
    assert info.value.body["param"] == "thinking_token_budget" and "completion" in info.value.body["message"]
