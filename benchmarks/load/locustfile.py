"""Locust users that load the mesh for benchmarks/soak.py: streaming completions, and clients that leave mid-stream.

    python -m locust -f benchmarks/load/locustfile.py --headless -u USERS -r USERS -H http://HOST:PORT \
        --soak-plan PLAN.json StreamUser [LeaveUser]

soak.py writes the plan (benchmarks/load/plan.py) and runs this; locust can also run it by hand with a plan.
StreamUser keeps one streaming completion in flight, back to back, for the plan's duration: greedy, or sampled
with a seed from a small set so that equal requests can be compared; EOS is ignored, so each must bring exactly
max_tokens tokens. LeaveUser sends the same requests and closes its connection after a random delay, until the
plan's disconnects are made. Once the duration has passed and the disconnects are made, no new request starts and
locust quits when the last one ends. Every request is one Record line in the plan's records file; a stream that
fails is also a failure in locust's own statistics.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import time
from pathlib import Path

import gevent
import requests
from locust import HttpUser, constant, events
from locust.env import Environment
from locust.exception import StopUser
from locust.user.task import task

from benchmarks.load.plan import (
    BROKEN, ERROR_EVENT, GREEDY_SEED, LEFT, REFUSED, STREAM, WRONG_LENGTH, LoadPlan, Record,
)

DATA = b"data: "
DONE = b"[DONE]"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # a stream silent this long is stalled: it fails rather than hanging the run
IDLE_S = 0.1  # how often an idle user looks whether the run has ended
STOP_POLL_S = 0.1
DRAIN_TIMEOUT_S = 300.0  # after the duration, the longest the run waits for the last requests to end
STREAM_NAME = "/v1/completions (stream)"
LEFT_NAME = "/v1/completions (client leaves)"


class Run:
    """The state every user of this process shares: the plan, the records file and when to stop."""

    plan: LoadPlan
    records = None
    stopping = False
    in_flight = 0
    disconnects_started = 0
    user_numbers = itertools.count()

    @classmethod
    def write(cls, record: Record) -> None:
        cls.records.write(record.to_line())  # one write per line: greenlets switch only on network waits


@events.init_command_line_parser.add_listener
def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soak-plan", default="", help="the JSON plan benchmarks/soak.py writes")


@events.init.add_listener
def _load_plan(environment: Environment, **_: object) -> None:
    Run.plan = LoadPlan.load(Path(environment.parsed_options.soak_plan))
    Run.records = open(Run.plan.records_path, "a", buffering=1)
    StreamUser.fixed_count = Run.plan.streams
    LeaveUser.fixed_count = Run.plan.leavers


@events.test_start.add_listener
def _start(environment: Environment, **_: object) -> None:
    Path(Run.plan.started_path).write_text(repr(time.monotonic()))
    gevent.spawn(_stop_when_done, environment)


def _stop_when_done(environment: Environment) -> None:
    gevent.sleep(Run.plan.duration_s)
    while Run.disconnects_started < Run.plan.disconnects:
        gevent.sleep(STOP_POLL_S)
    Run.stopping = True
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while Run.in_flight and time.monotonic() < deadline:
        gevent.sleep(STOP_POLL_S)
    Run.records.flush()
    environment.runner.quit()


def request_body(prompt: int, seed: int | None, max_tokens: int) -> dict:
    plan = Run.plan
    body = {
        "model": plan.model, "prompt": plan.prompts[prompt], "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
    }
    if seed is not GREEDY_SEED:
        body |= {"temperature": plan.temperature, "seed": seed}
    return body


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {Run.plan.api_key}"} if Run.plan.api_key else {}


def read_stream(response: requests.Response, record: Record) -> None:
    """Reads the SSE stream into the record: when each chunk with text came, the text's digest, the token count,
    and the error if the stream did not end as it must."""
    digest = hashlib.sha256()
    for line in response.iter_lines():
        if not line.startswith(DATA):
            continue
        payload = line[len(DATA):]
        if payload == DONE:
            record.finished = True
            break
        event = json.loads(payload)
        if "error" in event:
            record.fail(ERROR_EVENT, f"error event: {event['error'].get('message')}")
            return
        text = "".join(choice.get("text") or "" for choice in event.get("choices") or ())
        if text:
            record.arrivals.append(time.monotonic() - record.sent)
            digest.update(text.encode())
        if event.get("usage"):
            record.tokens = event["usage"]["completion_tokens"]
    record.text_digest = digest.hexdigest()
    if not record.finished:
        record.fail(BROKEN, "the stream ended without [DONE]")
    elif record.tokens != Run.plan.max_tokens:
        record.fail(WRONG_LENGTH, f"{record.tokens} tokens instead of {Run.plan.max_tokens}")


class LoadUser(HttpUser):
    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = random.Random(next(Run.user_numbers))

    def pick(self) -> tuple[int, int | None]:
        prompt = self.rng.randrange(len(Run.plan.prompts))
        sampled = self.rng.random() < Run.plan.sampled_share
        return prompt, (self.rng.choice(Run.plan.seeds) if sampled else GREEDY_SEED)


class StreamUser(LoadUser):
    @task
    def stream(self) -> None:
        if Run.stopping:
            gevent.sleep(IDLE_S)
            return
        prompt, seed = self.pick()
        body = request_body(prompt, seed, Run.plan.max_tokens)
        record = Record(STREAM, prompt, seed, time.monotonic())
        Run.in_flight += 1
        try:
            with self.client.post(
                "/v1/completions", json=body, headers=headers(), stream=True, catch_response=True, name=STREAM_NAME,
                timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
            ) as response:
                record.status = response.status_code or None  # locust gives 0 when no response came
                if record.status is None:
                    record.fail(BROKEN, f"no response: {response.error!r}")
                elif record.status != requests.codes.ok:
                    record.fail(REFUSED, f"HTTP {record.status}: {response.text[:200]}")
                else:
                    try:
                        read_stream(response, record)
                    except (requests.RequestException, ValueError) as exc:  # ValueError: a chunk that is not JSON
                        record.fail(BROKEN, f"the stream broke: {exc!r}")
                if record.error:
                    response.failure(record.error)
                else:
                    response.success()
        finally:
            record.ended = time.monotonic() - record.sent
            Run.in_flight -= 1
            Run.write(record)


class LeaveUser(LoadUser):
    """A client that sends a streaming request and closes its connection at a random moment: before the response,
    while it waits for the first token, or mid-stream."""

    @task
    def leave(self) -> None:
        if Run.disconnects_started >= Run.plan.disconnects:
            raise StopUser
        Run.disconnects_started += 1
        prompt, seed = self.pick()
        delay = self.rng.uniform(0.0, Run.plan.disconnect_max_delay_s)
        body = request_body(prompt, seed, Run.plan.leave_max_tokens)
        record = Record(LEFT, prompt, seed, time.monotonic())
        Run.in_flight += 1
        # Its own session, closed after each request: leaving means the connection goes, not back to a pool.
        session = requests.Session()
        response = None
        try:
            with gevent.Timeout(delay, False):
                response = session.post(
                    self.host + "/v1/completions", json=body, headers=headers(), stream=True,
                    timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                )
                record.status = response.status_code
                for line in response.iter_lines():
                    if line == DATA + DONE:
                        record.finished = True
                    elif line.startswith(DATA):
                        record.arrivals.append(time.monotonic() - record.sent)
        except requests.RequestException as exc:
            record.fail(BROKEN, f"the request broke before the client left: {exc!r}")
        finally:
            if response is not None:
                response.close()
            session.close()
            record.ended = time.monotonic() - record.sent
            if record.error is None and record.status not in (None, requests.codes.ok):
                record.fail(REFUSED, f"HTTP {record.status}")
            Run.in_flight -= 1
            Run.write(record)
        events.request.fire(
            request_type="POST", name=LEFT_NAME, response_time=record.ended * 1000.0, response_length=0,
            exception=RuntimeError(record.error) if record.error else None, context={},
        )
