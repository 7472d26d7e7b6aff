"""The MLP's gated activation over the merged gate/up projection, chosen by the config's name: SiLU (SwiGLU: Llama,
Qwen, Mistral and the others) or tanh-approximated GELU (GeGLU: Gemma 3, transformers' `gelu_pytorch_tanh`).

On CUDA both run the fused kernel of kernels/gated_mul.py; the `*_torch` functions are its twins and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from kernels import use_inference_kernel
from services.worker.model.config import GELU_TANH, SILU

GatedActivation = Callable[[Tensor], Tensor]  # gate_up [..., 2 * width] -> act(gate) * up [..., width]


def _halves(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    width = gate_up.shape[-1] // 2
    return gate_up.narrow(-1, 0, width), gate_up.narrow(-1, width, width)


def silu_and_mul_torch(gate_up: Tensor) -> Tensor:
    """silu(gate) * up [..., width], gate and up being the halves of gate_up [..., 2 * width]."""
    gate, up = _halves(gate_up)
    return F.silu(gate) * up


def gelu_tanh_and_mul_torch(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up [..., width], gate and up being the halves of gate_up [..., 2 * width]."""
    gate, up = _halves(gate_up)
    return F.gelu(gate, approximate="tanh") * up


_TWINS: dict[str, GatedActivation] = {SILU: silu_and_mul_torch, GELU_TANH: gelu_tanh_and_mul_torch}


def gated_activation(name: str) -> GatedActivation:
    """The activation as the module path runs it: the kernel on CUDA, the twin elsewhere."""
    twin = _TWINS[name]

    def act_and_mul(gate_up: Tensor) -> Tensor:
        if use_inference_kernel(gate_up):
            # Imported here: CPU callers never need triton.
            from kernels.gated_mul import gated_mul_launch

            return gated_mul_launch(gate_up, name)
        return twin(gate_up)

    return act_and_mul


def gated_activation_torch(name: str) -> GatedActivation:
    """The activation in torch ops, as the CPU's flat passes run it."""
    return _TWINS[name]
