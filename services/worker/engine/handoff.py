"""The engine's side of a KV handoff (prefill/decode disaggregation): a prefill worker's engine exports each request
once every choice of it has its first token, and a decode worker's engine imports it so that the request goes on
exactly as it would have where it started.

What a choice's state is, between two steps, beside its tokens and counters (engine/sequence.py):
- the keys and values of its blocks up to its last computed position, in every cache layer (the MTP module's
  entries too, which run one position further, to the token sampled last);
- with MTP, the trunk's hidden state beside each block and the drafter's pending drafts with their q
  (drafting/mtp.py, MtpSlotState), so that the decode worker's first step verifies the drafts the prefill worker
  made: nothing is recomputed, and the stream is the one a single worker sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.drafting.mtp import MtpDrafter, MtpSlotState, Lag
from services.worker.engine.block_manager import blocks_for
from services.worker.engine.runner import ModelRunner
from services.worker.engine.sequence import Sequence, SeqState
from services.worker.handoff.format import (
    ChoiceMeta, Handoff, HandoffFormatError, HandoffMeta, MtpMeta, SectionMeta, decode, encode,
)
from shared.schemas import ChoiceProgress

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class HandoffMismatch(ValueError):
    """A handoff that does not fit this engine or this request: the request is recomputed instead."""


@dataclass
class ImportedChoice:
    """A choice's state from a prefill worker, held until the scheduler admits the choice."""

    meta: ChoiceMeta
    blocks: torch.Tensor  # [n, layers, 2, block_size, kv_heads, head_dim] its table's blocks first_block..
    boundary: torch.Tensor | None  # [n, hidden]
    mtp: MtpSlotState | None


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _tensor(section: SectionMeta, raw: memoryview) -> torch.Tensor:
    if section.dtype not in _DTYPES:
        raise HandoffFormatError(f"section {section.name} has dtype {section.dtype}, not a tensor dtype")
    dtype = _DTYPES[section.dtype]
    if not len(raw):  # torch.frombuffer refuses an empty buffer; a section may be empty (no pending drafts)
        return torch.empty(section.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(section.shape)


def ready_to_hand_off(seqs: list[Sequence]) -> list[list[Sequence]]:
    """The requests among these sequences (running or waiting) whose unfinished choices all have their first token,
    each as its choices: a prefill worker exports them."""
    by_request: dict[str, list[Sequence]] = {}
    for seq in seqs:
        by_request.setdefault(seq.request_id, []).append(seq)
    return [
        choices for choices in by_request.values()
        if all(s.state is SeqState.RUNNING and not s.is_prefilling and s.output_ids for s in choices)
    ]


def export_request(
    seqs: list[Sequence], runner: ModelRunner, mtp: MtpDrafter | None, revision: str
) -> bytes:
    """The handoff of a request's unfinished choices, each past its prefill with its first token; its blocks hold
    every head, however many ranks the runner is split over."""
    cache = runner.cache
    choices, sections, data = [], [], {}
    dtype = _DTYPE_NAMES[cache.keys[0].dtype]
    for seq in seqs:
        slot_state = mtp.export_slot(seq.slot) if mtp is not None else None
        computed_to = max(seq.num_computed, slot_state.end if slot_state is not None else 0)
        num_blocks = blocks_for(computed_to, cache.block_size)
        table = [int(b) for b in cache.block_tables[seq.slot, :num_blocks]]
        named = {"kv": runner.read_blocks(table)}
        mtp_meta = None
        if slot_state is not None:
            named["boundary"] = cache.boundary_hidden[torch.tensor(table, device=cache.boundary_hidden.device)]
            named["draft_probs"], named["draft_report"] = slot_state.draft_probs, slot_state.draft_report
            lag = slot_state.lag
            if lag is not None:
                named["lag_hidden"] = lag.hidden
            mtp_meta = MtpMeta(
                end=slot_state.end, draft_tokens=tuple(slot_state.draft_tokens),
                lag_start=None if lag is None else lag.start, lag_tokens=() if lag is None else tuple(lag.tokens),
            )
        choices.append(ChoiceMeta(
            choice=seq.choice, output_ids=tuple(seq.output_ids), num_computed=seq.num_computed,
            target_seq_no=seq.target_seq_no, draft_seq_no=seq.draft_seq_no, num_drafts=seq.num_drafts,
            num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens,
            num_cached_tokens=seq.num_cached_tokens, first_block=0, num_blocks=num_blocks, mtp=mtp_meta,
        ))
        for name, tensor in named.items():
            key = f"{seq.choice}.{name}"
            sections.append(SectionMeta(name=key, dtype=_DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape)))
            data[key] = _bytes(tensor)
    meta = HandoffMeta(
        request_id=seqs[0].request_id, revision=revision, block_size=cache.block_size, dtype=dtype,
        choices=tuple(choices), sections=tuple(sections),
    )
    return encode(meta, data)


