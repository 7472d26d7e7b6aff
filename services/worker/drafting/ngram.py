"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the sequence's suffix.

Bookkeeping on token lists, in numpy: it runs on the host per sequence and needs no device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts by matching the longest suffix (max_ngram_size down to min_ngram_size tokens) seen earlier."""

    def __init__(self, max_ngram_size: int, min_ngram_size: int) -> None:
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(
                f"need 1 <= min_ngram_size <= max_ngram_size, got min {min_ngram_size}, max {max_ngram_size}"
            )
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size

    def propose(self, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """Up to num_drafts tokens; fewer when the match sits near the end, [] when no suffix recurs."""
        n = len(token_ids)
        if num_drafts <= 0 or n < self.min_ngram_size + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidates are earlier positions holding the last token, i.e. where a match of the suffix could end.
        # Matches are grown backwards one token at a time across all candidates at once, so the cost is
        # O(n + candidates * max_ngram_size) rather than a window compare per n-gram size.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return []
        match_len = np.ones(len(ends), dtype=np.int64)
        still_matching = np.ones(len(ends), dtype=bool)
        # An earlier occurrence ends by n-2, so no match is longer than n-1 tokens.
        for back in range(1, min(self.max_ngram_size, n - 1)):
            starts = ends - back
            agrees = (starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[n - 1 - back])
            still_matching &= agrees
            match_len += still_matching
        longest = int(match_len.max())
        if longest < self.min_ngram_size:
            return []
        end = int(ends[np.flatnonzero(match_len == longest)[-1]])
        return tokens[end + 1 : end + 1 + num_drafts].tolist()
