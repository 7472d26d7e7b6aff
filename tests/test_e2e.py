"""The whole mesh, end to end: real processes, real NATS, the demo model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import openai
import pytest

from shared import subjects
from shared.config import DEFAULT_MODEL_DIR
from shared.nats_roles import NatsRole
from services.mesh_process import Mesh, start_mesh

pytestmark = pytest.mark.e2e

# The shipped demo model is the real model the mesh serves by default; another checkpoint can be named.
E2E_MODEL = Path(os.environ.get("SPECMESH_E2E_MODEL", DEFAULT_MODEL_DIR))
REPETITIVE = "import os\nimport sys\nimport os\nimport sys\nimport os\nimport sys\nimport os\n"
CODE_PROMPT = "def fibonacci(n):\n    "
FIXED_NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    # Fixed ngram drafts: the draft_logprobs tests need drafts, and adaptive speculation (the default) drafts none
    # when the steps it measures say drafting does not pay, which a loaded machine can make them say.
    # Two detokenizers: every test's requests are owned by one of them, and the others must never send its chunks.
    m = start_mesh(
        tmp_path_factory.mktemp("mesh"), "--max-num-seqs", "4", "--max-model-len", "1024", "--detokenizers", "2",
        "--speculative-config", FIXED_NGRAM, model=E2E_MODEL,
    )
    yield m
    assert m.stop() == 0, "".join(m.log[-30:])
    nats_port = m.nats_url.rsplit(":", 1)[1]
    leftover = subprocess.run(["pgrep", "-f", f"--nats-url {m.nats_url}|--port {nats_port}"], capture_output=True)
    assert leftover.stdout == b"", f"processes left behind: {leftover.stdout!r}"


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI, mesh: Mesh) -> None:
    assert [m.id for m in client.models.list().data] == [mesh.model]


def test_completion_non_stream(client: openai.OpenAI, mesh: Mesh) -> None:
    r = client.completions.create(model=mesh.model, prompt=CODE_PROMPT, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_sends_role_content_finish_and_usage(client: openai.OpenAI, mesh: Mesh) -> None:
    chunks = list(
        client.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": "a function that adds two numbers"}],
            max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1])


def whole_and_streamed(client: openai.OpenAI, api: str, text: str, **common) -> tuple[str, str]:
    """The same request's text, asked for whole and streamed; `text` is the chat message or the prompt."""
    if api == "chat":
        messages = [{"role": "user", "content": text}]
        whole = client.chat.completions.create(messages=messages, **common).choices[0].message.content
        stream = client.chat.completions.create(messages=messages, stream=True, **common)
        return whole, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.completions.create(prompt=text, **common).choices[0].text
    stream = client.completions.create(prompt=text, stream=True, **common)
    return whole, "".join(c.choices[0].text for c in stream if c.choices)


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI, mesh: Mesh, api: str) -> None:
    text = "parse a config file" if api == "chat" else CODE_PROMPT
    whole, streamed = whole_and_streamed(client, api, text, model=mesh.model, max_tokens=40, temperature=0.8, seed=7)
    assert streamed == whole and whole


def test_same_seed_same_text(client: openai.OpenAI, mesh: Mesh) -> None:
    def text(seed: int) -> str:
        r = client.completions.create(model=mesh.model, prompt=CODE_PROMPT, max_tokens=32, temperature=1.0, seed=seed)
        return r.choices[0].text

    first = text(1234)
    assert text(1234) == first
    assert any(text(s) != first for s in (1, 2, 3))


def test_max_tokens_ends_with_length(client: openai.OpenAI, mesh: Mesh) -> None:
    r = client.completions.create(
        model=mesh.model, prompt=CODE_PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].model_extra["stop_reason"] is None


