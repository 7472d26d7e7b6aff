"""The bytes of a KV handoff: what a prefill worker sends a decode worker so that the request continues there exactly
as it would have on the prefill worker (docs/frames.md, "KV handoff").

    MAGIC "SMKV" | VERSION u16 | META_LEN u32 | meta (JSON, HandoffMeta) | sections, in meta.sections' order

Each section is a raw little-endian array (its dtype and shape in the meta). Per choice i:
- `i.kv` [blocks, layers, 2, block_size, kv_heads, head_dim]: the keys and values of blocks first_block.. of its
  table, every cache layer (the MTP module's included); block-major, so that leading blocks the receiver already
  holds are cut off by slicing (`trim`);
- `i.boundary` [blocks, hidden]: the trunk's hidden state at each block's last position (MTP only);
- `i.draft_probs`, `i.draft_report` [drafts, vocab]: the pending MTP drafts' q and reported logprobs;
- `i.lag_hidden` [lag, hidden]: trunk states the MTP module has not consumed yet.

Torch-free: the event loop trims and forwards these bytes; only the engine process turns sections into tensors.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.config import DTYPE_BYTES

MAGIC = b"SMKV"
VERSION = 1
PREAMBLE = struct.Struct("<4sHI")  # magic, version, meta length
BLOCK_SECTIONS = ("kv", "boundary")  # sections whose leading dimension is the choice's blocks


class HandoffFormatError(ValueError):
    """Bytes that are no handoff this version reads (a corrupt or foreign payload): never decoded further."""


class SectionMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape)


class MtpMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    end: int = Field(ge=0)  # the module's entries are written below this position
    draft_tokens: tuple[int, ...] = ()
    lag_start: int | None = None
    lag_tokens: tuple[int, ...] = ()


class ChoiceMeta(BaseModel):
    """One choice's state after its prefill, as engine/sequence.py keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    choice: int = Field(ge=0)
    output_ids: tuple[int, ...] = Field(min_length=1)
    num_computed: int = Field(ge=1)
    target_seq_no: int = Field(ge=0)
    draft_seq_no: int = Field(ge=0)
    num_drafts: int = Field(0, ge=0)
    num_draft_tokens: int = Field(0, ge=0)
    num_accepted_tokens: int = Field(0, ge=0)
    num_cached_tokens: int = Field(0, ge=0)
    first_block: int = Field(ge=0)  # the index in its table of the first block sent
    num_blocks: int = Field(ge=1)  # blocks of its table holding its state (sent or not)
    mtp: MtpMeta | None = None


class HandoffMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    revision: str = Field(max_length=64)  # the model revision: KV of another model never enters a cache
    block_size: int = Field(ge=1)
    dtype: str
    choices: tuple[ChoiceMeta, ...] = Field(min_length=1)
    sections: tuple[SectionMeta, ...]


@dataclass(frozen=True)
class Handoff:
    meta: HandoffMeta
    sections: dict[str, memoryview]  # by name, each meta.sections' bytes

    def section(self, choice: int, name: str) -> tuple[SectionMeta, memoryview] | None:
        key = f"{choice}.{name}"
        for section in self.meta.sections:
            if section.name == key:
                return section, self.sections[key]
        return None


def encode(meta: HandoffMeta, sections: dict[str, bytes]) -> bytes:
    meta_bytes = orjson.dumps(meta.model_dump())
    parts = [PREAMBLE.pack(MAGIC, VERSION, len(meta_bytes)), meta_bytes]
    for section in meta.sections:
        data = sections[section.name]
        if len(data) != section.nbytes:
            raise ValueError(f"section {section.name} holds {len(data)} bytes, its shape {section.shape} needs "
                             f"{section.nbytes}")
        parts.append(data)
    return b"".join(parts)


def decode(data: bytes | memoryview) -> Handoff:
    view = memoryview(data)
    if len(view) < PREAMBLE.size:
        raise HandoffFormatError(f"a handoff of {len(view)} bytes is shorter than its preamble")
    magic, version, meta_len = PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise HandoffFormatError(f"not a handoff (magic {magic!r})")
    if version != VERSION:
        raise HandoffFormatError(f"handoff version {version}; this worker reads version {VERSION}")
    offset = PREAMBLE.size + meta_len
    try:
        meta = HandoffMeta.model_validate(orjson.loads(bytes(view[PREAMBLE.size : offset])))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        raise HandoffFormatError(f"unreadable handoff meta: {exc}") from exc
    sections = {}
    for section in meta.sections:
        if section.dtype not in DTYPE_BYTES:
            raise HandoffFormatError(f"section {section.name} has unknown dtype {section.dtype}")
        end = offset + section.nbytes
        if end > len(view):
            raise HandoffFormatError(f"section {section.name} runs past the handoff's {len(view)} bytes")
        sections[section.name] = view[offset:end]
        offset = end
    if offset != len(view):
        raise HandoffFormatError(f"{len(view) - offset} bytes past the handoff's last section")
    return Handoff(meta, sections)


def trim(data: bytes, first_block: int) -> bytes:
    """The handoff without each choice's blocks before `first_block` (the receiver holds them in its prefix cache):
    their keys, values and boundary states are cut off, and first_block moves on."""
    handoff = decode(data)
    choices, sections, kept = [], [], {}
    for choice in handoff.meta.choices:
        cut = max(0, min(first_block, choice.num_blocks - 1) - choice.first_block)  # the last block always travels
        choices.append(choice.model_copy(update={"first_block": choice.first_block + cut}))
        for name in BLOCK_SECTIONS:
            found = handoff.section(choice.choice, name)
            if found is None:
                continue
            section, raw = found
            row = section.nbytes // section.shape[0]
            sections.append(section.model_copy(update={"shape": (section.shape[0] - cut, *section.shape[1:])}))
            kept[section.name] = raw[cut * row :]
    others = [s for s in handoff.meta.sections if s.name not in kept]
    meta = handoff.meta.model_copy(update={"choices": tuple(choices), "sections": tuple(sections + others)})
    return encode(meta, {**{s.name: handoff.sections[s.name] for s in others}, **kept})
