"""The binary frame a worker publishes after each engine step: the one encoder and decoder.

The layout is documented in docs/frames.md. In short, all little-endian:

    HEADER            32 bytes   magic, version, kind, top_k, worker id, number of records, step, time sent
    RECORDS           36 bytes   x num_records: request id, seq_no, offset, counts, status, choice, cached tokens
    TOKEN_IDS   int32 [num_tokens, num_slots]   slot 0 = chosen token, slots 1..top_k = top-K
    LOGPROBS  float32 [num_tokens, num_slots]
    RANKS       int32 [num_tokens]              1-based rank of the chosen token

where `num_tokens` is the sum of the records' token counts and `num_slots = top_k + 1`.
Only what exists is packed: a step with 3 sequences and 5 tokens costs 32 + 3*32 + 5*(8*num_slots + 4)
bytes. Decoding is zero-copy: the arrays of a `Frame` are views into the received buffer.
"""

from __future__ import annotations

import enum
import functools
import struct
import time
import uuid
from dataclasses import dataclass

import numpy as np

MAGIC = 0x534D4652  # "RFMS" on the wire, little-endian "SMFR": SpecMesh FRame
VERSION = 3  # 2: records carry a choice index where version 1 had padding; 3: and the prompt's cached tokens
MAX_TOP_K = 20
NO_TOKEN = -1  # token id of an unused top-k slot (its logprob is -inf)
# A PROMPT frame scores prompt tokens from this index on: token 0 has no logprob, nothing comes before it.
FIRST_SCORED_TOKEN = 1
# seq_no and offset of a FINISHED record that ends a request wherever its output stands, never taken for a
# duplicate: sent by a worker that does not know how far the request got (a dead letter, whose workers died).
WHEREVER = 2**32 - 1
MAX_RECORD_TOKENS = 2**16 - 1  # a record's num_tokens is a u16
MAX_CHOICES = 2**16  # a record's choice index is a u16

HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("kind", "u1"),
        ("top_k", "u1"),
        ("worker_id", "<u4"),
        ("num_records", "<u4"),
        ("step", "<u8"),
        ("sent_at_us", "<u8"),  # wall clock when the step ended, microseconds since the epoch: for lag metrics
    ]
)

RECORD = np.dtype(
    [
        ("request_id", "V16"),  # uuid bytes
        ("seq_no", "<u4"),  # per request, counts this request's records of this kind: gaps are detectable
        ("offset", "<u4"),  # index in the request's output of this record's first token
        ("num_tokens", "<u2"),
        ("num_accepted", "<u2"),  # drafts accepted this step (TARGET: of the emitted tokens; DRAFT: of the drafted)
        ("status", "u1"),
        ("finish_reason", "u1"),
        ("choice", "<u2"),  # which of the request's n choices the record belongs to
        ("num_cached", "<u4"),  # TARGET at offset 0: prompt tokens the worker found in its prefix cache; else 0
    ]
)
assert HEADER.itemsize == 32 and RECORD.itemsize == 36
KIND_OFFSET = HEADER.fields["kind"][1]  # where a frame's kind byte lies: frame_kind reads it alone
# HEADER and RECORD as struct formats: the encoder packs and the decoder reads a header with one call each, instead
# of numpy's cost per structured array (a third of a frame's encoding time, paid by the engine every step).
HEADER_STRUCT = struct.Struct("<IHBBIIQQ")
RECORD_STRUCT = struct.Struct("<16sIIHHBBHI")
assert HEADER_STRUCT.size == HEADER.itemsize and RECORD_STRUCT.size == RECORD.itemsize
I32 = np.dtype("<i4")  # token ids and ranks on the wire
F32 = np.dtype("<f4")  # logprobs on the wire


class FrameKind(enum.IntEnum):
    TARGET = 1  # tokens the target model emitted, with the target's logprobs
    DRAFT = 2  # tokens the drafter proposed, with the drafter's logprobs (q)
    PROMPT = 3  # prompt tokens 1.. with the target's logprobs at the position before each (echo, prompt_logprobs)


