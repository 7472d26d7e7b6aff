"""Rotary inverse frequencies and the cos/sin scale for each supported rope type, computed as transformers
computes them (modeling_rope_utils), so that scaled checkpoints give transformers' logits.

`rope_frequencies` returns inv_freq [head_dim / 2] (float32): the angle of position p in dimension pair i is
p * inv_freq[i]; and attention scaling, a factor on cos and sin (YaRN's mscale; 1.0 elsewhere). Dynamic NTK is
served only where it is static (see ModelConfig.rope_position_limit), so its frequencies are those transformers
builds at load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from services.worker.model.config import ModelConfig, RopeScaling

# YaRN's ramp between two equal bounds would divide by zero; transformers widens it by this much.
YARN_RAMP_EPSILON = 0.001
YARN_MSCALE_SLOPE = 0.1  # attention factor = 0.1 * mscale * ln(factor) + 1 (YaRN paper)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32 on the host, attention scaling of cos and sin) for cfg's rope type. On the
    host whatever the default device: a model built on the meta device would otherwise run these ops there, through
    torch's Python references, whose first use imports torch._dynamo (a second of a worker's start)."""
    scaling = cfg.rope_scaling
    with torch.device("cpu"):
        return _BUILDERS[scaling.rope_type](scaling, cfg.rope_theta, cfg.head_dim, cfg.max_position_embeddings)


def _exponents(dim: int) -> torch.Tensor:
    """[dim / 2] the exponents 2i / dim of the base, as transformers rounds them."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(scaling: RopeScaling, base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    return 1.0 / base ** _exponents(dim), 1.0


def _linear(scaling: RopeScaling, base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Positions divided by factor, i.e. every frequency is."""
    return 1.0 / base ** _exponents(dim) / scaling.factor, 1.0


def _dynamic(scaling: RopeScaling, base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """NTK-aware base at sequence length max_positions: what transformers builds at load and keeps while no
    sequence is longer (the base's multiplier is (factor - (factor - 1)) ** ..., 1 up to rounding)."""
    seq_len = max_positions
    base = base * ((scaling.factor * seq_len / max_positions) - (scaling.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** _exponents(dim), 1.0


def _llama3(scaling: RopeScaling, base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / base ** _exponents(dim)
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else YARN_MSCALE_SLOPE * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, original: int) -> float:
    """The dimension whose wavelength fits `rotations` times in the original context."""
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn(scaling: RopeScaling, base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than beta_slow times in the original context are interpolated
    (divided by factor), those that rotate more than beta_fast times are kept, a linear ramp between; cos and
    sin are scaled by the attention factor."""
    original = scaling.original_max_position_embeddings
    factor = scaling.factor if scaling.factor is not None else max_positions / original
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    low = _yarn_correction_dim(scaling.beta_fast, dim, base, original)
    high = _yarn_correction_dim(scaling.beta_slow, dim, base, original)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += YARN_RAMP_EPSILON
    pos_freqs = base ** _exponents(dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    extrapolated = 1 - ramp  # share of each dimension kept unscaled
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


_BUILDERS: dict[str, Callable[[RopeScaling, float, int, int], tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn,
}
