"""A step's results in one device-to-host copy.

Every `.cpu()` of a CUDA tensor is a copy and a synchronisation; a step that fetched its tokens, accepted counts
and logprobs separately would wait on the device several times. `fetch` bit-casts the tensors to 32-bit words,
concatenates them on the device and copies once; on the CPU it only takes numpy views.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

WORD = torch.int32


def fetch(tensors: Sequence[Tensor]) -> list[np.ndarray]:
    """The tensors as host arrays, in order. Integer tensors come back as int32 (token ids, counts and ranks fit),
    float32 ones as float32."""
    if not tensors:
        return []
    if all(t.device.type == "cpu" for t in tensors):
        return [t.numpy() for t in tensors]
    for t in tensors:
        if t.dtype not in (torch.int64, torch.int32, torch.float32):
            raise TypeError(f"fetch copies int64, int32 and float32 tensors, not {t.dtype}")
    words = [(t.view(WORD) if t.dtype == torch.float32 else t.to(WORD)).reshape(-1) for t in tensors]
    host = torch.cat(words).cpu().numpy()
    arrays, start = [], 0
    for t in tensors:
        part = host[start : start + t.numel()].reshape(t.shape)
        arrays.append(part.view(np.float32) if t.dtype == torch.float32 else part)
        start += t.numel()
    return arrays
