"""Random weights from config.json alone (`--load-format dummy`, as vLLM's): real-size shapes served and
measured without a checkpoint. Only speed means anything with them; the tokens are noise.

Initialisation follows transformers' for Llama and Qwen2: projections and embeddings N(0, 0.02), biases 0, norms
1, so activations stay finite in bfloat16 at any depth. Each tensor is drawn in its final dtype on its final
device from its own generator, seeded from the parameter's name: no float32 copy on the host for an 8B shape, and
a parameter's values depend on (seed, name, shape, dtype, device type) only, not on which other parameters exist.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from services.worker.model.layers import RMSNorm

DUMMY_SEED = 0
DUMMY_INIT_STD = 0.02  # transformers' initializer_range default, which Llama and Qwen2 checkpoints keep
_SEED_MASK = (1 << 63) - 1  # torch seeds are taken modulo 2**64; keep them positive


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed + zlib.crc32(name.encode())) & _SEED_MASK)


def dummy_state_dict(
    model: nn.Module, dtype: torch.dtype, device: torch.device | str, seed: int = DUMMY_SEED
) -> dict[str, torch.Tensor]:
    """A value for every parameter of `model` (built on the meta device), keyed as in model.state_dict()."""
    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if isinstance(module, RMSNorm):
                value.fill_(1.0)
            elif param_name == "bias":
                value.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                value.normal_(0.0, DUMMY_INIT_STD, generator=_generator(name, seed, device))
            else:
                raise TypeError(f"no dummy initialisation for {name} ({type(module).__name__})")
            state[name] = value
    return state