class SeqStatus(enum.IntEnum):
    RUNNING = 0
    FINISHED = 1  # the record's tokens are the last ones; see finish_reason
    PREEMPTED = 2  # evicted for memory; it will resume and continue at `offset`


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # cancelled (client left, stop string found) or refused
    COMPLETE = 4  # the output's grammar is complete (structured output); the last token is content
    CONSTRAINT_FAILED = 5  # the grammar engine could not go on with the output's constraint (one of its limits)


MAX_STATUS = max(SeqStatus)
MAX_FINISH_REASON = max(FinishReason)


class FrameError(ValueError):
    """A frame that cannot be decoded. Consumers count these by `reason` and go on."""

    reason = "malformed"


class BadMagic(FrameError):
    reason = "bad_magic"


class UnsupportedVersion(FrameError):
    reason = "bad_version"


class TruncatedFrame(FrameError):
    reason = "truncated"


class CountMismatch(FrameError):
    reason = "count_mismatch"


class BadField(FrameError):
    reason = "bad_field"


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    worker_id: int
    step: int
    top_k: int
    sent_at_us: int
    records: np.ndarray  # [num_records] of RECORD
    token_ids: np.ndarray  # [num_tokens, num_slots] int32
    logprobs: np.ndarray  # [num_tokens, num_slots] float32
    ranks: np.ndarray  # [num_tokens] int32

    @property
    def num_slots(self) -> int:
        return self.top_k + 1

    def rows(self):
        """Yields (request_id, record, token_ids, logprobs, ranks) per record; arrays are views."""
        start = 0
        for rec in self.records:
            end = start + int(rec["num_tokens"])
            yield (
                request_id_from_bytes(rec["request_id"].tobytes()),
                rec,
                self.token_ids[start:end],
                self.logprobs[start:end],
                self.ranks[start:end],
            )
            start = end


# A running request's id is packed into a record every step: parsed once (UUID's parser is a page of Python, and
# after a model step it runs with cold caches), then looked up.
@functools.lru_cache(maxsize=4096)
def request_id_to_bytes(request_id: str) -> bytes:
    return uuid.UUID(hex=request_id).bytes


def request_id_from_bytes(raw: bytes) -> str:
    return raw.hex()  # what uuid.UUID(bytes=raw).hex spells, without building the UUID


@dataclass
class FrameBuilder:
    """Collects one step's records of one kind, then packs them in a single buffer."""

    kind: FrameKind
    worker_id: int
    step: int
    top_k: int

    def __post_init__(self) -> None:
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 0..{MAX_TOP_K}, got {self.top_k}")
        self._records: list[bytes] = []
        self._token_ids: list[bytes] = []
        self._logprobs: list[bytes] = []
        self._ranks: list[bytes] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(
        self,
        request_id: str,
        *,
        seq_no: int,
        offset: int,
        token_ids: np.ndarray,  # [n, num_slots] int
        logprobs: np.ndarray,  # [n, num_slots] float
        ranks: np.ndarray,  # [n] int
        num_accepted: int = 0,
        status: SeqStatus = SeqStatus.RUNNING,
        finish_reason: FinishReason = FinishReason.NONE,
        choice: int = 0,
        num_cached: int = 0,
    ) -> None:
        num_slots = self.top_k + 1
        n = len(ranks)
        if token_ids.shape != (n, num_slots) or logprobs.shape != (n, num_slots):
            raise ValueError(
                f"expected token_ids/logprobs of shape ({n}, {num_slots}), "
                f"got {token_ids.shape} and {logprobs.shape}"
            )
        self._records.append(RECORD_STRUCT.pack(
            request_id_to_bytes(request_id), seq_no, offset, n, num_accepted, status, finish_reason, choice, num_cached
        ))
        # Row-major bytes of each record's rows: joined, they are the frame's [num_tokens, num_slots] arrays.
        self._token_ids.append(_wire_bytes(token_ids, I32))
        self._logprobs.append(_wire_bytes(logprobs, F32))
        self._ranks.append(_wire_bytes(ranks, I32))

    def add_status(
        self,
        request_id: str,
        *,
        seq_no: int,
        offset: int,
        status: SeqStatus,
        finish_reason: FinishReason = FinishReason.NONE,
        choice: int = 0,
    ) -> None:
        """A record with no tokens: only the choice's new status (preempted, or finished without output)."""
        no_tokens = np.empty((0, self.top_k + 1))
        self.add(
            request_id, seq_no=seq_no, offset=offset, token_ids=no_tokens, logprobs=no_tokens, ranks=np.empty(0),
            status=status, finish_reason=finish_reason, choice=choice,
        )

    def encode(self) -> bytes:
        header = HEADER_STRUCT.pack(
            MAGIC, VERSION, self.kind, self.top_k, self.worker_id, len(self._records), self.step, time.time_ns() // 1000
        )
        return b"".join([header, *self._records, *self._token_ids, *self._logprobs, *self._ranks])


