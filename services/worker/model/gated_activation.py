"""The MLP's gated activation over the merged gate/up projection, chosen by the config's name: SiLU (SwiGLU: Llama,
Qwen, Mistral and the others) or tanh-approximated GELU (GeGLU: Gemma 3).

SiLU has a fused kernel on CUDA (model/silu_mul.py). GELU runs as torch ops on every device: Gemma's is
transformers' `gelu_pytorch_tanh`, F.gelu(approximate="tanh"), and these are its exact ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from services.worker.model.config import GELU_TANH, SILU
from services.worker.model.silu_mul import silu_and_mul, silu_and_mul_torch

GatedActivation = Callable[[Tensor], Tensor]  # gate_up [..., 2 * width] -> act(gate) * up [..., width]


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up [..., width], gate and up being the halves of gate_up [..., 2 * width]."""
    width = gate_up.shape[-1] // 2
    return F.gelu(gate_up.narrow(-1, 0, width), approximate="tanh") * gate_up.narrow(-1, width, width)


_ACTIVATIONS: dict[str, tuple[GatedActivation, GatedActivation]] = {
    SILU: (silu_and_mul, silu_and_mul_torch),
    GELU_TANH: (gelu_tanh_and_mul, gelu_tanh_and_mul),
}


def gated_activation(name: str) -> GatedActivation:
    """The activation as the module path runs it: its kernel on CUDA where it has one."""
    return _ACTIVATIONS[name][0]


def gated_activation_torch(name: str) -> GatedActivation:
    """The activation in torch ops, as the CPU's flat passes run it."""
    return _ACTIVATIONS[name][1]
