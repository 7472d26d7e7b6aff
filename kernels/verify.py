"""Fused verification: every strategy of services/worker/sampling/rejection.py, the gathering of the emitted
tokens, and the packed output offsets (exclusive cumulative sum of num_emitted), in one kernel.
Twin: services/worker/sampling/rejection.verify_torch.

Layout: one program per request row. It walks the drafts in order and stops at the first rejection, so a row
reads only the vocabulary rows it needs: none for a rejection test (two gathers), one scan per slot for argmax,
target_match or topp, plus one scan for the token emitted after the prefix (argmax, or the exponential race over
p or over the residual). It writes num_accepted and the row of output tokens. The offsets need every row's count:
each program publishes its count atomically and takes a ticket; the program holding the last ticket has seen
every count (acquire-release atomics) and writes the whole exclusive cumsum.

The noise is sampling/random.py's hash (kernels/noise.py) and each ratio is formed as in the twin, so the emitted
ids match the twin exactly. One decision is order-dependent: topp's mass above the draft is a float64 sum, whose
rounding can differ from torch's in the last bits; only a top_p within that rounding of a boundary can differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.constants import ACCEPT_POLICY_CODES, PAD_TOKEN, VERIFY_STRATEGY_CODES, Purpose
from kernels.noise import noise_key, uniform_scalar
from kernels.race import RACE_PLAIN, RACE_POINT_MASS, RACE_RESIDUAL, argmax, race

REJECTION = tl.constexpr(VERIFY_STRATEGY_CODES["rejection"])
TARGET_MATCH = tl.constexpr(VERIFY_STRATEGY_CODES["target_match"])
GREEDY = tl.constexpr(VERIFY_STRATEGY_CODES["greedy"])
NORMAL = tl.constexpr(ACCEPT_POLICY_CODES["normal"])
ACCEPT_ALL = tl.constexpr(ACCEPT_POLICY_CODES["accept_all"])
REJECT_ALL = tl.constexpr(ACCEPT_POLICY_CODES["reject_all"])
PAD = tl.constexpr(PAD_TOKEN)
ACCEPT = tl.constexpr(int(Purpose.ACCEPT))
SAMPLE = tl.constexpr(int(Purpose.SAMPLE))
BLOCK = 1024
OFFSETS_BLOCK = 256
NUM_WARPS = 4


@triton.jit
def _mass_above(p_row, threshold, vocab, BLOCK: tl.constexpr):
    """Float64 sum of the entries strictly above threshold."""
    total = tl.full((), 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):
        index = start + tl.arange(0, BLOCK)
        p = tl.load(p_row + index, mask=index < vocab, other=0.0).to(tl.float64)
        total += tl.sum(tl.where(p > threshold, p, 0.0), axis=0)
    return total


@triton.jit
def _draft_passes(p_row, q_row, drafted, is_greedy, seed, position, top_p, vocab,
                  STRATEGY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Whether one draft passes its strategy's test (greedy rows: draft == argmax p under every strategy)."""
    p_at_draft = tl.load(p_row + drafted)
    if is_greedy | (STRATEGY == GREEDY):
        passes = drafted == argmax(p_row, vocab, BLOCK)
    elif STRATEGY == REJECTION:
        q_at_draft = tl.full((), 1.0, p_at_draft.dtype)
        if HAS_Q:
            q_at_draft = tl.load(q_row + drafted).to(p_at_draft.dtype)
        if q_at_draft >= 1.0:  # a point mass: the coupled test, x == the target's own sample (see the twin)
            target_sample, _ = race(p_row, p_row, drafted, vocab, noise_key(seed, position, SAMPLE), RACE_PLAIN, BLOCK)
            passes = drafted == target_sample
        else:
            u = uniform_scalar(noise_key(seed, position, ACCEPT))
            passes = u * q_at_draft < p_at_draft
    elif STRATEGY == TARGET_MATCH:
        target_sample, _ = race(p_row, p_row, drafted, vocab, noise_key(seed, position, SAMPLE), RACE_PLAIN, BLOCK)
        passes = drafted == target_sample
    else:
        mass = _mass_above(p_row, p_at_draft.to(tl.float64), vocab, BLOCK)
        passes = (p_at_draft > 0) & (mass < top_p.to(tl.float64))
    return passes


