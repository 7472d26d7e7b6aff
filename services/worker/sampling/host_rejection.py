"""The rejection rule for modelled drafts (MTP, draft models, EAGLE-3: a q per slot) on the CPU, in numpy over the
same memory: verify_torch's tokens and counts, bit for bit, in a few array ops.

A verify step at batch 1 with three drafts touches a handful of numbers (p(x) and q(x) per slot, three uniforms) and
samples one row; in torch ops, each dispatch costing microseconds on a small CPU, it took ~370 us, a tenth of a
sampled draft-model step. Here the per-slot test is numpy on gathered values, and only the rows that are sampled
(the residual after a rejection, or p after the last accepted draft) go through the race (sample_torch). Slots
whose q is a point mass (MTP's "with_ngram" filler) take the coupled test, and verify_torch runs them.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.constants import PAD_TOKEN
from services.worker.sampling.random import Purpose, uniform
from services.worker.sampling.rejection import VerifyInput, VerifyOutput, _slot_coordinates, check_verify_args
from services.worker.sampling.sample import sample_torch

NUMPY_FLOATS = {torch.float32, torch.float64}  # numpy has no bfloat16: other dtypes take verify_torch


def is_host_rejection(inp: VerifyInput, accept_policy: str, verify_strategy: str) -> bool:
    """Whether this is the rejection rule with modelled drafts on CPU tensors, which this module runs."""
    return (accept_policy == "normal" and verify_strategy == "rejection" and inp.draft_probs is not None
            and inp.target_probs.device.type == "cpu"
            and {inp.target_probs.dtype, inp.draft_probs.dtype} <= NUMPY_FLOATS)


def verify_host_rejection(inp: VerifyInput) -> VerifyOutput | None:
    """verify_torch's result for the rejection rule with q on the CPU; None when a drafted slot's q is a point mass
    (the caller runs verify_torch, whose coupled test covers it)."""
    check_verify_args(inp, "normal", "rejection")
    batch, num_slots = inp.draft_tokens.shape
    p = inp.target_probs.numpy()  # [B, K+1, V]
    q = inp.draft_probs.numpy()  # [B, K, V]
    drafts = inp.draft_tokens.numpy()
    num_drafts = inp.num_drafts.numpy()
    greedy = inp.greedy.numpy()
    has_draft = np.arange(num_slots) < num_drafts[:, None]  # [B, K]
    drafted = np.maximum(drafts, 0)[..., None]
    p_x = np.take_along_axis(p[:, :num_slots], drafted, axis=-1)[..., 0]  # [B, K]
    q_x = np.take_along_axis(q, drafted, axis=-1)[..., 0].astype(p_x.dtype)
    if (q_x >= 1.0)[has_draft].any():
        return None
    u = uniform(*_slot_coordinates(inp, num_slots), Purpose.ACCEPT)
    test = u.numpy().reshape(batch, num_slots) * q_x < p_x  # u < p/q without dividing, as verify_torch
    if greedy.any():
        test = np.where(greedy[:, None], drafts == p[:, :num_slots].argmax(axis=-1), test)
    num_accepted = np.cumprod(has_draft & test, axis=1).sum(axis=1)  # [B]
    rows = np.arange(batch)
    emitted = np.empty(batch, dtype=np.int64)
    if greedy.any():
        emitted[greedy] = p[rows[greedy], num_accepted[greedy]].argmax(axis=-1)
    sampled = rows[~greedy]
    if len(sampled):
        at = num_accepted[sampled]
        dist = p[sampled, at]  # [S, V] p after the accepted prefix
        rejected = at < num_drafts[sampled]
        if rejected.any():
            slot = np.minimum(at[rejected], num_slots - 1)
            residual = np.maximum(dist[rejected] - q[sampled[rejected], slot].astype(dist.dtype), 0)
            has_mass = residual.max(axis=-1) > 0
            dist[rejected] = np.where(has_mass[:, None], residual, dist[rejected])
        chosen = torch.from_numpy(sampled)
        emitted[sampled] = sample_torch(
            torch.from_numpy(dist), inp.seeds[chosen], inp.positions[chosen] + torch.from_numpy(at), Purpose.SAMPLE
        ).numpy()
    output = np.where(np.arange(num_slots) < num_accepted[:, None], drafts, PAD_TOKEN)
    output = np.concatenate([output, np.full((batch, 1), PAD_TOKEN, dtype=np.int64)], axis=1)
    output[rows, num_accepted] = emitted
    return VerifyOutput.of(torch.from_numpy(num_accepted.astype(np.int64)), torch.from_numpy(output))