def _wire_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    # The engine's arrays have the wire's dtype already: tobytes() alone, without asarray's conversion machinery.
    if type(array) is np.ndarray and array.dtype == dtype:
        return array.tobytes()
    return np.asarray(array, dtype=dtype).tobytes()


def frame_kind(buf: bytes | memoryview) -> FrameKind:
    """The kind of a frame this process encoded, read from its header without decoding the rest."""
    return FrameKind(buf[KIND_OFFSET])


def decode(buf: bytes | memoryview) -> Frame:
    """Decodes a frame without copying its arrays. Raises a FrameError subclass on any inconsistency."""
    if len(buf) < HEADER.itemsize:
        raise TruncatedFrame(f"frame of {len(buf)} bytes is shorter than its {HEADER.itemsize}-byte header")
    magic, version, kind_value, top_k, worker_id, num_records, step, sent_at_us = HEADER_STRUCT.unpack_from(buf)
    if magic != MAGIC:
        raise BadMagic(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x}")
    if version != VERSION:
        raise UnsupportedVersion(f"frame version {version}, this build reads version {VERSION}")
    try:
        kind = FrameKind(kind_value)
    except ValueError:
        raise BadField(f"unknown frame kind {kind_value}") from None
    if top_k > MAX_TOP_K:
        raise BadField(f"top_k {top_k} exceeds {MAX_TOP_K}")
    pos = HEADER.itemsize
    if len(buf) < pos + num_records * RECORD.itemsize:
        raise TruncatedFrame(f"frame of {len(buf)} bytes cannot hold {num_records} records")
    records = np.frombuffer(buf, dtype=RECORD, count=num_records, offset=pos)
    pos += num_records * RECORD.itemsize
    if num_records and (records["status"].max() > MAX_STATUS or records["finish_reason"].max() > MAX_FINISH_REASON):
        raise BadField("record with an unknown status or finish reason")
    if num_records and (records["num_accepted"] > records["num_tokens"]).any():
        raise BadField("record with more accepted drafts than tokens")
    num_tokens = int(records["num_tokens"].sum(dtype=np.int64))
    num_slots = top_k + 1
    expected = pos + num_tokens * (8 * num_slots + 4)
    if len(buf) != expected:
        raise CountMismatch(f"records announce {num_tokens} tokens ({expected} bytes) but the frame has {len(buf)}")
    token_ids = np.frombuffer(buf, dtype="<i4", count=num_tokens * num_slots, offset=pos).reshape(num_tokens, num_slots)
    pos += token_ids.nbytes
    logprobs = np.frombuffer(buf, dtype="<f4", count=num_tokens * num_slots, offset=pos).reshape(num_tokens, num_slots)
    pos += logprobs.nbytes
    ranks = np.frombuffer(buf, dtype="<i4", count=num_tokens, offset=pos)
    return Frame(kind, worker_id, step, top_k, sent_at_us, records, token_ids, logprobs, ranks)