def read_handoff(
    payload: bytes, progress: tuple[ChoiceProgress, ...], runner: ModelRunner, mtp: MtpDrafter | None, revision: str
) -> dict[int, ImportedChoice]:
    """Each choice's imported state, by choice index, once the handoff is checked against this engine (model
    revision, block size, dtype, drafter) and against where the request's output stands (`progress`, as its
    detokenizer answered): HandoffMismatch otherwise."""
    try:
        handoff = decode(payload)
    except HandoffFormatError as exc:
        raise HandoffMismatch(str(exc)) from exc
    meta = handoff.meta
    cache = runner.cache
    expected = (revision, cache.block_size, _DTYPE_NAMES[cache.keys[0].dtype])
    if (meta.revision, meta.block_size, meta.dtype) != expected:
        raise HandoffMismatch(
            f"handoff of model {meta.revision} in blocks of {meta.block_size} ({meta.dtype}); this worker runs "
            f"{expected[0]} in blocks of {expected[1]} ({expected[2]})"
        )
    stands = {p.index: p for p in progress}
    if {c.choice for c in meta.choices} != set(stands):
        raise HandoffMismatch(f"handoff of choices {[c.choice for c in meta.choices]}, output of {sorted(stands)}")
    imported = {}
    for choice in meta.choices:
        where = stands[choice.choice]
        if choice.output_ids != where.output_token_ids or choice.target_seq_no != where.next_seq_no:
            raise HandoffMismatch(f"choice {choice.choice}'s handoff is not where its output stands")
        if (choice.mtp is not None) != (mtp is not None):
            raise HandoffMismatch("the handoff's drafter state does not fit this worker's speculative method")
        if choice.mtp is not None and len(choice.mtp.draft_tokens) > mtp.num_steps:
            raise HandoffMismatch(
                f"{len(choice.mtp.draft_tokens)} pending drafts exceed this worker's {mtp.num_steps} MTP steps"
            )
        imported[choice.choice] = _imported(handoff, choice)
        _check_shapes(imported[choice.choice], runner)
    return imported


def _check_shapes(choice: ImportedChoice, runner: ModelRunner) -> None:
    """The handoff's blocks and states must fit this cache (checked here, not mid-step)."""
    cache = runner.cache
    blocks = choice.blocks.shape
    expected = (len(cache.keys), 2, cache.block_size, *runner.kv_position_shape)
    if tuple(blocks[1:]) != expected:
        raise HandoffMismatch(f"KV blocks of shape {tuple(blocks[1:])}; this worker's are {expected}")
    if choice.boundary is not None and (cache.boundary_hidden is None or
                                        choice.boundary.shape[1:] != cache.boundary_hidden.shape[1:]):
        raise HandoffMismatch("the handoff's boundary states do not fit this worker's cache")


def _imported(handoff: Handoff, choice: ChoiceMeta) -> ImportedChoice:
    def tensor(name: str) -> torch.Tensor | None:
        found = handoff.section(choice.choice, name)
        return None if found is None else _tensor(*found)

    blocks = tensor("kv")
    if blocks is None or blocks.shape[0] != choice.num_blocks - choice.first_block:
        raise HandoffMismatch(f"choice {choice.choice}'s handoff lacks its blocks")
    slot_state = None
    if choice.mtp is not None:
        lag = None
        if choice.mtp.lag_start is not None:
            lag = Lag(choice.mtp.lag_start, tensor("lag_hidden"), list(choice.mtp.lag_tokens))
        slot_state = MtpSlotState(
            choice.mtp.end, list(choice.mtp.draft_tokens), tensor("draft_probs"), tensor("draft_report"), lag
        )
    return ImportedChoice(choice, blocks, tensor("boundary"), slot_state)


def write_imported(seq: Sequence, imported: ImportedChoice, runner: ModelRunner, mtp: MtpDrafter | None) -> None:
    """Writes an admitted choice's state into its slot and blocks: the blocks it found cached come first, the
    handoff's after them."""
    cache = runner.cache
    table = [int(b) for b in cache.block_tables[seq.slot, imported.meta.first_block : imported.meta.num_blocks]]
    runner.write_blocks(table, imported.blocks)
    if imported.boundary is not None and cache.boundary_hidden is not None:
        device = cache.boundary_hidden.device
        cache.boundary_hidden.index_copy_(
            0, torch.tensor(table, device=device), imported.boundary.to(device, cache.boundary_hidden.dtype)
        )
    if mtp is not None and imported.mtp is not None:
        mtp.import_slot(seq.slot, imported.mtp)
