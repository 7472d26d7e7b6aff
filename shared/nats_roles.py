"""Who may publish and subscribe to what on NATS: one NATS user per service role, each allowed exactly the
subjects its service uses.

The gateway alone queues requests, opens them at a detokenizer and cancels them; workers alone publish frames
(and hand requests back on their own subject); detokenizers alone publish chunks, ask gateways which requests they
still wait for, and stop requests whose output ended at them. Replies go to inboxes under a per-role prefix
(`_INBOX.<role>`) that only that role may read. A detokenizer answers the gateway's DetokOpen through
`allow_responses`: it may publish to the reply subject of a request it received, once, and nowhere else under
`_INBOX`. The JetStream API is open to each role only for the
calls its service makes: looking up the streams and shared consumers (never creating or changing them: the admin
user declares those, shared/streams.py), pulling and acknowledging, and a worker's own consumer of routed requests.

The server's `authorization` block is rendered from this table, for the embedded server (shared/nats_server.py)
and for Kubernetes (k8s/base/nats/config.yaml, which tests/test_k8s.py checks against it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from shared import subjects

INBOX_ROOT = "_INBOX"
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
ANY_TOKEN = "*"  # a NATS wildcard: exactly one subject token
ANY_REST = ">"  # a NATS wildcard: one or more trailing tokens


class NatsRole(StrEnum):
    """A NATS user; its name is also the user name and the inbox prefix's last token."""

    ADMIN = "admin"  # unrestricted: stream inspection and management by operators and tests
    GATEWAY = "gateway"
    WORKER = "worker"
    DETOKENIZER = "detokenizer"


SERVICE_ROLES = (NatsRole.GATEWAY, NatsRole.WORKER, NatsRole.DETOKENIZER)


def inbox_prefix(role: NatsRole) -> str:
    """Where the role's client creates its reply inboxes (nats-py's `inbox_prefix`)."""
    return f"{INBOX_ROOT}.{role}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may publish once to the reply subject of each request it receives


def _stream_info(stream: str) -> str:
    return f"{JS_API}.STREAM.INFO.{stream}"


def _consumer_info(stream: str, consumer: str) -> str:
    return f"{JS_API}.CONSUMER.INFO.{stream}.{consumer}"


def _gateway_waits_for_streams() -> tuple[str, ...]:
    """streams.wait_for(GATEWAY_NEEDS): the streams it publishes to exist (the response store's lookup is among
    _stores_responses)."""
    return _stream_info(subjects.REQUEST_STREAM), _stream_info(subjects.ROUTED_STREAM)


def _worker_waits_for_streams() -> tuple[str, ...]:
    """streams.wait_for(WORKER_NEEDS): the shared consumers it pulls from exist (the routed stream's lookup is
    among _serves_routed_requests)."""
    return (
        _consumer_info(subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER),
        _consumer_info(subjects.DEAD_LETTER_STREAM, subjects.DEAD_LETTER_CONSUMER),
    )


def _pulls_requests() -> tuple[str, ...]:
    """A worker's pull requests on the shared consumer, and its acknowledgements (ack, nak, in progress, term)
    of the messages it was given."""
    stream, consumer = subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER
    return (f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}", f"{JS_ACK}.{stream}.{consumer}.{ANY_REST}")


def _hands_off() -> tuple[str, ...]:
    """services/worker/handoff/: a prefill worker sends KV chunks to a decode worker, then the request to its routed
    subject; it asks decode workers it meets for what they hold."""
    return subjects.kv_transfer(ANY_TOKEN), subjects.routed(ANY_TOKEN), subjects.cache_sync(ANY_TOKEN)


def _serves_routed_requests() -> tuple[str, ...]:
    """services/worker/routing.py: declare a worker's consumer of its routed subject (its own, or a gone worker's it
    adopts; nats-py names durable consumers in the legacy or the current subject, depending on its version), pull
    and acknowledge from it, count the stream's messages per subject, list and delete the consumers
    of workers gone; the cache events and state it publishes."""
    stream = subjects.ROUTED_STREAM
    return (
        f"{JS_API}.CONSUMER.CREATE.{stream}.{ANY_REST}",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{ANY_TOKEN}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{ANY_TOKEN}",
        f"{JS_API}.CONSUMER.LIST.{stream}",
        f"{JS_API}.CONSUMER.DELETE.{stream}.{ANY_TOKEN}",
        _stream_info(stream),
        f"{JS_ACK}.{stream}.{ANY_REST}",
        subjects.cache_events(ANY_TOKEN),
        subjects.worker_state(ANY_TOKEN),
    )


def _moves_dead_letters() -> tuple[str, ...]:
    """The API calls of services/worker/dead_letters.py: pull and acknowledge the dead-letter stream's advisories,
    read and delete the work-queue message one names, store its copy."""
    stream, consumer, requests = subjects.DEAD_LETTER_STREAM, subjects.DEAD_LETTER_CONSUMER, subjects.REQUEST_STREAM
    return (
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"{JS_ACK}.{stream}.{consumer}.{ANY_REST}",
        f"{JS_API}.STREAM.MSG.GET.{requests}",
        f"{JS_API}.STREAM.MSG.DELETE.{requests}",
        subjects.DEAD_REQUESTS,
    )


