"""Stored responses: what `store: true` keeps (OpenAI's default), so that a later request continues the conversation
with `previous_response_id`, GET or DELETE /v1/responses/{id} finds it, and GET /v1/responses/{id}/input_items
lists its input.

Each response is one entry of a JetStream key-value bucket that every gateway shares (shared/subjects.py
RESPONSE_BUCKET, declared with the streams, its limits `--response-store-max-age` and `--response-store-max-bytes`):
the response object, and the turn's input as chat messages. A conversation is the chain of its responses, each
naming the one before it: continuing one reads the chain back, and each turn's input and output (its output items
read as input items are) make the history the next prompt starts with. Instructions are the request's own, never
carried over, as OpenAI's are not.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, InvalidKeyError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.gateway import wire_json
from services.gateway.errors import OpenAIError, bad_request
from services.gateway.responses.conversation import input_messages
from shared import subjects

log = logging.getLogger(__name__)

# Responses one request may continue through: each costs a read before the request is queued, and a longer
# conversation would not fit a context anyway.
MAX_CHAIN = 256
PREVIOUS = "previous_response_id"
RUNNING_STATUSES = ("queued", "in_progress")  # a background response's, before it ends (background.py)
# A running background response's entry is written every few seconds (background.py's HEARTBEAT_S); one not written
# for this long lost its gateway
STALE_AFTER_S = 20.0
GONE = {"code": "server_error", "message": "the gateway running this background response stopped before it finished"}


class StoredRecord:
    """One entry: the response object, its turn's input as chat messages and as the items listed for it
    (input_items.py), and for a background response still running when its entry was last written (background.py)."""

    def __init__(
        self, response: dict[str, Any], turn: list[dict[str, Any]], items: list[dict[str, Any]],
        heartbeat: float | None = None,
    ) -> None:
        self.response = response
        self.turn = turn
        self.items = items
        self.heartbeat = heartbeat

    def to_bytes(self) -> bytes:
        record = {"response": self.response, "turn": self.turn, "items": self.items}
        return wire_json.dumps(record if self.heartbeat is None else {**record, "heartbeat": self.heartbeat})

    @classmethod
    def from_bytes(cls, data: bytes) -> "StoredRecord":
        record = wire_json.loads(data)
        # items: kept before items were
        return cls(record["response"], record["turn"], record.get("items", []), record.get("heartbeat"))

    @property
    def as_read(self) -> "StoredRecord":
        """The entry as a reader sees it: a running background response whose heartbeat stopped has failed."""
        stale = self.heartbeat is not None and time.time() - self.heartbeat > STALE_AFTER_S
        if self.response.get("status") in RUNNING_STATUSES and stale:
            return StoredRecord({**self.response, "status": "failed", "error": GONE}, self.turn, self.items,
                                heartbeat=self.heartbeat)
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The turn as the next prompt's history holds it: its input, then its output read as input items (an empty
        answer is an empty assistant turn, as the chat conversation holding it has)."""
        answer = input_messages(self.response["output"]) or [{"role": "assistant", "content": ""}]
        return [*self.turn, *answer]


class ResponseStore:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._nc.jetstream().key_value(subjects.RESPONSE_BUCKET)
        return self._kv

    async def keep(self, record: StoredRecord) -> bool:
        """Stores the response; False (and a warning) where it cannot be: larger than a NATS message may be, or the
        store unreachable. The response still goes to its client, saying `store: false`."""
        data = record.to_bytes()
        response_id = record.response["id"]
        if len(data) > self._nc.max_payload:
            log.warning("response %s is not stored: %d bytes, over NATS's max_payload of %d",
                        response_id, len(data), self._nc.max_payload)
            return False
        try:
            await (await self._bucket()).put(response_id, data)
        except Exception as exc:  # the client's answer does not wait on the store
            log.warning("response %s is not stored: %r", response_id, exc)
            return False
        return True

    async def get(self, response_id: str) -> StoredRecord:
        """The stored response, or a 404 naming it."""
        return (await self.get_entry(response_id))[0]

    async def get_entry(self, response_id: str) -> tuple[StoredRecord, int]:
        """The stored response and its entry's revision (for replace), or a 404 naming it."""
        try:
            entry = await (await self._bucket()).get(response_id)
        except (KeyNotFoundError, InvalidKeyError, BucketNotFoundError):
            raise not_found(response_id) from None
        return StoredRecord.from_bytes(entry.value), entry.revision

    async def replace(self, record: StoredRecord, revision: int) -> bool:
        """Stores the response only if its entry is still at `revision` (nobody wrote it since it was read)."""
        try:
            await (await self._bucket()).update(record.response["id"], record.to_bytes(), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def delete(self, response_id: str) -> None:
        await self.get(response_id)  # a 404 for one not stored, as OpenAI answers
        await (await self._bucket()).delete(response_id)

    async def history(self, previous_response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and including the response named, oldest turn first; a 400 naming
        previous_response_id when it (or one it continues) is not stored."""
        turns: list[list[dict[str, Any]]] = []
        response_id: str | None = previous_response_id
        while response_id is not None:
            if len(turns) == MAX_CHAIN:
                raise bad_request(
                    f"The conversation continues more than {MAX_CHAIN} stored responses; send its items in `input`",
                    param=PREVIOUS,
                )
            try:
                record = (await self.get(response_id)).as_read
            except OpenAIError:
                raise bad_request(f"Previous response with id '{response_id}' not found.", param=PREVIOUS,
                                  code="previous_response_not_found") from None
            if record.response.get("status") in RUNNING_STATUSES:
                raise bad_request(
                    f"Response '{response_id}' is still {record.response['status']} in the background: continue it "
                    "once it has ended", param=PREVIOUS,
                )
            turns.append(record.messages())
            response_id = record.response.get(PREVIOUS)
        return [message for turn in reversed(turns) for message in turn]


def not_found(response_id: str) -> OpenAIError:
    """OpenAI's answer (and vLLM's) for a response it does not hold."""
    return OpenAIError(404, f"Response with id '{response_id}' not found.")
