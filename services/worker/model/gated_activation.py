"""The MLP's gated activation over the merged gate/up projection, chosen by the config's name: SiLU (SwiGLU: Llama,
Qwen, Mistral and the others) or tanh-approximated GELU (GeGLU: Gemma 3).

Each has a fused kernel on CUDA (kernels/silu_mul.py, kernels/gelu_mul.py) and its torch twin elsewhere. Gemma's
GELU is transformers' `gelu_pytorch_tanh`, F.gelu(approximate="tanh").
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from kernels import use_inference_kernel
from services.worker.model.config import GELU_TANH, SILU
from services.worker.model.silu_mul import silu_and_mul, silu_and_mul_torch

GatedActivation = Callable[[Tensor], Tensor]  # gate_up [..., 2 * width] -> act(gate) * up [..., width]


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up [..., width], gate and up being the halves of gate_up [..., 2 * width]: the kernel on
    CUDA, its twin elsewhere."""
    if use_inference_kernel(gate_up):
        # Imported here: CPU callers never need triton.
        from kernels.gelu_mul import gelu_mul_launch

        return gelu_mul_launch(gate_up)
    return gelu_tanh_and_mul_torch(gate_up)


def gelu_tanh_and_mul_torch(gate_up: Tensor) -> Tensor:
    """`gelu_tanh_and_mul` in torch ops, on any device: the kernel's reference and the CPU path."""
    width = gate_up.shape[-1] // 2
    return F.gelu(gate_up.narrow(-1, 0, width), approximate="tanh") * gate_up.narrow(-1, width, width)


_ACTIVATIONS: dict[str, tuple[GatedActivation, GatedActivation]] = {
    SILU: (silu_and_mul, silu_and_mul_torch),
    GELU_TANH: (gelu_tanh_and_mul, gelu_tanh_and_mul_torch),
}


def gated_activation(name: str) -> GatedActivation:
    """The activation as the module path runs it: its kernel on CUDA where it has one."""
    return _ACTIVATIONS[name][0]


def gated_activation_torch(name: str) -> GatedActivation:
    """The activation in torch ops, as the CPU's flat passes run it."""
    return _ACTIVATIONS[name][1]
