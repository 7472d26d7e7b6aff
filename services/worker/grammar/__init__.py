"""Structured output in the engine: each constrained sequence's grammar state, the token masks it yields for a step's
rows (drafts included), the drafts it forbids and the tokens it forces."""
