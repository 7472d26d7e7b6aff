"""Prefill/decode disaggregation: a prefill worker hands a request, its KV blocks and its drafter state, to a decode
worker (docs/frames.md, "KV handoff")."""