def _stores_responses() -> tuple[str, ...]:
    """services/gateway/responses/store.py: look the bucket up, put and delete entries (messages on its keys), read
    one (a direct get, or the stream's message get where direct gets are off)."""
    stream = subjects.RESPONSE_STREAM
    return (
        _stream_info(stream), subjects.RESPONSE_KEYS, f"{JS_API}.DIRECT.GET.{stream}.{ANY_REST}",
        f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.STREAM.MSG.GET.{stream}",
    )


def _logs_response_events() -> tuple[str, ...]:
    """services/gateway/responses/event_log.py: look the stream up (streams.wait_for), append a background response's
    events to it, read them back by direct gets, hear new ones as they are appended, and drop a deleted response's
    (a purge by subject)."""
    stream = subjects.RESPONSE_EVENTS_STREAM
    return (_stream_info(stream), subjects.response_events(ANY_TOKEN), f"{JS_API}.DIRECT.GET.{stream}",
            f"{JS_API}.STREAM.PURGE.{stream}")


def _inbox(role: NatsRole) -> str:
    return f"{inbox_prefix(role)}.{ANY_REST}"


PERMISSIONS: dict[NatsRole, Permissions | None] = {
    NatsRole.ADMIN: None,
    NatsRole.GATEWAY: Permissions(
        publish=(
            subjects.REQUESTS, subjects.DETOK_OPEN, subjects.CANCEL, subjects.held(ANY_TOKEN),
            *_gateway_waits_for_streams(), subjects.ROUTED_SUBJECTS, subjects.cache_sync(ANY_TOKEN),
            *_stores_responses(), subjects.CANCEL_BACKGROUND, *_logs_response_events(),
        ),
        subscribe=(
            subjects.responses(ANY_TOKEN), subjects.gateway_held(ANY_TOKEN),
            _inbox(NatsRole.GATEWAY), subjects.cache_events(ANY_TOKEN),
            subjects.worker_state(ANY_TOKEN), subjects.CANCEL_BACKGROUND, subjects.response_events(ANY_TOKEN),
        ),
        # The gateway running a background response answers a cancel for it; a gateway answers a detokenizer's
        # HeldQuery.
        allow_responses=True,
    ),
    NatsRole.WORKER: Permissions(
        publish=(
            subjects.frames(ANY_TOKEN), subjects.progress(ANY_TOKEN), subjects.RESUMED_REQUESTS,
            *_worker_waits_for_streams(), *_pulls_requests(),
            *_moves_dead_letters(), *_serves_routed_requests(), *_hands_off(),
        ),
        subscribe=(
            subjects.CANCEL, subjects.STOP, _inbox(NatsRole.WORKER), subjects.worker_state(ANY_TOKEN),
            subjects.cache_sync(ANY_TOKEN), subjects.cache_events(ANY_TOKEN), subjects.kv_transfer(ANY_TOKEN),
        ),
        allow_responses=True,  # a decode worker answers each KV chunk it receives
    ),
    NatsRole.DETOKENIZER: Permissions(
        publish=(subjects.responses(ANY_TOKEN), subjects.gateway_held(ANY_TOKEN), subjects.STOP),
        subscribe=(
            subjects.DETOK_OPEN, subjects.frames(ANY_TOKEN), subjects.progress(ANY_TOKEN), subjects.held(ANY_TOKEN),
            subjects.CANCEL, _inbox(NatsRole.DETOKENIZER),
        ),
        allow_responses=True,
    ),
}


def password_variable(role: NatsRole) -> str:
    """The environment variable a Kubernetes NATS server reads the role's password from."""
    return f"SPECMESH_NATS_{role.upper()}_PASSWORD"


def authorization_config(passwords: Mapping[NatsRole, str] | None = None) -> str:
    """nats-server's `authorization` block with one user per role. With `passwords`, each is written as a quoted
    literal; without, each is `$SPECMESH_NATS_<ROLE>_PASSWORD`, which nats-server reads from its environment."""
    lines = ["authorization {", "  users: ["]
    for role in NatsRole:
        password = json.dumps(passwords[role]) if passwords is not None else f"${password_variable(role)}"
        lines += ["    {", f"      user: {json.dumps(str(role))}", f"      password: {password}"]
        permissions = PERMISSIONS[role]
        if permissions is not None:
            lines += ["      permissions: {"]
            lines += _allow_list("publish", permissions.publish) + _allow_list("subscribe", permissions.subscribe)
            if permissions.allow_responses:
                lines += ["        allow_responses: true"]
            lines += ["      }"]
        lines += ["    }"]
    return "\n".join(lines + ["  ]", "}"]) + "\n"


def _allow_list(direction: str, allowed: tuple[str, ...]) -> list[str]:
    return [f"        {direction}: {{allow: ["] + [f"          {json.dumps(s)}" for s in allowed] + ["        ]}"]
