"""Weight-only int8 projections, for the drafters on the CPU (SpeculativeConfig.draft_quantization).

A drafting pass on the CPU is bound by streaming its weights from memory: one EAGLE-3 head of the demo model reads
7.3 MB of float32 per pass, half of what the whole 4-layer target reads, and the 3072-token LM head alone 3 MB. Stored
as int8 rows with one scale each, a projection reads a quarter of that, and torch's int8 matrix product over bfloat16
activations ran 2.2-2.8x faster than the float32 one (1 thread, cold weights: 256 x 3072 at one row 51 against 119 us,
256 x 1408 23 against 54 us).

Where they are used: as twins beside the float weights, by greedy requests, which draft apart from sampled ones
(drafting/draft_sampling.precision_groups), and there only for what does not outlive the step, the drafter's logits
and the chain passes that feed it its own drafts (their cache entries lie past the sequence's end and the next
catch-up overwrites them). A greedy request's output is the target's argmax whatever is drafted. A sampled
request's q shapes its seeded sample, and bfloat16 activations turn the last-bit differences that batching leaves in
the target's features into visible ones (3 of 24 seeded requests changed with the batch when every pass was int8),
so its passes stay float; so do the catch-up passes, whose cache entries a later request may read through the prefix
cache. The target is never quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.worker.model.plain_module import PlainModule
from shared.config import EngineConfig

INT8_MAX = 127  # symmetric: -127..127, so that a row's scale maps its largest magnitude exactly
# The int8 kernel's fast path takes bfloat16 activations; float32 ones measured ~9x slower than float32 weights.
ACTIVATION_DTYPE = torch.bfloat16
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
# The kernel reads a row in blocks of this many inputs: with other widths it returned wrong sums or crashed (torch
# 2.13, CPU), so a projection whose input width is not a multiple stays as loaded.
INPUT_BLOCK = 16


def int8_matmul_available() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(PlainModule):
    """y = x @ (scales * q)^T (+ bias): q [out, in] int8, one bfloat16 scale per output row; y in x's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        """weight [out, in], the projection's float weight."""
        super().__init__()
        w = weight.detach().float().contiguous()
        # [out] in the kernel's dtype first, so that each weight is rounded to the grid the kernel multiplies by
        scales = (w.abs().amax(dim=1).clamp(min=_MIN_SCALE) / INT8_MAX).to(ACTIVATION_DTYPE)
        steps = torch.round(w / scales.float()[:, None]).clamp(-INT8_MAX, INT8_MAX)
        self.register_buffer("qweight", steps.to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(ACTIVATION_DTYPE)  # [N, in]
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scales).to(x.dtype)  # [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self) -> Tensor:
        """The weight [out, in] this projection multiplies by, in float32."""
        return self.qweight.float() * self.scales.float()[:, None]


def quantizable(weight: Tensor) -> bool:
    """Whether a weight [out, in] can be stored as an Int8Linear."""
    return weight.shape[1] % INPUT_BLOCK == 0


def int8_twin(weight: Tensor, bias: Tensor | None = None) -> Int8Linear | None:
    """The Int8Linear of a float weight [out, in] (None where the kernel does not take its width): built beside the
    float projection, which stays for the passes that must not be quantized."""
    return Int8Linear(weight, bias) if quantizable(weight) else None


def drafter_in_int8(config: EngineConfig) -> bool:
    """Whether this engine drafts greedy requests in int8: as the config resolves it, where torch has the kernel."""
    if not config.quantizes_drafter:
        return False
    if int8_matmul_available():
        return True
    if config.speculative.draft_quantization == "int8":
        raise ValueError('draft_quantization "int8": this torch has no int8 matrix product (torch._weight_int8pack_mm)')
    return False
