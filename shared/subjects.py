"""Every NATS subject and stream name the mesh uses, in one place.

Requests are durable: they travel through a JetStream stream with work-queue retention, so each is taken
by exactly one worker. Everything that flows back (frames, response chunks) and control messages
(opening a request at the detokenizer, cancelling) use core NATS: they are only useful live.
"""

PREFIX = "specmesh"

REQUEST_STREAM = "SPECMESH_REQUESTS"
REQUESTS = f"{PREFIX}.requests"  # gateway -> worker (JetStream, work queue); body: schemas.WorkRequest
# worker -> worker, same stream: a request a stopping worker hands back with its progress. A subject of its own so
# that only the gateway's NATS user may queue new requests (shared/nats_roles.py).
RESUMED_REQUESTS = f"{PREFIX}.requests.resumed"
REQUEST_SUBJECTS = (REQUESTS, RESUMED_REQUESTS)  # what the stream stores
WORKER_CONSUMER = "workers"  # the durable pull consumer every worker shares

# Prefix-aware routing (services/gateway/prefix_router.py, services/worker/routing.py): a request the gateway sends to
# the worker whose prefix cache holds the longest part of its prompt goes to a second work-queue stream, on that
# worker's own subject, which only that worker's durable consumer reads. A stream of its own, rather than subjects of
# the request stream: the workers' shared consumer there takes every subject, and a work queue's consumers may not
# overlap. A worker never runs a routed message delivered a second time, and another worker adopts the subject of one
# that is gone: both move the message to the shared queue (RESUMED_REQUESTS), where take-over, redelivery limits and
# dead letters work as for any request.
ROUTED_STREAM = "SPECMESH_ROUTED"
ROUTED_SUBJECTS = f"{PREFIX}.routed.*"
# The header of a routed request moved to the shared queue after a delivery: it may have started somewhere, so the
# worker that takes it asks its detokenizer where its output stands (services/worker/takeover.py).
DELIVERED_BEFORE_HEADER = "Specmesh-Delivered-Before"
# On a routed message moved to the shared queue: the delivery it was (services/worker/takeover.py delivery_id), so
# that a handoff that replaced it is still known to have.
DELIVERY_HEADER = "Specmesh-Delivery"
# JetStream stores one message per id within its duplicate window (2 minutes): a copy published again, after a
# publish whose answer was lost or a publisher that died between publishing and acknowledging, is dropped.
MSG_ID_HEADER = "Nats-Msg-Id"


def routed(worker_id: int) -> str:
    """gateway -> one worker (JetStream, work queue); body: schemas.WorkRequest."""
    return f"{PREFIX}.routed.{worker_id}"


def cache_events(worker_id: int) -> str:
    """worker -> gateways: the names of blocks its prefix cache stored and evicted; body: shared/cache_events.py."""
    return f"{PREFIX}.cache.{worker_id}"


def cache_sync(worker_id: int) -> str:
    """gateway -> one worker: publish a snapshot of every block name you hold (a gateway that has just met the worker,
    after its own start or the worker's); no body."""
    return f"{PREFIX}.cache.sync.{worker_id}"


def kv_transfer(worker_id: int) -> str:
    """prefill worker -> one decode worker: a KV handoff's chunks, each a request answered by the receiver
    (services/worker/handoff/nats_transport.py); body: a slice of handoff/format.py's bytes."""
    return f"{PREFIX}.kv.{worker_id}"


def worker_state(worker_id: int) -> str:
    """worker -> gateways and workers, every WORKER_STATE_PERIOD_S: alive, how busy, draining; schemas.WorkerState."""
    return f"{PREFIX}.worker.{worker_id}.state"


