"""No vLLM parameter silently ignored, through the whole mesh (real processes, real NATS, the demo model) with the
openai client: what specmesh does not do is refused by name, unknown fields are logged once (or refused under
--strict-params), and truncate_prompt_tokens, logprob_token_ids, prompt_logprobs, stream usage and echo of a
token-id prompt behave as a vLLM client expects."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from services.gateway.options import bad_words_token_ids
from services.mesh_process import Mesh, start_mesh
from tests.demomeshfixture import CLIENT_TIMEOUT_S, MESH_OPTIONS, client, mesh, tokenizer  # noqa: F401

pytestmark = pytest.mark.e2e

LONG_PROMPT = "one two three four five six seven eight nine ten"
AS_IDS = "token_id:"


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["param"] == param
    return info.value.body["message"]


def _completion(client, mesh, **body):
    body = {"max_tokens": 2, "temperature": 0, "extra_body": {}} | body
    return client.completions.create(model=mesh.model, **body)


def _chat(client, mesh, **body):
    body = {"max_tokens": 2, "temperature": 0, "extra_body": {}} | body
    return client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": LONG_PROMPT}], **body)


def test_unsupported_extensions_are_refused_by_name(client, mesh) -> None:
    message = _refused(lambda: _completion(client, mesh, prompt="hi", extra_body={"use_beam_search": True}),
                       "use_beam_search")
    assert "beam search" in message
    _refused(lambda: _chat(client, mesh, extra_body={"priority": 1}), "priority")
    _refused(lambda: _completion(client, mesh, prompt="hi", n=1, best_of=2), "best_of")
    # Neutral values ask for nothing specmesh lacks: accepted.
    both = _completion(client, mesh, prompt="hi", n=2, best_of=2, extra_body={"use_beam_search": False})
    assert len(both.choices) == 2


def test_chat_template_kwargs_reach_the_template_but_may_not_set_its_own_variables(client, mesh) -> None:
    plain = _chat(client, mesh)
    # The demo model's template reads no enable_thinking: the same prompt, rendered with the variable given.
    given = _chat(client, mesh, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert given.usage.prompt_tokens == plain.usage.prompt_tokens
    message = _refused(
        lambda: _chat(client, mesh, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}),
        "chat_template_kwargs",
    )
    assert "add_generation_prompt" in message


def test_unknown_fields_are_accepted_and_logged_once(client, mesh) -> None:
    for _ in range(2):
        assert _completion(client, mesh, prompt="hi", extra_body={"not_a_field_xyz": 1}).choices[0].text
    assert sum("not_a_field_xyz" in line for line in mesh.log) == 1


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client, mesh, tokenizer) -> None:
    ids = tokenizer.encode(LONG_PROMPT)
    left = _completion(client, mesh, prompt=LONG_PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert left.usage.prompt_tokens == 3
    assert left.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    right = _completion(
        client, mesh, prompt=LONG_PROMPT, echo=True,
        extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"},
    )
    assert right.usage.prompt_tokens == 3 and right.choices[0].text.startswith(tokenizer.decode(ids[:3]))
    assert _chat(client, mesh, extra_body={"truncate_prompt_tokens": 4}).usage.prompt_tokens == 4
    # A prompt longer than the context is answered once truncated to it.
    whole = _completion(client, mesh, prompt=LONG_PROMPT * 40, extra_body={"truncate_prompt_tokens": 100})
    assert whole.usage.prompt_tokens == 100
    assert "context" in _refused(
        lambda: _completion(client, mesh, prompt="hi", extra_body={"truncate_prompt_tokens": 10_000}),
        "truncate_prompt_tokens",
    )


def _top_ids(top: dict[str, float]) -> dict[int, float]:
    return {int(name.removeprefix(AS_IDS)): logprob for name, logprob in top.items()}


def test_logprob_token_ids_score_the_named_tokens(client, mesh) -> None:
    plain = _completion(client, mesh, prompt="hi", logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    tops = [_top_ids(top) for top in plain.choices[0].logprobs.top_logprobs]
    named = list(reversed(list(tops[0])[:3]))  # the first position's top 3 (the chosen token may follow), reordered
    scored = _completion(
        client, mesh, prompt="hi", extra_body={"logprob_token_ids": named, "return_tokens_as_token_ids": True}
    )
    assert scored.choices[0].text == plain.choices[0].text
    # The named tokens in the order named, then the chosen token when it is not among them.
    first = _top_ids(scored.choices[0].logprobs.top_logprobs[0])
    assert list(first)[:3] == named and first == pytest.approx(tops[0], abs=1e-4)
    assert all(list(_top_ids(top))[:3] == named for top in scored.choices[0].logprobs.top_logprobs)

    chat = _chat(client, mesh, logprobs=True, extra_body={"logprob_token_ids": [5, 6]})
    for entry in chat.choices[0].logprobs.content:
        assert [top.token for top in entry.top_logprobs] == ["%", "&"]  # ids 5 and 6 of the demo vocabulary
    assert "equal" in _refused(
        lambda: _completion(client, mesh, prompt="hi", logprobs=1, extra_body={"logprob_token_ids": [5, 6]}),
        "logprob_token_ids",
    )
    assert "out of vocabulary" in _refused(
        lambda: _completion(client, mesh, prompt="hi", extra_body={"logprob_token_ids": [10**7]}), "logprob_token_ids"
    )


def test_allowed_token_ids_are_the_only_tokens_generated(client, mesh, tokenizer) -> None:
    allowed = sorted(set(tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)))
    options = {"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}
    greedy = _completion(client, mesh, prompt="def parse(", max_tokens=16, extra_body=options)
    sampled = _completion(client, mesh, prompt="def parse(", max_tokens=16, temperature=1.0, seed=3, extra_body=options)
    for choice in (greedy.choices[0], sampled.choices[0]):
        assert len(choice.token_ids) == 16 and set(choice.token_ids) <= set(allowed)
    chunks = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=12, stream=True,
        temperature=0.7, seed=5, extra_body=options,
    )
    streamed = [t for chunk in chunks if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids") or ()]
    assert len(streamed) == 12 and set(streamed) <= set(allowed)
    assert "out of vocabulary" in _refused(
        lambda: _completion(client, mesh, prompt="hi", extra_body={"allowed_token_ids": [10**7]}), "allowed_token_ids"
    )


def test_include_stop_str_in_output_and_skip_special_tokens_show_what_stopped_the_output(
    client, mesh, tokenizer
) -> None:
    plain = _completion(client, mesh, prompt="def parse(", max_tokens=12, extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    at = next(i for i in range(1, len(text) - 3) if text.find(text[i : i + 3]) == i and text[i : i + 3].strip())
    stop = text[at : at + 3]
    cut = _completion(client, mesh, prompt="def parse(", max_tokens=12, stop=[stop])
    kept = _completion(client, mesh, prompt="def parse(", max_tokens=12, stop=[stop],
                       extra_body={"include_stop_str_in_output": True})
    assert (cut.choices[0].text, kept.choices[0].text) == (text[:at], text[: at + 3])
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    eos = min(tokenizer.eos_token_ids)  # the only token allowed: the output stops on it at once
    stopped = {"allowed_token_ids": [eos], "include_stop_str_in_output": True}
    hidden = _completion(client, mesh, prompt="hi", max_tokens=4, extra_body=stopped)
    shown = _completion(client, mesh, prompt="hi", max_tokens=4, extra_body=stopped | {"skip_special_tokens": False})
    assert hidden.choices[0].text == "" and shown.choices[0].text == tokenizer.decode([eos], skip_special_tokens=False)
    assert shown.choices[0].finish_reason == "stop" and shown.usage.completion_tokens == 1


def test_min_tokens_passes_over_a_stop_string_ending_in_its_tokens(client, mesh, tokenizer) -> None:
    """vLLM's min_tokens: the greedy text's first occurrence of a stop string ends within the first min_tokens
    tokens and is passed over; the next one stops the output."""
    plain = _completion(client, mesh, prompt="def read_config(path):\n", max_tokens=24,
                        extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids = plain.choices[0].text, plain.choices[0].model_extra["token_ids"]
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]  # the text after each token
    for at in range(len(text) - 2):
        stop = text[at : at + 3]
        if stop.strip() and text.find(stop) == at and (following := text.find(stop, at + 1)) > 0:
            break
    min_tokens = next(i + 1 for i, end in enumerate(ends) if end >= at + len(stop))  # up to the first's last token
    assert ends[min_tokens - 1] < following + len(stop), "the next occurrence must end after min_tokens' text"
    stopped = _completion(client, mesh, prompt="def read_config(path):\n", max_tokens=24, stop=[stop],
                          extra_body={"ignore_eos": True, "min_tokens": min_tokens})
    choice = stopped.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (text[:following], "stop", stop)
    assert stopped.usage.completion_tokens > min_tokens


def test_bad_words_are_never_generated(client, mesh, tokenizer) -> None:
    options = {"ignore_eos": True, "return_token_ids": True}
    plain = _completion(client, mesh, prompt="def parse(", max_tokens=24, extra_body=options)
    word = next(w for w in plain.choices[0].text.split() if w.isalpha())  # a word the greedy text writes
    banned = _completion(client, mesh, prompt="def parse(", max_tokens=24, extra_body=options | {"bad_words": [word]})
    ids = list(banned.choices[0].token_ids)
    assert banned.choices[0].text != plain.choices[0].text
    for spelled in bad_words_token_ids([word], tokenizer):
        assert all(ids[i : i + len(spelled)] != list(spelled) for i in range(len(ids))), (word, spelled)


def test_add_special_tokens_adds_the_tokenizers_own_or_leaves_them_out(client, mesh, tokenizer) -> None:
    bos = tokenizer.encode("hi")[0]  # the special token the tokenizer puts first
    ids = {"return_token_ids": True}

    def completion_prompt(**extra) -> list[int]:
        return list(_completion(client, mesh, prompt="hi", extra_body=ids | extra).choices[0].prompt_token_ids)

    assert completion_prompt() == [bos] + completion_prompt(add_special_tokens=False)

    def chat_prompt(**extra) -> list[int]:
        return list(_chat(client, mesh, extra_body=ids | extra).prompt_token_ids)

    assert chat_prompt(add_special_tokens=True) == [bos] + chat_prompt()


def test_prompt_logprobs_sit_where_vllm_puts_them(client, mesh) -> None:
    completion = _completion(client, mesh, prompt=["hi there", "abc"], n=2, extra_body={"prompt_logprobs": 1})
    assert len(completion.choices) == 4
    assert all(choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) > 1 for choice in completion.choices)
    chat = _chat(client, mesh, n=2, extra_body={"prompt_logprobs": 1})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(not hasattr(choice, "prompt_logprobs") for choice in chat.choices)


def test_streamed_usage_only_where_asked(client, mesh) -> None:
    chunks = list(_completion(client, mesh, prompt="hi", stream=True, stream_options={"include_usage": True}))
    assert all("usage" not in chunk.model_fields_set for chunk in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].choices == []
    every = list(_completion(
        client, mesh, prompt="hi", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    ))
    assert all(chunk.usage is not None for chunk in every)
    # Without include_usage, continuous_usage_stats adds nothing: vLLM streams usage only where both are true.
    alone = list(_completion(client, mesh, prompt="hi", stream=True, stream_options={"continuous_usage_stats": True}))
    assert all("usage" not in chunk.model_fields_set for chunk in alone) and alone[-1].choices


def test_echoed_token_ids_show_their_special_tokens(client, mesh, tokenizer) -> None:
    ids = tokenizer.encode("hi")  # the tokenizer puts its special BOS first
    special = tokenizer.decode(ids[:1], skip_special_tokens=False)
    as_ids = _completion(client, mesh, prompt=ids + ids[:1], echo=True, max_tokens=1)
    assert as_ids.choices[0].text.startswith(f"{special}hi{special}")
    as_text = _completion(client, mesh, prompt="hi", echo=True, max_tokens=1)
    assert as_text.choices[0].text.startswith("hi")  # the text as sent, without the token the tokenizer added


def test_out_of_vocabulary_ids_are_worded_as_vllm_words_them(client, mesh) -> None:
    assert "Token id 9999999 is out of vocabulary" in _refused(
        lambda: _completion(client, mesh, prompt=[1, 9999999]), "prompt"
    )
    assert "out of vocabulary" in _refused(
        lambda: _completion(client, mesh, prompt="hi", logit_bias={"9999999": 1}), "logit_bias"
    )


SERVED = "org/served-name"


@pytest.fixture(scope="module")
def strict_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("strict"), *MESH_OPTIONS, "--strict-params", "--served-model-name", SERVED)
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])


def test_strict_params_refuse_unknown_fields(strict_mesh) -> None:
    strict = openai.OpenAI(base_url=strict_mesh.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    # up's --served-model-name reaches its gateway: the name it lists and serves (the module's other mesh: the dir's)
    assert [m.id for m in strict.models.list()] == [SERVED] and strict_mesh.model == SERVED
    message = _refused(lambda: _completion(strict, strict_mesh, prompt="hi", extra_body={"foo": 1}), "foo")
    assert message == "Unrecognized request argument supplied: foo"
    # vLLM's extensions, honoured or neutral, are known fields.
    known = _chat(strict, strict_mesh, extra_body={"top_k": 2, "use_beam_search": False, "request_id": "r"})
    assert known.choices[0].message.content is not None
    # So are OpenAI's own fields that change nothing a generation shows, as its SDK sends them.
    openai_fields = _chat(
        strict, strict_mesh, store=False, metadata={"team": "a"}, service_tier="auto", prompt_cache_key="k",
        safety_identifier="user-1",
    )
    assert openai_fields.choices[0].message.content is not None
