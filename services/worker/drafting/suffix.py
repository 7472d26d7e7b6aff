"""Suffix decoding: draft the continuation that most often followed the sequence's current suffix, either in this
request's own tokens (prompt and output) or in the outputs of recently finished requests.

Each request keeps a suffix tree over its own tokens; finished outputs go into one global tree that holds at most
`suffix_decoding_max_cached_requests` of them, the oldest leaving first. To propose, every suffix of the context
that occurs in a tree (up to the trees' depth) is a candidate start: from it the draft follows the most frequent
continuation while the path probability stays at least `suffix_decoding_min_token_prob`, for at most
`suffix_decoding_max_spec_factor` times the match length. The candidate with the most expected accepted tokens
(the sum of its path probabilities) wins. Every match length competes rather than only the longest, because the
longest leaves the least depth below it and rests on the fewest occurrences.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shared.config import SpeculativeConfig
from shared.frames import FinishReason
from services.worker.engine.sequence import Sequence
from services.worker.drafting.suffix_tree import Location, StoredSequence, SuffixTree

SELF_OCCURRENCE = 1  # a request's tree holds the context's own suffix, which has no continuation yet
_FLOOR_SLACK = 1e-9  # so that a factor like 0.1 * 10 floors to 1, not 0


@dataclass
class _Request:
    num_prompt: int
    tree: SuffixTree
    stored: StoredSequence = field(default_factory=StoredSequence)
    global_matches: list[Location] = field(default_factory=list)
    global_version: int = -1  # the global tree's version the matches were computed against


class SuffixCache:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.global_tree = SuffixTree(self.max_depth)
        self._cached: OrderedDict[str, StoredSequence] = OrderedDict()  # finished outputs, oldest first
        self._global_version = 0  # bumped on every change, which may move or remove matched locations
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_tokens(self, request_id: str) -> int:
        return len(self._request(request_id).stored.tokens)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def start_request(self, request_id: str, prompt_ids: list[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already started")
        req = _Request(len(prompt_ids), SuffixTree(self.max_depth))
        self._requests[request_id] = req
        req.tree.append(req.stored, list(prompt_ids))

    def append(self, request_id: str, new_token_ids: list[int]) -> None:
        req = self._request(request_id)
        req.tree.append(req.stored, list(new_token_ids))
        if req.global_version == self._global_version:
            for token in new_token_ids:
                req.global_matches = self.global_tree.match(req.global_matches, token)

    def propose(self, request_id: str, num_drafts: int) -> list[int]:
        req = self._request(request_id)
        if num_drafts <= 0:
            return []
        best: list[int] = []
        best_score = 0.0
        # Own tokens first and, within a tree, longer matches first (both lists run from longest): they win ties.
        candidates = [(req.tree, node.location(), SELF_OCCURRENCE) for node in req.stored.open_ends]
        candidates += [(self.global_tree, location, 0) for location in self._global_matches(req)]
        for tree, location, discount in candidates:
            max_tokens = self._max_tokens(location[2], num_drafts)
            if max_tokens <= best_score:
                continue  # a path's score is at most its length: this one cannot win
            tokens, score = tree.speculate(location, max_tokens, self.min_token_prob, discount)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def finish_request(self, request_id: str) -> None:
        """Caches the request's output in the global tree, evicting the oldest outputs beyond the limit."""
        req = self._requests.pop(request_id)
        output = req.stored.tokens[req.num_prompt :]
        if self.max_cached_requests == 0 or not output:
            return
        self._global_version += 1
        if request_id in self._cached:  # the same request ran again (redelivered): keep its latest output
            self.global_tree.remove(self._cached.pop(request_id))
        stored = StoredSequence()
        self.global_tree.append(stored, output)
        stored.open_ends = []
        self._cached[request_id] = stored
        while len(self._cached) > self.max_cached_requests:
            _, oldest = self._cached.popitem(last=False)
            self.global_tree.remove(oldest)

    def abort_request(self, request_id: str) -> None:
        """Forgets the request without caching its (incomplete) output."""
        del self._requests[self._checked(request_id)]

    def _request(self, request_id: str) -> _Request:
        return self._requests[self._checked(request_id)]

    def _checked(self, request_id: str) -> str:
        if request_id not in self._requests:
            raise KeyError(f"suffix cache has no running request {request_id}")
        return request_id

    def _max_tokens(self, match_length: int, num_drafts: int) -> int:
        return min(num_drafts, int(self.max_spec_factor * match_length + _FLOOR_SLACK))

    def _global_matches(self, req: _Request) -> list[Location]:
        """The global tree's locations of the context's suffixes, rebuilt from the last max_depth tokens when the
        tree changed since they were computed (a split or a removal may have moved or deleted them)."""
        if req.global_version != self._global_version:
            matches: list[Location] = []
            if self._cached:
                for token in req.stored.tokens[-self.max_depth :]:
                    matches = self.global_tree.match(matches, token)
            req.global_matches, req.global_version = matches, self._global_version
        return req.global_matches


class SuffixProposer:
    """The engine's adapter: follows each sequence's tokens lazily (starting it on first sight, appending what
    was emitted since the last call) and caches a sequence's output when the engine reports it finished."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.cache = SuffixCache(config)

    def propose(self, seq: Sequence, num_drafts: int) -> list[int]:
        self._sync(seq)
        return self.cache.propose(seq.key, num_drafts)

    def on_finished(self, seq: Sequence) -> None:
        """Call once per finished sequence (stopped, at its length limit, or aborted)."""
        if seq.finish_reason is FinishReason.ABORT:
            if seq.key in self.cache:
                self.cache.abort_request(seq.key)
            return
        self._sync(seq)
        self.cache.finish_request(seq.key)

    def _sync(self, seq: Sequence) -> None:
        if seq.key not in self.cache:
            self.cache.start_request(seq.key, seq.prompt_ids)
        known = self.cache.num_tokens(seq.key)
        if known > seq.num_tokens:
            raise ValueError(f"sequence {seq.key} has {seq.num_tokens} tokens, fewer than the {known} seen")
        if known < seq.num_tokens:
            self.cache.append(seq.key, seq.output_ids[known - len(seq.prompt_ids) :])
