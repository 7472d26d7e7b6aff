"""SIGTERM on real processes: a draining worker finishes its requests, or hands them back to the queue for
another worker, which continues the same output; the process exits on its own."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import openai
import pytest

from tests.partsfixture import EXIT_TIMEOUT_S, Parts, running_parts
from tests.test_e2e import CODE_PROMPT, E2E_MODEL

pytestmark = pytest.mark.e2e

LONG = dict(max_tokens=400, temperature=1.0, seed=99, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def module_parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    with running_parts(tmp_path_factory.mktemp("nats")) as parts:
        yield parts


@pytest.fixture
def parts(module_parts: Parts) -> Iterator[Parts]:
    """The module's NATS, detokenizer and gateway, with no worker left from an earlier test."""
    yield module_parts
    for service in module_parts.started:
        if service not in (module_parts.gateway, module_parts.detokenizer):
            service.kill()


def _stream(client: openai.OpenAI):
    return client.completions.create(model=E2E_MODEL.name, prompt=CODE_PROMPT, stream=True, **LONG)


def test_draining_worker_finishes_its_request_and_exits(parts: Parts) -> None:
    worker = parts.start("worker", "--drain-timeout", "60")
    stream = _stream(parts.client)
    text = next(iter(stream)).choices[0].text
    worker.proc.send_signal(signal.SIGTERM)
    text += "".join(c.choices[0].text for c in stream if c.choices)
    assert worker.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert len(text) > 0


def test_worker_that_must_leave_hands_its_request_to_another(parts: Parts) -> None:
    leaving = parts.start("worker", "--drain-timeout", "0", "--worker-id", "1")
    stream = _stream(parts.client)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].text for _ in range(5))
    assert leaving.terminate() == 0  # hands the unfinished request back with its progress
    parts.start("worker", "--worker-id", "2")
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    uninterrupted = parts.client.completions.create(model=E2E_MODEL.name, prompt=CODE_PROMPT, **LONG).choices[0].text
    assert text == uninterrupted


def test_draining_gateway_and_detokenizer_finish_the_open_stream(parts: Parts) -> None:
    """The module's last test: it stops the gateway and the detokenizer the others share."""
    parts.start("worker")
    stream = _stream(parts.client)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    for service in (parts.gateway, parts.detokenizer):
        service.proc.send_signal(signal.SIGTERM)
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    for service in (parts.gateway, parts.detokenizer):
        assert service.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert len(text) > 0 and stream.response.is_closed
