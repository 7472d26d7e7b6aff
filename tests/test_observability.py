"""Every service's live /metrics passes `promtool check metrics`, shows the traffic it served, and answers
/health and /ready."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import time
import urllib.request

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from shared.config import EngineConfig
from shared.tokenizer import Tokenizer
from tests.test_e2e import E2E_MODEL, REPETITIVE

pytestmark = pytest.mark.e2e

BLOCK_SIZE = EngineConfig.model_fields["block_size"].default
METRICS_LINE = re.compile(r"metrics of (\S+): (\S+)")
STREAMS_CLOSED_AT_ONCE = 8


@pytest.fixture(scope="module")
def served_mesh(tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(tmp_path_factory.mktemp("obs"), model=E2E_MODEL)
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    for stream in (False, True):
        r = client.completions.create(
            model=mesh.model, prompt=REPETITIVE, max_tokens=32, temperature=0, stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            list(r)
    yield mesh
    assert mesh.stop() == 0


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _metrics_urls(mesh: Mesh) -> dict[str, str]:
    urls = dict(m.groups() for line in mesh.log if (m := METRICS_LINE.search(line)))
    assert set(urls) == {"gateway", "detokenizer", "worker-0"}
    return urls


def _value(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_every_services_metrics(served_mesh: Mesh) -> None:
    for service, url in _metrics_urls(served_mesh).items():
        status, text = _get(url)
        assert status == 200
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, f"{service}: {check.stdout}{check.stderr}"


def test_metrics_count_the_traffic(served_mesh: Mesh) -> None:
    urls = _metrics_urls(served_mesh)
    gateway, worker, detok = (_get(urls[s])[1] for s in ("gateway", "worker-0", "detokenizer"))
    assert _value(gateway, "specmesh_gateway_requests_total", 'route="/v1/completions",status="200"') >= 2
    assert _value(gateway, "specmesh_gateway_time_to_first_token_seconds_count") >= 2
    assert _value(worker, "specmesh_worker_emitted_tokens_total") >= 64
    assert _value(worker, "specmesh_worker_spec_decode_draft_tokens_total") > 0
    assert _value(worker, "specmesh_worker_spec_decode_accepted_tokens_per_pos_total", 'position="0"') > 0
    assert _value(worker, "specmesh_worker_frames_published_total", 'kind="target"') > 0
    # The same prompt twice (after the start's own probe): the second finds its full blocks cached, all but the
    # one holding its last token.
    prompt_len = len(Tokenizer(E2E_MODEL).encode(REPETITIVE))
    assert _value(worker, "specmesh_worker_prefix_cache_queries_total") >= 2 * prompt_len
    assert _value(worker, "specmesh_worker_prefix_cache_hits_total") >= (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    # Each finished sequence's phases and sizes: the two served requests of 32 tokens each at least
    finished = _value(worker, "specmesh_worker_request_decode_time_seconds_count")
    assert finished >= 2 and _value(worker, "specmesh_worker_request_generation_tokens_sum") >= 64
    for phase in ("queue", "prefill", "decode"):
        assert _value(worker, f"specmesh_worker_request_{phase}_time_seconds_count") == finished
    assert _value(worker, "specmesh_worker_request_decode_time_seconds_sum") > 0
    assert _value(worker, "specmesh_worker_request_prompt_tokens_sum") >= 2 * prompt_len
    assert _value(detok, "specmesh_detokenizer_tokens_total") >= 64
    assert _value(detok, "specmesh_detokenizer_step_to_chunk_lag_seconds_count") > 0
    assert _value(detok, "specmesh_detokenizer_malformed_frames_total") == 0
    for text, service in ((gateway, "gateway"), (worker, "worker"), (detok, "detokenizer")):
        assert f"specmesh_{service}_nats_reconnects_total" in text
        assert f"specmesh_{service}_nats_pending_bytes" in text


def test_a_stream_read_to_its_end_counts_as_answered_however_soon_its_client_closes(served_mesh: Mesh) -> None:
    """A client that closes its connection right after [DONE] had its answer: 200, not client_disconnected."""
    url = _metrics_urls(served_mesh)["gateway"]
    labels = ('route="/v1/completions",status="200"', 'status="client_disconnected"')
    before = [_value(_get(url)[1], "specmesh_gateway_requests_total", label) for label in labels]
    host, port = served_mesh.base_url.removeprefix("http://").split("/")[0].split(":")
    body = {"model": served_mesh.model, "prompt": REPETITIVE, "max_tokens": 4, "stream": True}
    for _ in range(STREAMS_CLOSED_AT_ONCE):
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        while (line := response.readline()) and not line.startswith(b"data: [DONE]"):
            pass
        assert line.startswith(b"data: [DONE]")
        connection.sock.close()  # at once, before the response's end is read
        connection.close()
    time.sleep(0.5)  # the gateway counts each request as its handler ends
    after = [_value(_get(url)[1], "specmesh_gateway_requests_total", label) for label in labels]
    assert [a - b for a, b in zip(after, before)] == [STREAMS_CLOSED_AT_ONCE, 0]


def test_health_and_ready_on_every_service(served_mesh: Mesh) -> None:
    for url in _metrics_urls(served_mesh).values():
        base = url.removesuffix("/metrics")
        assert _get(f"{base}/health")[0] == 200
        status, body = _get(f"{base}/ready")
        assert status == 200, body
