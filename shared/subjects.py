"""Every NATS subject and stream name the mesh uses, in one place.

Requests are durable: they travel through a JetStream stream with work-queue retention, so each is taken
by exactly one worker. Everything that flows back (frames, response chunks) and control messages
(opening a request at the detokenizer, cancelling) use core NATS: they are only useful live.
"""

PREFIX = "specmesh"

REQUEST_STREAM = "SPECMESH_REQUESTS"
REQUESTS = f"{PREFIX}.requests"  # gateway -> worker (JetStream, work queue); body: schemas.WorkRequest
WORKER_CONSUMER = "workers"  # the durable pull consumer every worker shares

# The detokenizer reads both of these through one subscription, so that it sees them in the order the
# server received them: a request's DetokOpen (published before the request entered the queue) always
# precedes the first frame of that request.
DETOK_INBOX = f"{PREFIX}.detok.>"
DETOK_OPEN = f"{PREFIX}.detok.open"  # gateway -> detokenizer; body: schemas.DetokOpen
FRAMES = f"{PREFIX}.detok.frames"  # worker -> detokenizer; body: a binary frame (shared/frames.py)
CANCEL = f"{PREFIX}.cancel"  # gateway or detokenizer -> workers and detokenizer; body: schemas.Cancel


def responses(gateway_id: str) -> str:
    """detokenizer -> the gateway instance that owns the request; body: schemas.Chunk."""
    return f"{PREFIX}.responses.{gateway_id}"
