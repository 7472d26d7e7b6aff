"""Tensor-level speculative decoding: counter-based randomness, sampling, logprobs, n-gram drafts, verification.

Pure functions over tensors (and, for n-gram lookup, token lists). The engine owns the state; nothing here keeps any.
"""