@triton.jit
def _emitted(p_row, q_row, drafted, rejected, is_greedy, key, vocab,
             STRATEGY: tl.constexpr, POLICY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The token after the accepted prefix: argmax p for greedy rows, else a race over p or the residual."""
    token = tl.full((), 0, tl.int64)
    if is_greedy:
        token = argmax(p_row, vocab, BLOCK)
    elif (STRATEGY == REJECTION) & (POLICY == NORMAL):
        if rejected:
            if HAS_Q:
                token, ratio = race(p_row, q_row, drafted, vocab, key, RACE_RESIDUAL, BLOCK)
            else:
                token, ratio = race(p_row, q_row, drafted, vocab, key, RACE_POINT_MASS, BLOCK)
            if ratio <= 0:  # the residual has no mass (float rounding): fall back to p, as the twin does
                token, _ = race(p_row, q_row, drafted, vocab, key, RACE_PLAIN, BLOCK)
        else:
            token, _ = race(p_row, q_row, drafted, vocab, key, RACE_PLAIN, BLOCK)
    else:
        token, _ = race(p_row, q_row, drafted, vocab, key, RACE_PLAIN, BLOCK)
    return token


@triton.jit
def _write_offsets(num_accepted_ptr, offsets_ptr, batch, OFFSETS_BLOCK: tl.constexpr):
    """Exclusive cumsum of num_accepted + 1, reading the counts with atomics so they are the published ones."""
    carry = tl.full((), 0, tl.int64)
    for start in range(0, batch, OFFSETS_BLOCK):
        index = start + tl.arange(0, OFFSETS_BLOCK)
        inside = index < batch
        emitted = tl.atomic_add(num_accepted_ptr + index, 0, mask=inside) + 1
        emitted = tl.where(inside, emitted, 0)
        tl.store(offsets_ptr + index, carry + tl.cumsum(emitted, axis=0) - emitted, mask=inside)
        carry += tl.sum(emitted, axis=0)


@triton.jit
def _verify_kernel(target_ptr, draft_tokens_ptr, num_drafts_ptr, draft_probs_ptr, greedy_ptr, seeds_ptr,
                   positions_ptr, top_p_ptr, num_accepted_ptr, output_ptr, offsets_ptr, tickets_ptr,
                   batch, num_slots, vocab,
                   STRATEGY: tl.constexpr, POLICY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
                   SLOTS_BLOCK: tl.constexpr, OFFSETS_BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    num_drafts = tl.load(num_drafts_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    p_rows = target_ptr + row * (num_slots + 1) * vocab
    q_rows = draft_probs_ptr + row * num_slots * vocab
    drafts = draft_tokens_ptr + row * num_slots

    num_accepted = tl.full((), 0, tl.int64)
    going = num_drafts > 0
    while going:
        drafted = tl.load(drafts + num_accepted)
        if POLICY == ACCEPT_ALL:
            passes = tl.full((), True, tl.int1)
        elif POLICY == REJECT_ALL:
            passes = tl.full((), False, tl.int1)
        else:
            passes = _draft_passes(p_rows + num_accepted * vocab, q_rows + num_accepted * vocab, drafted, is_greedy,
                                   seed, position + num_accepted, top_p, vocab, STRATEGY, HAS_Q, BLOCK)  # fmt: skip
        num_accepted += passes.to(tl.int64)
        going = passes & (num_accepted < num_drafts)

    rejected = num_accepted < num_drafts
    at = tl.minimum(num_accepted, tl.maximum(num_slots - 1, 0))  # the rejected slot, when there is one
    drafted = tl.load(drafts + at, mask=rejected, other=0)
    key = noise_key(seed, position + num_accepted, SAMPLE)
    token = _emitted(p_rows + num_accepted * vocab, q_rows + at * vocab, drafted, rejected, is_greedy, key, vocab,
                     STRATEGY, POLICY, HAS_Q, BLOCK)  # fmt: skip

    slots = tl.arange(0, SLOTS_BLOCK)
    accepted_drafts = tl.load(drafts + slots, mask=slots < num_accepted, other=PAD)
    out = tl.where(slots == num_accepted, token, accepted_drafts)
    tl.store(output_ptr + row * (num_slots + 1) + slots, out, mask=slots <= num_slots)

    tl.atomic_xchg(num_accepted_ptr + row, num_accepted)
    if tl.atomic_add(tickets_ptr, 1) == batch - 1:
        _write_offsets(num_accepted_ptr, offsets_ptr, batch, OFFSETS_BLOCK)


def verify_launch(
    target_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    draft_probs: Tensor | None,
    greedy: Tensor,
    seeds: Tensor,
    positions: Tensor,
    top_p: Tensor | None,
    strategy: int,
    policy: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    The tensors are sampling/rejection.VerifyInput's fields (draft_probs None: point-mass drafts; top_p None:
    only the topp strategy reads it); strategy and policy are codes of kernels/constants.py. Returns int64
    (num_accepted [B], output_tokens [B, K+1]: accepted drafts, the emitted token, then PAD_TOKEN, and offsets [B]:
    the exclusive cumsum of num_accepted + 1).
    """
    assert draft_tokens.dim() == 2, f"draft_tokens must be [B, K], got {tuple(draft_tokens.shape)}"
    batch, num_slots = draft_tokens.shape
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (batch, num_slots + 1), (
        f"target_probs {tuple(target_probs.shape)} must be [B, K+1, V] for draft_tokens {(batch, num_slots)}"
    )
    assert draft_probs is None or draft_probs.shape == (batch, num_slots, target_probs.shape[2]), (
        f"draft_probs {tuple(draft_probs.shape)} must be [B, K, V]"
    )
    per_row = {"num_drafts": num_drafts, "greedy": greedy, "seeds": seeds, "positions": positions, "top_p": top_p}
    for name, value in per_row.items():
        assert value is None or value.shape == (batch,), f"{name} {tuple(value.shape)} must be [B] = ({batch},)"
    assert draft_tokens.dtype == torch.int64 and num_drafts.dtype == torch.int64, "tokens must be int64"
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64, "seeds, positions must be int64"
    assert strategy in VERIFY_STRATEGY_CODES.values(), f"unknown strategy code {strategy}"
    assert policy in ACCEPT_POLICY_CODES.values(), f"unknown policy code {policy}"
    assert strategy != VERIFY_STRATEGY_CODES["topp"] or top_p is not None, "the topp strategy needs top_p"
    vocab = target_probs.shape[2]
    device = target_probs.device
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    output_tokens = torch.full((batch, num_slots + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    offsets = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch > 0:
        target = target_probs.contiguous()
        top_p = top_p if top_p is not None else torch.ones(batch, device=device)
        _verify_kernel[(batch,)](
            target,
            draft_tokens.contiguous(),
            num_drafts.contiguous(),
            target if draft_probs is None else draft_probs.contiguous(),
            greedy.to(torch.int8),
            seeds.contiguous(),
            positions.contiguous(),
            top_p.to(torch.float64).contiguous(),  # the twin compares in float64 too
            num_accepted,
            output_tokens,
            offsets,
            torch.zeros(1, dtype=torch.int32, device=device),
            batch,
            num_slots,
            vocab,
            STRATEGY=strategy,
            POLICY=policy,
            HAS_Q=draft_probs is not None,
            BLOCK=BLOCK,
            SLOTS_BLOCK=triton.next_power_of_2(num_slots + 1),
            OFFSETS_BLOCK=OFFSETS_BLOCK,
            num_warps=NUM_WARPS,
        )
    return num_accepted, output_tokens, offsets