# Requests the work queue gave up on (services/worker/dead_letters.py). JetStream announces a message delivered
# max_deliver times without an ack on the advisory subject below; the dead-letter stream stores those advisories, so
# none is lost while no worker runs, and the copies of the requests they name, which a worker moves there.
DEAD_LETTER_STREAM = "SPECMESH_DEAD_LETTERS"
MAX_DELIVERIES_ADVISORY = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{REQUEST_STREAM}.{WORKER_CONSUMER}"
DEAD_REQUESTS = f"{PREFIX}.dead.requests"  # worker -> dead-letter stream; body: the message as it was queued
DEAD_LETTER_CONSUMER = "dead-letters"  # the durable pull consumer of the advisories, shared by the workers

# Opening a request is a request/reply to the detokenizers' queue group: exactly one detokenizer takes the
# request and answers with its id (schemas.DetokReady); the gateway writes that id into the WorkRequest, and
# the worker sends the request's frames to that detokenizer's own subject. Since the gateway queues the
# request only after the answer, a detokenizer always knows a request before its first frame arrives.
DETOK_OPEN = f"{PREFIX}.detok.open"  # gateway -> one detokenizer; body: schemas.DetokOpen
DETOK_QUEUE = "detokenizers"


def frames(detok_id: str) -> str:
    """worker -> the detokenizer that owns the request; body: a binary frame (shared/frames.py)."""
    return f"{PREFIX}.detok.{detok_id}.frames"


def progress(detok_id: str) -> str:
    """worker -> the detokenizer that owns a request, request/reply: how far the output of a request this worker takes
    over (redelivered after its worker died, or handed back) got; from then on the detokenizer takes the request's
    frames from this worker only. Body: schemas.ProgressQuery; reply: schemas.ProgressReport."""
    return f"{PREFIX}.detok.{detok_id}.progress"


def held(detok_id: str) -> str:
    """gateway -> a detokenizer, request/reply: which of these requests it still holds, asked when a stream has been
    silent for a while (no answer: the detokenizer is gone). Body: schemas.HeldQuery; reply: schemas.HeldReport."""
    return f"{PREFIX}.detok.{detok_id}.held"


CANCEL = f"{PREFIX}.cancel"  # gateway -> workers and detokenizers (the client is gone); body: schemas.Cancel
# detokenizer -> workers: the request's output ended at the detokenizer (a stop string, an error), so stop
# generating it; body: schemas.Cancel. Apart from CANCEL so that a detokenizer's NATS user cannot close requests at
# the other detokenizers.
STOP = f"{PREFIX}.stop"


def responses(gateway_id: str) -> str:
    """detokenizer -> the gateway instance that owns the request; body: schemas.Chunk."""
    return f"{PREFIX}.responses.{gateway_id}"


def gateway_held(gateway_id: str) -> str:
    """detokenizer -> a gateway instance, request/reply: which of these requests it still waits for, asked every
    little while (no responders: the gateway is gone, and its requests are stopped at the workers). Body:
    schemas.HeldQuery; reply: schemas.HeldReport."""
    return f"{responses(gateway_id)}.held"

# Stored responses (POST /v1/responses with `store`): a JetStream key-value bucket every gateway shares, so that a
# response stored by one gateway is continued (previous_response_id), read or deleted through any other.
RESPONSE_BUCKET = "specmesh_responses"
# gateway -> gateways, request/reply: stop this background response (services/gateway/responses/background.py); the
# gateway running it answers; body: the response id
CANCEL_BACKGROUND = f"{PREFIX}.background.cancel"
RESPONSE_STREAM = f"KV_{RESPONSE_BUCKET}"  # the bucket's stream, as JetStream names it
RESPONSE_KEYS = f"$KV.{RESPONSE_BUCKET}.>"  # the subjects its entries are put and deleted on
# A background response created with `stream: true` keeps its streaming events, so that any gateway can stream them
# again from where a client's connection dropped (GET /v1/responses/{id}?stream=true&starting_after=N,
# services/gateway/responses/event_log.py): gateway -> JetStream, a subject per response; body: a JSON list of events.
RESPONSE_EVENTS_STREAM = "SPECMESH_RESPONSE_EVENTS"


def response_events(response_id: str) -> str:
    return f"{PREFIX}.response_events.{response_id}"
