"""Triton kernels for the hot spots of speculative decoding: n-gram lookup, fused verification, frame logprobs,
counter-based sampling.

Each module holds a kernel and its launcher (shape checks, then the launch), taking plain tensors and ints. The
torch twins (the references the kernels must match) and the dispatchers live with the worker's ops
(services/worker/sampling/, drafting/ngram_batch.py), which import a kernel module lazily, when a CUDA tensor
reaches them. The dependency is one-way: nothing here imports the worker (tests/test_layering.py). This package
and kernels/constants.py, the values kernels and twins share, do not import triton.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing torch here would load it into every service that reads kernels/constants.py
    from torch import Tensor

DISABLE_ENV = "SPECMESH_DISABLE_KERNELS"  # set to 1 to run the torch twins on CUDA too (to bisect a kernel bug)


def use_kernel(tensor: Tensor) -> bool:
    """Whether a dispatcher should launch its kernel for this tensor."""
    return tensor.is_cuda and os.environ.get(DISABLE_ENV, "0") != "1"


def use_inference_kernel(tensor: Tensor) -> bool:
    """Whether a model op (norm, rotary, activation) should launch its kernel: as `use_kernel`, and only while
    autograd records nothing, because the kernels have no backward (a CUDA training step runs the twins)."""
    import torch

    return use_kernel(tensor) and not torch.is_grad_enabled()