def test_stop_string_cuts_the_text_at_its_first_occurrence(client: openai.OpenAI, mesh: Mesh) -> None:
    full = client.completions.create(
        model=mesh.model, prompt=CODE_PROMPT, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text
    stop = full[10:13]
    cut = client.completions.create(
        model=mesh.model, prompt=CODE_PROMPT, max_tokens=48, temperature=0, stop=[stop, "\u2603never"],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop  # vLLM's: the string that matched
    assert cut.text == full[: full.index(stop)]
    ids = client.completions.create(model=mesh.model, prompt=CODE_PROMPT, max_tokens=48, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    stop_id = ids.model_extra["token_ids"][3]
    chunks = list(client.completions.create(model=mesh.model, prompt=CODE_PROMPT, max_tokens=48, temperature=0,
                                            stream=True, extra_body={"stop_token_ids": [stop_id]}))
    assert [(c.choices[0].finish_reason, c.choices[0].model_extra.get("stop_reason")) for c in chunks][-1] == (
        "stop", stop_id
    )
    assert all("stop_reason" not in c.choices[0].model_extra for c in chunks[:-1])


def test_completion_logprobs_and_draft_logprobs(client: openai.OpenAI, mesh: Mesh) -> None:
    r = client.completions.create(
        model=mesh.model, prompt=REPETITIVE, max_tokens=24, temperature=0, logprobs=3,
        extra_body={"include_draft_logprobs": True, "ignore_eos": True},
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
    assert "".join(lp.tokens) == choice.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and 1 <= len(top) <= 3
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen token is the top one
    draft = choice.model_extra["draft_logprobs"]
    assert draft["tokens"], "a repetitive prompt must produce ngram drafts"
    n = len(draft["tokens"])
    assert len(draft["token_logprobs"]) == len(draft["accepted"]) == len(draft["top_logprobs"]) == n
    assert all(lp == 0.0 for lp in draft["token_logprobs"])  # ngram proposals are point masses
    assert any(draft["accepted"])


def test_chat_logprobs_and_draft_logprobs(client: openai.OpenAI, mesh: Mesh) -> None:
    stream = client.chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": REPETITIVE}], max_tokens=24, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"include_draft_logprobs": True, "ignore_eos": True},
    )
    entries, drafts, text = [], [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs:
            entries += choice.logprobs.content
        drafts += (choice.model_extra.get("draft_logprobs") or {}).get("content", [])
    assert "".join(e.token for e in entries) == text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in entries)
    assert drafts and all(isinstance(d["accepted"], bool) and d["logprob"] == 0.0 for d in drafts)


def test_bad_requests_get_openai_error_bodies(client: openai.OpenAI, mesh: Mesh) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=mesh.model, prompt="x", temperature=3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": "x"}], n=17)
    assert err.value.body["param"] == "n"  # above the default --max-n
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


async def _num_ack_pending(mesh: Mesh) -> int:
    settings = mesh.nats_settings(NatsRole.ADMIN)
    nc = await nats.connect(settings.url, **settings.connect_options())
    try:
        info = await nc.jetstream().consumer_info(subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER)
        return info.num_ack_pending
    finally:
        await nc.close()


def _command_lines() -> list[bytes]:
    """The argv of every process on the machine."""
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(path.read_bytes())
        except OSError:
            pass  # the process ended meanwhile
    return found


def test_nats_refuses_anonymous_clients_and_no_password_is_on_a_command_line_or_in_a_log(mesh: Mesh) -> None:
    async def ignore(exc: Exception) -> None:
        pass

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(nats.connect(mesh.nats_url, allow_reconnect=False, error_cb=ignore))
    passwords = [mesh.nats_settings(role).credentials.password.get_secret_value() for role in NatsRole]
    assert not [line for line in _command_lines() if any(p.encode() in line for p in passwords)]
    assert not [line for line in mesh.log if any(p in line for p in passwords)]


def test_client_disconnect_frees_the_slot(client: openai.OpenAI, mesh: Mesh) -> None:
    stream = client.completions.create(
        model=mesh.model, prompt=CODE_PROMPT, max_tokens=900, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _ in zip(range(3), stream):
        pass
    assert asyncio.run(_num_ack_pending(mesh)) == 1  # the worker holds the request
    stream.close()
    deadline = time.monotonic() + 15
    while asyncio.run(_num_ack_pending(mesh)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert asyncio.run(_num_ack_pending(mesh)) == 0, "the worker did not finish the abandoned request"


def test_requests_spread_over_several_detokenizers(client: openai.OpenAI, mesh: Mesh) -> None:
    """Each request is owned by the one detokenizer that took it; the others never send its chunks."""

    def run(seed: int) -> str:
        stream = client.completions.create(
            model=mesh.model, prompt=CODE_PROMPT, max_tokens=16, temperature=1.0, seed=seed, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(4) as pool:
        streamed = list(pool.map(run, range(8)))
    for seed, text in enumerate(streamed):
        whole = client.completions.create(
            model=mesh.model, prompt=CODE_PROMPT, max_tokens=16, temperature=1.0, seed=seed
        ).choices[0].text
        assert text == whole
