"""Penalties, logit_bias, min_tokens, min_p and per-request speculation through the whole mesh (`specmesh up` with
ngram drafts, the demo model), driven by the official openai client: greedy text under penalties equals a
step-by-step reference from transformers' logits and does not depend on the request's own number of drafts, and a
request that asks for its speculation summary finds it in `usage.speculative`, streamed or not, consistent with the
drafts its draft_logprobs list."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from services.mesh_process import Mesh, start_mesh
from shared.config import SpeculativeConfig
from shared.tokenizer import Tokenizer
from tests.test_e2e import E2E_MODEL, REPETITIVE
from tests.test_penalties import reference_tokens
from tests.threadfixture import one_torch_thread

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")

SERVER_DRAFTS = 3
MAX_TOKENS = 24
APIS = ("chat", "completion")
PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05)
MIN_TOKENS = 6
SPECULATIVE_KEYS = {
    "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "mean_acceptance_length",
    "draft_acceptance_rate", "num_draft_tokens_per_position", "num_accepted_tokens_per_position",
    "acceptance_rate_per_position", "acceptance_histogram",
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # Fixed drafts per step: adaptive speculation would choose them from step timings, and a busy machine could leave
    # a short request with no accepted draft to count.
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=SERVER_DRAFTS, adaptive=False).model_dump_json()
    m = start_mesh(
        tmp_path_factory.mktemp("mesh"), "--max-num-seqs", "4", "--max-model-len", "512",
        "--speculative-config", config, model=E2E_MODEL,
    )
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(E2E_MODEL)


@pytest.fixture(scope="module")
def reference_model():
    return transformers.AutoModelForCausalLM.from_pretrained(E2E_MODEL, dtype=torch.float32).eval()


def _reference(model, prompt: list[int], sampling: dict, stop_ids: set[int]) -> list[int]:
    """reference_tokens on one torch thread: the mesh's processes use the other core."""
    with one_torch_thread():
        return reference_tokens(model, prompt, sampling, MAX_TOKENS, stop_ids)


def _prompt_ids(tokenizer: Tokenizer, api: str) -> list[int]:
    if api == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": REPETITIVE}])
    return tokenizer.encode(REPETITIVE)


def _create(client: openai.OpenAI, mesh: Mesh, api: str, stream: bool = False, **body):
    extra = body.pop("extra_body", {})
    common = dict(model=mesh.model, max_tokens=MAX_TOKENS, temperature=0, stream=stream, extra_body=extra) | body
    if api == "chat":
        return client.chat.completions.create(messages=[{"role": "user", "content": REPETITIVE}], **common)
    return client.completions.create(prompt=REPETITIVE, **common)


def _text(response, api: str) -> str:
    choice = response.choices[0]
    return choice.message.content if api == "chat" else choice.text


@pytest.mark.parametrize("api", APIS)
def test_greedy_text_with_penalties_is_the_reference_whatever_the_drafts(
    client: openai.OpenAI, mesh: Mesh, tokenizer: Tokenizer, reference_model, api: str
) -> None:
    prompt = _prompt_ids(tokenizer, api)
    plain = _reference(reference_model, prompt, {}, set())
    # The bias bans the plain greedy text's third token; min_tokens keeps EOS out for a while.
    sampling = dict(PENALTIES, logit_bias={plain[2]: -100.0}, min_tokens=MIN_TOKENS)
    expected = _reference(reference_model, prompt, sampling, set(tokenizer.eos_token_ids))
    assert expected != plain
    api_sampling = dict(sampling, logit_bias={str(plain[2]): -100.0})
    texts = {
        drafts: _text(_create(client, mesh, api, extra_body=dict(api_sampling, **speculative)), api)
        for drafts, speculative in (("server", {}), ("one", {"speculative": {"num_speculative_tokens": 1}}),
                                    ("none", {"speculative": {"num_speculative_tokens": 0}}))
    }
    assert set(texts.values()) == {tokenizer.decode(expected)}, texts


def _summary(response) -> dict:
    return response.usage.model_extra["speculative"]


