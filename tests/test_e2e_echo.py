"""echo and prompt logprobs through the whole mesh (real processes, real NATS, the demo model) with the openai client:
OpenAI's completions echo, vLLM's prompt_logprobs on both endpoints, and lm-eval's loglikelihood requests read as
lm-eval reads them, every number checked against the model's logprobs computed directly with transformers."""

from __future__ import annotations

from operator import itemgetter

import pytest
import torch

from services.detokenizer.incremental import TokenTable
from shared.config import DEFAULT_MODEL_DIR
from tests.demomeshfixture import client, mesh, tokenizer  # noqa: F401  (fixtures are used by name)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

TOLERANCE = 1e-3
PROMPT = "def read_config(path):\n    with open(path) as f:\n"
LM_EVAL_SEED = 1234
# (context, continuation) pairs as an lm-eval loglikelihood task poses them: a likely one and an unlikely one.
PAIRS = [("import os\nimport sys\nimport", " sys"), ("def add(a, b):\n    return", " banana split")]


@pytest.fixture(scope="module")
def reference():
    """log_softmax of transformers' logits [P-1, vocab] at prompt positions 0..P-2: what token i+1 is scored by."""
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    return logprobs


def check_against(
    reference_rows: torch.Tensor, prompt: list[int], token_logprobs: list, top_logprobs: list, k: int
) -> None:
    """Echo entries of a prompt: the first null, every other the model's logprob of the token and of its top k, the
    token itself listed after them when it is not among them."""
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for i, (logprob, top) in enumerate(zip(token_logprobs[1:], top_logprobs[1:])):
        assert logprob == pytest.approx(reference_rows[i, prompt[i + 1]].item(), abs=TOLERANCE)
        values = list(top.values())
        assert values[:k] == pytest.approx(reference_rows[i].topk(k).values.tolist(), abs=TOLERANCE)
        assert values[k:] in ([], [logprob])


def test_echo_with_logprobs_whole_and_streamed(client, mesh, tokenizer, reference) -> None:
    prompt = tokenizer.encode(PROMPT)
    common = dict(model=mesh.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=8, temperature=0)
    whole = client.completions.create(**common).choices[0]
    assert whole.text.startswith(PROMPT) and len(whole.text) > len(PROMPT)
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > len(prompt)
    rows = reference(prompt)
    check_against(rows, prompt, lp.token_logprobs[: len(prompt)], lp.top_logprobs[: len(prompt)], k=2)
    assert lp.text_offset[: len(prompt)] == [len(tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
    assert lp.text_offset[len(prompt)] == len(PROMPT)  # the first generated token starts after the prompt
    assert "".join(lp.tokens[len(prompt) :]) == whole.text[len(PROMPT) :]

    chunks = list(client.completions.create(stream=True, **common))
    assert chunks[0].choices[0].text.startswith(PROMPT[:8])
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    # The generated tokens' logprobs come from passes whose shapes follow adaptive speculation's draft counts, so
    # the float32 matmuls behind them may differ in their last bits between the two requests.
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, mesh, tokenizer) -> None:
    r = client.completions.create(model=mesh.model, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tokenizer.encode(PROMPT)), 0)
    plain = client.completions.create(model=mesh.model, prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_prompt_logprobs_as_vllm_returns_them(client, mesh, tokenizer, reference) -> None:
    prompt = tokenizer.encode(PROMPT)
    r = client.completions.create(
        model=mesh.model, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    shown = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].text and not r.choices[0].text.startswith(PROMPT)  # no echo
    assert len(shown) == len(prompt) and shown[0] is None
    rows = reference(prompt)
    table = TokenTable.from_tokenizer(tokenizer)
    for i, entry in enumerate(shown[1:]):
        token = prompt[i + 1]
        assert str(token) in entry and 3 <= len(entry) <= 4  # the top-3, and the prompt token unless among them
        assert entry[str(token)]["rank"] == int((rows[i] > rows[i, token]).sum()) + 1
        assert sorted(value["rank"] for value in entry.values())[:3] == [1, 2, 3]
        for token_id, value in entry.items():
            assert value["logprob"] == pytest.approx(rows[i, int(token_id)].item(), abs=TOLERANCE)
            assert value["decoded_token"] == table.display(int(token_id))[0]

    chat = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "read a config file"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 0},
    )
    shown = chat.model_extra["prompt_logprobs"]
    assert "prompt_logprobs" not in chat.choices[0].model_extra
    assert len(shown) == chat.usage.prompt_tokens and shown[0] is None and all(len(e) == 1 for e in shown[1:])


def lm_eval_parse_logprobs(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs (lm_eval/models/openai_completions.py), restated: the continuation
    is every echoed token after the context but the generated one; greedy when each is its position's top one."""
    result = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(logprob == max(top.values()) for logprob, top in zip(token_logprobs, top_logprobs))
        result.append((sum(token_logprobs), is_greedy))
    return result


def test_lm_eval_loglikelihood_requests_work_unchanged(client, mesh, tokenizer, reference) -> None:
    """lm-eval's local-completions loglikelihood payload (tokenized requests, a batch of two), read as lm-eval reads
    it, gives the continuations' log-likelihoods and greediness computed from the model directly."""
    inputs, ctxlens = [], []
    for context, continuation in PAIRS:  # lm-eval's tokenization of a pair: the context, then the rest of the whole
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        inputs.append(whole)
        ctxlens.append(len(context_ids))
    payload = {"model": mesh.model, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": LM_EVAL_SEED, "echo": True}
    outputs = client.completions.create(**payload).model_dump()
    parsed = lm_eval_parse_logprobs(outputs, ctxlens)

    for (loglikelihood, is_greedy), ids, ctxlen in zip(parsed, inputs, ctxlens):
        rows = reference(ids)
        targets = torch.tensor(ids[ctxlen:])
        expected = rows[ctxlen - 1 :].gather(1, targets[:, None]).sum().item()
        assert loglikelihood == pytest.approx(expected, abs=TOLERANCE)
        assert is_greedy == bool((rows[ctxlen - 1 :].argmax(dim=-1) == targets).all())
    assert [greedy for _, greedy in parsed] == [True, False]

    # The same with nothing generated (max_tokens 0): every echoed token after the context is the continuation.
    scored = client.completions.create(**(payload | {"max_tokens": 0})).model_dump()
    for choice, (loglikelihood, _), ctxlen in zip(scored["choices"], parsed, ctxlens):
        assert sum(choice["logprobs"]["token_logprobs"][ctxlen:]) == pytest.approx(loglikelihood, abs=1e-5)


def test_every_choice_of_every_prompt_echoes_its_prompt(client, mesh, tokenizer, reference) -> None:
    prompts = [PROMPT, "import os\n"]
    r = client.completions.create(
        model=mesh.model, prompt=prompts, n=2, echo=True, logprobs=1, max_tokens=4, temperature=1.0, seed=7,
        extra_body={"prompt_logprobs": 1},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice in r.choices:
        text = prompts[choice.index // 2]
        ids = tokenizer.encode(text)
        assert choice.text.startswith(text)
        check_against(reference(ids), ids, choice.logprobs.token_logprobs[: len(ids)],
                      choice.logprobs.top_logprobs[: len(ids)], k=1)
        assert len(choice.model_extra["prompt_logprobs"]) == len(ids)
