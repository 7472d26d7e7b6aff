"""Suffix decoding: the suffix tree's counts against brute force, proposals from a request's own tokens and from
finished requests, the probability, factor and depth limits, eviction, the engine adapter, and speed."""

from __future__ import annotations

import inspect
import json.decoder
import random
import time
from collections import Counter

import pytest

from shared.config import SpeculativeConfig
from shared.frames import FinishReason
from shared.schemas import SamplingParams
from services.worker.engine.sequence import Sequence
from services.worker.drafting.suffix import SuffixCache, SuffixProposer
from services.worker.drafting.suffix_tree import StoredSequence, SuffixTree

SPEED_TOKENS = 4000
MAX_STEP_SECONDS = 1e-3
NUM_DRAFTS = 5


def _config(**overrides: object) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", num_speculative_tokens=8, **overrides)


def _counts(tree: SuffixTree) -> Counter[tuple[int, ...]]:
    """Every string the tree holds with its count, leaf chains read out of their sequences."""
    found: Counter[tuple[int, ...]] = Counter()

    def walk(node, prefix: tuple[int, ...]) -> None:
        for token, child in node.children.items():
            string = prefix + (token,)
            found[string] += child.count
            if not child.is_leaf:
                walk(child, string)
                continue
            pos, depth = child.pos, child.depth
            while depth < tree.max_depth and pos + 1 < len(child.seq):
                pos, depth = pos + 1, depth + 1
                string += (child.seq[pos],)
                found[string] += 1

    walk(tree.root, ())
    return found


def _substrings(sequences: list[list[int]], max_depth: int) -> Counter[tuple[int, ...]]:
    found: Counter[tuple[int, ...]] = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                found[tuple(seq[start:end])] += 1
    return found


def test_tree_counts_equal_brute_force_through_appends_and_removals() -> None:
    rng = random.Random(3)
    for _ in range(200):
        max_depth = rng.randint(1, 6)
        tree = SuffixTree(max_depth)
        sequences, stored = [], []
        for _ in range(rng.randint(1, 4)):
            seq = [rng.randrange(3) for _ in range(rng.randint(0, 30))]
            entry = StoredSequence()
            for start in range(0, len(seq), 4):  # grown in chunks, as a request is
                tree.append(entry, seq[start : start + 4])
            sequences.append(seq)
            stored.append(entry)
        assert _counts(tree) == _substrings(sequences, max_depth)
        for index in sorted(rng.sample(range(len(stored)), rng.randint(1, len(stored))), reverse=True):
            tree.remove(stored.pop(index))
            sequences.pop(index)
        assert _counts(tree) == _substrings(sequences, max_depth)
        tree.append(StoredSequence(), later := [rng.randrange(3) for _ in range(20)])
        assert _counts(tree) == _substrings(sequences + [later], max_depth)


def test_repeated_content_of_a_finished_request_is_proposed() -> None:
    cache = SuffixCache(_config())
    cache.start_request("a", [1, 2])
    cache.append("a", [10, 11, 12, 13, 14, 15, 16, 17, 18])
    cache.finish_request("a")
    cache.start_request("b", [3, 4, 5, 10, 11, 12])
    assert cache.propose("b", 3) == [13, 14, 15]
    cache.append("b", [13])
    assert cache.propose("b", 8) == [14, 15, 16, 17]  # no more than the match is long
    cache.append("b", [14, 15])
    assert cache.propose("b", 8) == [16, 17, 18]  # the cached output ends there
    assert cache.propose("b", 0) == []


def test_own_earlier_occurrence_counts_without_the_current_one() -> None:
    # [5, 6] occurred once before; the context's own [5, 6] has no continuation yet, so 7 follows with
    # probability 1, well above the threshold, not 1/2.
    cache = SuffixCache(_config(suffix_decoding_min_token_prob=0.6))
    cache.start_request("a", [5, 6, 7, 8, 9, 5, 6])
    assert cache.propose("a", 2) == [7, 8]


def _finished(cache: SuffixCache, request_id: str, output: list[int]) -> None:
    cache.start_request(request_id, [])
    cache.append(request_id, output)
    cache.finish_request(request_id)


def test_probability_threshold_cuts_the_path() -> None:
    outputs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 4]]
    for min_prob, expected in [(0.8, []), (0.7, [3]), (0.5, [3, 4]), (0.1, [3, 4])]:
        cache = SuffixCache(_config(suffix_decoding_min_token_prob=min_prob, suffix_decoding_max_spec_factor=4.0))
        for index, output in enumerate(outputs):
            _finished(cache, f"r{index}", output)
        cache.start_request("b", [9, 1, 2])
        # After [1, 2]: 3 with 3/4; after [1, 2, 3]: 4 with 2/3, so the path [3, 4] has probability 1/2.
        assert cache.propose("b", 4) == expected, min_prob


def test_spec_factor_bounds_the_draft_by_the_match_length() -> None:
    for factor, expected_len in [(0.5, 1), (1.0, 2), (2.0, 4), (8.0, 8)]:
        cache = SuffixCache(_config(suffix_decoding_max_spec_factor=factor))
        _finished(cache, "a", list(range(10, 40)))
        cache.start_request("b", [1, 10, 11])  # matches two tokens
        assert cache.propose("b", 8) == list(range(12, 12 + expected_len)), factor


def test_tree_depth_bounds_the_match_and_the_draft() -> None:
    cache = SuffixCache(_config(suffix_decoding_max_tree_depth=4, suffix_decoding_max_spec_factor=8.0))
    _finished(cache, "a", list(range(10, 40)))
    cache.start_request("b", list(range(10, 20)))  # a 10-token match, of which the tree sees at most 3 + 1
    assert cache.propose("b", 8) == [20, 21, 22]  # from a 1-token match: depth 4 is reached after 3 more
    deep = SuffixCache(_config(suffix_decoding_max_spec_factor=8.0))
    _finished(deep, "a", list(range(10, 40)))
    deep.start_request("b", list(range(10, 20)))
    assert deep.propose("b", 8) == list(range(20, 28))


