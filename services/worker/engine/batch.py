"""Per-row tensors of a batch of sequences: their sampling parameters, seeds and output positions."""

from __future__ import annotations

import torch

from services.worker.engine.sequence import Sequence


def sampling_tensors(
    seqs: list[Sequence], device: torch.device, rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row temperature, top_k, top_p and min_p (None when no sequence asks for min-p) for `rows` consecutive rows
    of each sequence: process_logits' arguments."""
    temp = torch.tensor([s.sampling.temperature for s in seqs], device=device).repeat_interleave(rows)
    top_k = torch.tensor([s.sampling.top_k for s in seqs], device=device).repeat_interleave(rows)
    top_p = torch.tensor([s.sampling.top_p for s in seqs], device=device).repeat_interleave(rows)
    min_p = None
    if any(s.sampling.min_p > 0 for s in seqs):
        min_p = torch.tensor([s.sampling.min_p for s in seqs], device=device).repeat_interleave(rows)
    return temp, top_k, top_p, min_p


def seeds_positions(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's seed and the output position of the next token it emits."""
    seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=device)
    positions = torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long, device=device)
    return seeds, positions


def greedy_mask(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    return torch.tensor([s.sampling.greedy for s in seqs], device=device)
