"""Every drafting method through the whole mesh with the official openai client: draft_logprobs are present and
well formed for chat and completions, streamed and not; a seeded request streams the text it returns whole; and
greedy text is the same whatever the method (speculation is lossless). One NATS, detokenizer and gateway for all,
and a worker per method."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from services.detokenizer.logprobs import MIN_LOGPROB
from tests.methodfixture import METHOD_NAMES, METHODS
from tests.partsfixture import Parts, running_parts
from tests.test_e2e import E2E_MODEL, REPETITIVE, whole_and_streamed

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
CLIENT_TIMEOUT_S = 120
MODEL = E2E_MODEL.name
TOP_LOGPROBS = 2
NGRAM_LOGPROB = 0.0  # an n-gram or suffix draft is a point mass under q
LOGPROB_TOLERANCE = 1e-5
APIS = ("chat", "completion")
# Suffix decoding drafts from earlier requests' outputs, so a repeated request gets other drafts, and under the
# default rejection strategy the tokens emitted depend on the drafts: the same seed can give another text.
# Greedy texts by (api, stream), filled under the first method and compared with every later one's.
_GREEDY_TEXTS: dict[tuple[str, bool], str] = {}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    """NATS, a detokenizer and a gateway for every method: only the worker differs between methods."""
    with running_parts(tmp_path_factory.mktemp("nats")) as parts:
        yield parts


@pytest.fixture(scope="module", params=METHOD_NAMES)
def method(request: pytest.FixtureRequest, parts: Parts) -> Iterator[str]:
    """A worker drafting with the method, the only one serving while the method's tests run."""
    worker = parts.start(
        "worker", "--max-num-seqs", "4", "--max-model-len", "512",
        "--speculative-config", METHODS[request.param].config().model_dump_json(),
    )
    yield request.param
    assert worker.terminate() == 0


@pytest.fixture(scope="module")
def client(parts: Parts) -> openai.OpenAI:
    return parts.client.with_options(timeout=CLIENT_TIMEOUT_S)


def _generate(client: openai.OpenAI, api: str, stream: bool, **sampling) -> tuple[str, list[dict], list[dict]]:
    """Text, target logprob entries and draft entries (as {token, logprob, top: [(token, logprob)], accepted,
    text_offset}) of a request on a repetitive prompt, whichever API and mode; greedy unless sampling says."""
    extra = dict(extra_body={"include_draft_logprobs": True, "ignore_eos": True})
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, stream=stream, **extra) | sampling
    if api == "chat":
        response = client.chat.completions.create(
            messages=[{"role": "user", "content": REPETITIVE}], logprobs=True, top_logprobs=TOP_LOGPROBS, **common
        )
    else:
        response = client.completions.create(prompt=REPETITIVE, logprobs=TOP_LOGPROBS, **common)
    choices = [c.choices[0] for c in response if c.choices] if stream else [response.choices[0]]
    text, targets, drafts = "", [], []
    if api == "chat" and stream:
        assert choices[0].delta.role == "assistant" and not choices[0].delta.content
        choices = choices[1:]  # the gateway's role chunk carries no tokens
    for choice in choices:
        draft = choice.model_extra["draft_logprobs"]  # present whenever asked for, if only with no entries
        if api == "chat":
            text += (choice.delta.content or "") if stream else choice.message.content
            targets += [_chat_entry(e.model_dump()) for e in (choice.logprobs.content if choice.logprobs else [])]
            drafts += [_chat_entry(e) for e in draft["content"]]
        else:
            text += choice.text
            targets += _completion_entries(choice.logprobs.model_dump() if choice.logprobs else None)
            drafts += _completion_entries(draft)
    return text, targets, drafts


def _chat_entry(entry: dict) -> dict:
    top = [(t["token"], t["logprob"]) for t in entry["top_logprobs"]]
    return dict(token=entry["token"], logprob=entry["logprob"], top=top, accepted=entry.get("accepted"))


