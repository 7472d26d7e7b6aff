"""Counter-based sampling: one token per row by the exponential race argmax_i p_i / -log(u_i), u keyed by
(seed, position, purpose), in one pass over the row. Twin: services/worker/sampling/sample.sample_torch (same
uniforms, same float64 ratios, same lowest-id tie-break), so the two return the same ids.

Layout: one program per row; it streams the row in BLOCK-wide chunks, keeping the best ratio and its id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.constants import Purpose
from kernels.noise import noise_key
from kernels.race import RACE_PLAIN, race

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _sample_kernel(probs_ptr, seeds_ptr, positions_ptr, out_ptr, vocab, PURPOSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = noise_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), PURPOSE)
    p_row = probs_ptr + row * vocab
    token, _ = race(p_row, p_row, 0, vocab, key, RACE_PLAIN, BLOCK)
    tl.store(out_ptr + row, token)


def sample_launch(probs: Tensor, seeds: Tensor, positions: Tensor, purpose: Purpose = Purpose.SAMPLE) -> Tensor:
    """Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): token ids [N] int64."""
    assert probs.dim() == 2, f"probs must be [N, V], got {tuple(probs.shape)}"
    rows, vocab = probs.shape
    assert seeds.shape == (rows,) and positions.shape == (rows,), "seeds and positions must be [N]"
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64, "seeds and positions must be int64"
    assert probs.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64), probs.dtype
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    _sample_kernel[(rows,)](
        probs.contiguous(),
        seeds.contiguous(),
        positions.contiguous(),
        out,
        vocab,
        PURPOSE=int(purpose),
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return out