def _check_summary(summary: dict, max_drafts: int) -> None:
    assert set(summary) == SPECULATIVE_KEYS
    drafted, accepted = summary["num_draft_tokens_per_position"], summary["num_accepted_tokens_per_position"]
    assert len(drafted) <= max_drafts and len(accepted) == len(drafted)
    assert sum(drafted) == summary["num_draft_tokens"] and sum(accepted) == summary["num_accepted_draft_tokens"]
    assert sum(summary["acceptance_histogram"]) == summary["num_spec_steps"]
    assert all(a <= d for a, d in zip(accepted, drafted)) and list(drafted) == sorted(drafted, reverse=True)
    steps = summary["num_spec_steps"]
    if steps:
        assert summary["mean_acceptance_length"] == pytest.approx(1 + summary["num_accepted_draft_tokens"] / steps)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_a_request_gets_its_own_speculation_summary(client: openai.OpenAI, mesh: Mesh, api: str, stream: bool) -> None:
    """Asked for alone (no include_usage), the summary still comes: in the usage, on the stream's usage chunk; its
    counts are those of the draft entries draft_logprobs lists."""
    extra = {"speculative": {"return_stats": True}, "include_draft_logprobs": True, "ignore_eos": True}
    logprobs = dict(logprobs=True, top_logprobs=1) if api == "chat" else dict(logprobs=1)
    response = _create(client, mesh, api, stream, extra_body=extra, **logprobs)
    chunks = list(response) if stream else [response]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1
    summary = usages[0].model_extra["speculative"]
    _check_summary(summary, SERVER_DRAFTS)
    drafts = []
    for chunk in chunks[1:] if api == "chat" and stream else chunks:  # the gateway's role chunk carries no tokens
        for choice in chunk.choices:
            draft = choice.model_extra["draft_logprobs"]
            drafts += [e["accepted"] for e in draft["content"]] if api == "chat" else draft["accepted"]
    assert summary["num_draft_tokens"] == len(drafts) > 0
    assert summary["num_accepted_draft_tokens"] == sum(drafts) > 0


@pytest.mark.parametrize("api", APIS)
def test_the_number_of_drafts_is_the_requests_own(client: openai.OpenAI, mesh: Mesh, api: str) -> None:
    def summary(**speculative) -> dict:
        extra = {"speculative": {"return_stats": True, **speculative}, "ignore_eos": True}
        return _summary(_create(client, mesh, api, extra_body=extra))

    server, one, none = summary(), summary(num_speculative_tokens=1), summary(num_speculative_tokens=0)
    _check_summary(server, SERVER_DRAFTS)
    assert len(server["num_draft_tokens_per_position"]) > 1
    _check_summary(one, 1)
    assert one["num_draft_tokens"] > 0
    assert none["num_draft_tokens"] == none["num_spec_steps"] == 0 and none["mean_acceptance_length"] == 1.0
    plain = _create(client, mesh, api, extra_body={"ignore_eos": True})
    assert "speculative" not in (plain.usage.model_extra or {})


def test_more_drafts_than_the_server_makes_is_a_400(client: openai.OpenAI, mesh: Mesh) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, mesh, "completion", extra_body={"speculative": {"num_speculative_tokens": SERVER_DRAFTS + 1}})
    assert info.value.param == "speculative.num_speculative_tokens"
    assert str(SERVER_DRAFTS + 1) in info.value.body["message"]


PREDICTED_MESSAGES = [{"role": "user", "content": "Write a function that parses a config file."}]
PREDICTED_TOKENS = 48


def test_a_prediction_keeps_the_answer_takes_fewer_steps_and_is_counted_in_usage(
    client: openai.OpenAI, mesh: Mesh, tokenizer: Tokenizer
) -> None:
    """OpenAI's predicted outputs: the answer rewritten from its own text, as a client edits a file."""
    request = dict(
        model=mesh.model, messages=PREDICTED_MESSAGES, max_tokens=PREDICTED_TOKENS, temperature=0,
        extra_body={"speculative": {"return_stats": True}},
    )
    plain = client.chat.completions.create(**request)
    text = plain.choices[0].message.content
    prediction = {"type": "content", "content": text}
    predicted = client.chat.completions.create(**request, prediction=prediction)
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    predicted_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted_tokens
    assert details.accepted_prediction_tokens >= 0.9 * predicted.usage.completion_tokens
    # Every step verifies 3 drafts the answer follows, where prompt lookup finds fewer.
    assert _summary(predicted)["mean_acceptance_length"] > max(2.5, _summary(plain)["mean_acceptance_length"])
    assert plain.usage.completion_tokens_details is None
    streamed = client.chat.completions.create(
        **request, prediction=prediction, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details == details
    # With n, each choice counts against the prediction and usage sums them (greedy: two equal answers).
    both = client.chat.completions.create(**request, prediction=prediction, n=2).usage.completion_tokens_details
    assert (both.accepted_prediction_tokens, both.rejected_prediction_tokens) == (
        2 * details.accepted_prediction_tokens, 2 * details.rejected_prediction_tokens
    )
    empty = client.chat.completions.create(**request, prediction={"type": "content", "content": ""})
    assert empty.choices[0].message.content == text
    assert (empty.usage.completion_tokens_details.accepted_prediction_tokens,
            empty.usage.completion_tokens_details.rejected_prediction_tokens) == (0, 0)  # as OpenAI counts it
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request, prediction={"type": "file", "content": text})
    assert info.value.param == "prediction.type"
