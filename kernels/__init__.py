"""Triton kernels for the hot spots of speculative decoding: n-gram lookup, fused verification, frame logprobs,
counter-based sampling.

Each module holds a kernel, its launcher (shape checks, then the launch), its torch twin (the reference it must
match) and a dispatcher that launches the kernel for CUDA tensors and runs the twin otherwise. Importing this
package does not import triton; the modules that do are imported only when a CUDA tensor reaches them.
"""

from __future__ import annotations

import os

from torch import Tensor

DISABLE_ENV = "SPECMESH_DISABLE_KERNELS"  # set to 1 to run the torch twins on CUDA too (to bisect a kernel bug)


def use_kernel(tensor: Tensor) -> bool:
    """Whether a dispatcher should launch its kernel for this tensor."""
    return tensor.is_cuda and os.environ.get(DISABLE_ENV, "0") != "1"