def _completion_entries(logprobs: dict | None) -> list[dict]:
    if not logprobs or not logprobs["tokens"]:
        return []
    accepted = logprobs.get("accepted", [None] * len(logprobs["tokens"]))
    return [
        dict(token=token, logprob=logprob, top=list(top.items()), accepted=acc, text_offset=offset)
        for token, logprob, top, offset, acc in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], logprobs["text_offset"],
            accepted,
        )
    ]


def _assert_well_formed(entry: dict) -> None:
    assert isinstance(entry["token"], str) and isinstance(entry["accepted"], bool)
    assert entry["logprob"] <= 0.0
    top = [lp for _, lp in entry["top"]]
    alternatives = top[:TOP_LOGPROBS]
    assert alternatives and alternatives == sorted(alternatives, reverse=True)
    assert top[TOP_LOGPROBS:] in ([], [entry["logprob"]])  # completions also list the token itself


def _assert_method_logprobs(method: str, drafts: list[dict]) -> None:
    """What each method's q says: point masses for lookup drafters, the module's distribution for MTP."""
    if method in ("ngram", "suffix"):
        for d in drafts:
            assert d["logprob"] == NGRAM_LOGPROB and d["top"] == [(d["token"], NGRAM_LOGPROB)]
        return
    # A greedy request's MTP entries report the module's raw distribution, where the draft has rank 1.
    modelled = [d for d in drafts if d["logprob"] < NGRAM_LOGPROB]
    assert modelled, "MTP drafts must carry real logprobs under q"
    for d in modelled:
        assert d["logprob"] == pytest.approx(d["top"][0][1], abs=LOGPROB_TOLERANCE)
        assert len(d["top"]) == TOP_LOGPROBS
    filled = [d for d in drafts if d["logprob"] == NGRAM_LOGPROB]
    if method == "mtp":
        assert not filled
    for d in filled:  # with_ngram: n-gram lookup fills the steps after the module's
        assert d["top"] == [(d["token"], NGRAM_LOGPROB)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_draft_logprobs_are_well_formed_and_greedy_text_is_the_same_for_every_method(
    client: openai.OpenAI, method: str, api: str, stream: bool
) -> None:
    text, targets, drafts = _generate(client, api, stream)
    assert text and "".join(t["token"] for t in targets) == text
    assert len(targets) == MAX_TOKENS
    for target in targets:
        assert target["logprob"] == pytest.approx(target["top"][0][1], abs=LOGPROB_TOLERANCE)  # greedy: the top
    assert _GREEDY_TEXTS.setdefault((api, stream), text) == text, "greedy text differs between methods"
    if method == "naive":
        assert drafts == []
        return
    assert drafts and any(d["accepted"] for d in drafts)
    for draft in drafts:
        _assert_well_formed(draft)
    _assert_method_logprobs(method, drafts)
    if api == "completion":  # an accepted draft is the output token at its place in the text
        emitted = {t["text_offset"]: t["token"] for t in targets}
        assert all(emitted.get(d["text_offset"]) == d["token"] for d in drafts if d["accepted"])


@pytest.mark.parametrize("api", APIS)
def test_sampled_mtp_drafts_report_their_probability_under_q(
    client: openai.OpenAI, method: str, api: str
) -> None:
    """A sampled request's MTP drafts are drawn from q, so each has a probability under it (no -inf entry)."""
    if not METHODS[method].needs_mtp:
        pytest.skip("only MTP drafts come from a distribution")
    _, _, drafts = _generate(client, api, stream=False, temperature=0.8, seed=3)
    assert drafts
    for draft in drafts:
        _assert_well_formed(draft)
        assert draft["logprob"] > MIN_LOGPROB
    assert any(d["logprob"] < NGRAM_LOGPROB for d in drafts)


@pytest.mark.parametrize("api", APIS)
def test_streamed_text_equals_whole_text_for_a_seeded_request(
    client: openai.OpenAI, method: str, api: str
) -> None:
    whole, streamed = whole_and_streamed(
        client, api, REPETITIVE, model=MODEL, max_tokens=MAX_TOKENS, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert streamed == whole and whole
