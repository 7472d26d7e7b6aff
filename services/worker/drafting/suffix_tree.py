"""A depth-bounded suffix trie with occurrence counts over token sequences that grow at their end.

A node stands for a token string of at most `max_depth` tokens that occurs in the stored sequences; its count is
the number of occurrences (start positions) of that string. A child's count over its parent's is therefore the
empirical probability that the child's token follows the parent's string.

A string that occurs once needs no nodes below it: its node is a leaf that points at its occurrence's position
in the sequence, and the single chain below it is read from the sequence itself. Nodes exist only where strings
repeat, so memory stays O(tokens) for ordinary text rather than O(tokens * depth), and appending a token touches
only the suffixes that still repeat (at most `max_depth` of them).

Plain-Python bookkeeping on the host; no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

INTERNAL = -1  # the `pos` of a node that has explicit children instead of pointing into a sequence

_by_count = attrgetter("count")

# Where a string ends in the tree: (node, pos, depth). At an internal node pos is INTERNAL; inside a leaf's chain
# pos is the index in the leaf's sequence of the string's last token. Tuples, because matching builds many per step.
Location = tuple["Node", int, int]


class Node:
    __slots__ = ("token", "count", "depth", "children", "best", "seq", "pos")

    def __init__(self, token: int, depth: int, seq: list[int] | None, pos: int) -> None:
        self.token = token
        self.count = 1
        self.depth = depth
        self.seq = seq  # a leaf's sequence; None once the node has explicit children
        self.pos = pos
        self.children: dict[int, Node] | None = None if seq is not None else {}
        self.best: Node | None = None  # the most frequent child; None when unknown (after a removal) or no child

    @property
    def is_leaf(self) -> bool:
        return self.children is None

    def best_child(self) -> Node | None:
        if self.best is None and self.children:
            self.best = max(self.children.values(), key=_by_count)
        return self.best

    def location(self) -> Location:
        return self, self.pos, self.depth


@dataclass
class StoredSequence:
    """A sequence in a tree. `open_ends` are the internal nodes where its suffixes that occur elsewhere too end,
    i.e. the ones the next token must extend explicitly; every other suffix ends inside its own leaf's chain and
    grows with the list."""

    tokens: list[int] = field(default_factory=list)
    open_ends: list[Node] = field(default_factory=list)


def _promote(parent: Node, child: Node) -> None:
    """Keeps parent.best current after child's count grew. Ties go to the child seen last (recency)."""
    if parent.best is None:
        parent.best_child()
    elif child.count >= parent.best.count:
        parent.best = child


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be at least 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(INTERNAL, 0, None, INTERNAL)

    def append(self, stored: StoredSequence, tokens: list[int]) -> None:
        """Appends tokens to a stored sequence (its list is shared with the tree's leaves), one suffix step each."""
        for token in tokens:
            stored.tokens.append(token)
            stored.open_ends = self._extend(stored.tokens, stored.open_ends, token)

    def _extend(self, tokens: list[int], open_ends: list[Node], token: int) -> list[Node]:
        pos = len(tokens) - 1
        still_open = []
        # The root stands for the empty suffix that starts at the new token.
        for node in chain(open_ends, (self.root,)):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(token, node.depth + 1, tokens, pos)
                _promote(node, child)
                continue
            if child.is_leaf:
                self._split(child)
            child.count += 1
            _promote(node, child)
            if child.depth < self.max_depth:
                still_open.append(child)
        return still_open

    def _split(self, leaf: Node) -> None:
        """Gives a leaf explicit children: its one occurrence continues as a new leaf one token further."""
        seq, pos = leaf.seq, leaf.pos
        leaf.seq, leaf.pos, leaf.children, leaf.best = None, INTERNAL, {}, None
        if leaf.depth < self.max_depth and pos + 1 < len(seq):
            rest = Node(seq[pos + 1], leaf.depth + 1, seq, pos + 1)
            leaf.children[rest.token] = leaf.best = rest

    def remove(self, stored: StoredSequence) -> None:
        """Takes every suffix of a complete stored sequence out of the tree, deleting strings left unused."""
        tokens = stored.tokens
        for start in range(len(tokens)):
            node = self.root
            for pos in range(start, min(start + self.max_depth, len(tokens))):
                child = node.children[tokens[pos]]
                if node.best is child:
                    node.best = None  # its count drops below a sibling's, perhaps
                if child.count == 1:
                    # This occurrence was the string's last: everything below it goes too.
                    del node.children[tokens[pos]]
                    break
                child.count -= 1
                node = child
        stored.open_ends = []

    def match(self, locations: list[Location], token: int) -> list[Location]:
        """Given the locations of a context's suffixes, the locations of its suffixes after `token`. Only
        locations that something can still follow are kept: those above max_depth."""
        found = []
        limit = self.max_depth - 1
        for node, pos, depth in locations:
            if depth >= limit:
                continue
            if pos == INTERNAL:
                child = node.children.get(token)
                if child is not None:
                    found.append((child, child.pos, depth + 1))
            elif pos + 1 < len(node.seq) and node.seq[pos + 1] == token:
                found.append((node, pos + 1, depth + 1))
        first = self.root.children.get(token)
        if first is not None and limit > 0:
            found.append(first.location())
        return found

    def speculate(
        self, location: Location, max_tokens: int, min_prob: float, discount: int = 0
    ) -> tuple[list[int], float]:
        """Follows the most frequent continuation from `location` while the path's probability stays at least
        `min_prob`; returns the tokens and their expected accepted count (the sum of path probabilities).
        `discount` occurrences of the starting string are left out of the first step's denominator: the
        context's own occurrence, which has no continuation yet."""
        node, pos, depth = location
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        total = (node.count if pos == INTERNAL else 1) - discount
        while len(tokens) < max_tokens and depth < self.max_depth and total > 0:
            if pos == INTERNAL:
                child = node.best_child()
                if child is None:
                    break
                step_prob = prob * child.count / total
                if step_prob < min_prob:
                    break
                tokens.append(child.token)
                prob, total, node, pos = step_prob, child.count, child, child.pos
            else:
                # A single occurrence: its next token follows with the path's probability unchanged.
                if pos + 1 >= len(node.seq):
                    break
                pos += 1
                tokens.append(node.seq[pos])
            score += prob
            depth += 1
        return tokens, score
