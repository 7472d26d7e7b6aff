"""Tensor ops that turn logits into tokens: counter-based randomness, sampling, verification of drafts, and the
logprobs frames report. One op per module: its torch twin and a dispatcher that runs the Triton kernel of
kernels/ on CUDA (imported lazily, so CPU callers never need triton). Stateless; the engine owns the state."""