def test_oldest_outputs_are_evicted_with_their_suffixes() -> None:
    cache = SuffixCache(_config(suffix_decoding_max_cached_requests=2))
    outputs = {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23], "c": [30, 31, 32, 33]}
    for request_id, output in outputs.items():
        _finished(cache, request_id, output)
    assert cache.num_cached_requests == 2
    assert _counts(cache.global_tree) == _substrings([outputs["b"], outputs["c"]], cache.max_depth)
    cache.start_request("x", [10, 11])
    assert cache.propose("x", 2) == []
    cache.start_request("y", [20, 21])
    assert cache.propose("y", 2) == [22, 23]
    none_cached = SuffixCache(_config(suffix_decoding_max_cached_requests=0))
    _finished(none_cached, "a", outputs["a"])
    assert none_cached.num_cached_requests == 0


def test_the_more_likely_continuation_wins_between_own_and_global() -> None:
    cache = SuffixCache(_config(suffix_decoding_max_spec_factor=4.0))
    for index in range(4):
        _finished(cache, f"g{index}", [1, 2, 3, 4, 5])
    # Own tokens: [1, 2] was followed by 7 and by 8 (probability 1/2 each); globally always by 3.
    cache.start_request("b", [1, 2, 7, 1, 2, 8, 1, 2])
    assert cache.propose("b", 3) == [3, 4, 5]
    # Own tokens certain, global split: [6, 6] was followed by 0 and by 9 in finished outputs.
    _finished(cache, "h0", [6, 6, 0])
    _finished(cache, "h1", [6, 6, 9])
    cache.start_request("c", [6, 6, 1, 2, 6, 6])
    assert cache.propose("c", 2) == [1, 2]


def test_incremental_appends_propose_what_a_rebuild_proposes() -> None:
    rng = random.Random(11)
    tokens = [rng.randrange(6) for _ in range(400)]
    incremental = SuffixCache(_config())
    _finished(incremental, "old", tokens[:150])
    incremental.start_request("r", tokens[:20])
    position = 20
    while position < len(tokens):
        step = tokens[position : position + rng.randint(1, 4)]
        incremental.append("r", step)
        position += len(step)
        rebuilt = SuffixCache(_config())
        _finished(rebuilt, "old", tokens[:150])
        rebuilt.start_request("r", tokens[:position])
        assert incremental.propose("r", NUM_DRAFTS) == rebuilt.propose("r", NUM_DRAFTS), position


def test_request_errors_are_specific() -> None:
    cache = SuffixCache(_config())
    cache.start_request("a", [1])
    with pytest.raises(ValueError, match="already started"):
        cache.start_request("a", [1])
    with pytest.raises(KeyError, match="no running request b"):
        cache.propose("b", 1)
    cache.abort_request("a")
    with pytest.raises(KeyError, match="no running request a"):
        cache.abort_request("a")


def _sequence(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=100), seed=0, stop_ids=frozenset())


def test_proposer_follows_sequences_and_caches_finished_outputs() -> None:
    proposer = SuffixProposer(_config(suffix_decoding_max_spec_factor=4.0))
    first = _sequence("a", [1, 2, 3])
    first.output_ids += [40, 41, 42, 43]  # never proposed for: started lazily at the end
    first.finish_reason = FinishReason.LENGTH
    proposer.on_finished(first)
    second = _sequence("b", [7, 40])
    assert proposer.propose(second, 2) == [41, 42]
    second.output_ids += [41, 42]  # appended since the last call
    assert proposer.propose(second, 2) == [43]
    aborted = _sequence("c", [50, 51])
    proposer.propose(aborted, 1)
    aborted.output_ids += [52, 53]
    aborted.finish_reason = FinishReason.ABORT
    proposer.on_finished(aborted)
    proposer.on_finished(aborted)  # reported twice: harmless
    never_proposed = _sequence("d", [1])
    never_proposed.finish_reason = FinishReason.ABORT
    proposer.on_finished(never_proposed)
    assert "c" not in proposer.cache and proposer.cache.num_cached_requests == 1


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_a_long_request_costs_well_under_a_millisecond_per_step() -> None:
    # Bytes of real source code: repetitive like the code and prose a model writes, with many repeated suffixes.
    source = inspect.getsource(json.decoder).encode() * 3
    tokens = list(source[: 2 * SPEED_TOKENS])
    cache = SuffixCache(_config())
    _finished(cache, "old", tokens[SPEED_TOKENS // 2 : SPEED_TOKENS])
    cache.start_request("r", tokens[:SPEED_TOKENS])
    position, num_steps, num_accepted = SPEED_TOKENS, 0, 0
    started = time.perf_counter()
    while position < len(tokens):
        drafts = cache.propose("r", NUM_DRAFTS)
        truth = tokens[position : position + len(drafts)]
        accepted = next((i for i, (a, b) in enumerate(zip(drafts, truth)) if a != b), min(len(drafts), len(truth)))
        step = tokens[position : position + accepted + 1]  # the accepted drafts and one token of the target's
        cache.append("r", step)
        position += len(step)
        num_steps += 1
        num_accepted += accepted
    per_step = (time.perf_counter() - started) / num_steps
    assert per_step < MAX_STEP_SECONDS, f"{per_step * 1e3:.3f} ms per step"
    assert num_accepted > num_steps  # the source repeats, so drafts must land
