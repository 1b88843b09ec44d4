"""Suffix drafting (as in SuffixDecoding, Oliaro et al. 2025): no model, just what followed.

Two indexes of the same kind, a suffix tree cut at ``DEPTH`` tokens whose every node counts how
often its path occurred: one per request over its prompt and output so far, and one shared by
all slots over earlier requests (their prompt's last tokens and their output), bounded in bytes
and emptied oldest request first. A draft starts at the node of the longest suffix of the
history (up to ``MAX_MATCH`` tokens) that the index holds with a continuation, follows the most
frequent child at each step, and gives each token a confidence: the share of the occurrences
that went on with it, discounted for short matches. Where two continuations compete ("It is
the" -> capital / largest) the longest context the index holds (up to ``LONG_MATCH`` tokens)
picks one, and drafting goes on with the shorter match's lower confidence instead of stopping;
the speculation policy picks the length from those confidences. Work per step: O(MAX_MATCH^2)
lookups to match, O(1) per drafted token plus O(LONG_MATCH^2) at a competition, O(DEPTH) per
new history token; nothing ever walks the whole history.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from hyspec.draft_policy import expected_gain
from hyspec.drafters import Draft, DraftItem

DEPTH = 20  # the longest path indexed: a match plus the continuation it can draft
MAX_MATCH = 10
MIN_MATCH = 2
# Competing continuations are decided by up to this much context: an earlier occurrence of a
# long context can be a request restating an earlier answer (llama-server's ngram-mod keys its
# table by 24 tokens). Not a longer MAX_MATCH: its single occurrences draft worse on prose.
LONG_MATCH = 16
PROMPT_TAIL = 8  # of each earlier request's prompt, indexed with its output (matches across the boundary)


class _Node:
    __slots__ = ("best", "children", "count", "cont")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path ending here
        self.cont = 0  # of those, how many went on (the children's counts summed)
        self.children: dict[int, _Node] = {}
        self.best = -1  # the most frequent child's token


def _measure_node_bytes() -> int:
    """What one more node costs: the object, its (small) dict and its slot in the parent's dict."""
    node, parent = _Node(), _Node()
    node.children[1 << 20] = _Node()
    parent.children[1 << 21] = node
    per_entry = (sys.getsizeof({i: None for i in range(8)}) - sys.getsizeof({})) // 8
    return sys.getsizeof(node) + sys.getsizeof(node.children) + per_entry + sys.getsizeof(1 << 20)


NODE_BYTES = _measure_node_bytes()


class SuffixTree:
    """Counted suffix tree of token streams, each path at most ``DEPTH`` tokens."""

    def __init__(self) -> None:
        self.root = _Node()
        self.nodes = 0
        self._open: list[tuple[_Node, int]] = []  # the paths the stream's next token extends

    def append(self, token: int) -> None:
        """The stream goes on by ``token``: every suffix of its last DEPTH - 1 tokens extends."""
        still_open: list[tuple[_Node, int]] = []
        for node, depth in [*self._open, (self.root, 0)]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.nodes += 1
            child.count += 1
            node.cont += 1
            if node.best < 0 or child.count > node.children[node.best].count:
                node.best = token
            if depth + 1 < DEPTH:
                still_open.append((child, depth + 1))
        self._open = still_open

    def end_stream(self) -> None:
        self._open = []

    def insert(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)
        self.end_stream()

    def remove(self, tokens: list[int]) -> None:
        """Undo ``insert(tokens)``: counts go down, nodes no occurrence reaches any more go."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + DEPTH]:
                child = node.children[token]
                child.count -= 1
                node.cont -= 1
                if child.count == 0:
                    self.nodes -= _size(child)
                    del node.children[token]
                    node.best = max(node.children, key=lambda t: node.children[t].count, default=-1)
                    break
                if token == node.best:
                    node.best = max(node.children, key=lambda t: node.children[t].count)
                node = child

    def match(self, context: list[int], longest: int = MAX_MATCH,
              shortest: int = MIN_MATCH) -> tuple[_Node, int] | None:
        """The node of the longest suffix of ``context`` (``shortest``..``longest`` tokens) that
        has occurred with a continuation, and its length."""
        for length in range(min(longest, len(context)), shortest - 1, -1):
            node: _Node | None = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node.cont > 0:
                return node, length
        return None

    def draft(self, history: list[int], max_len: int) -> Draft:
        """Up to ``max_len`` tokens following ``history``, each with its confidence."""
        tokens: list[int] = []
        confidence: list[float] = []
        found = self.match(history)
        while found is not None and len(tokens) < max_len:
            node, length = found
            while node.cont > 0 and len(tokens) < max_len:
                shorter, shorter_length = node, length
                if len(node.children) > 1 and length < LONG_MATCH:
                    longer = self.match(history[-LONG_MATCH:] + tokens, LONG_MATCH, length + 1)
                    if longer is not None:
                        node, length = longer
                token = node.best
                # The shorter match's share of it, smoothed (a continuation seen once is likely,
                # not certain) and discounted for a short match, which says less about what follows.
                share = (shorter.children[token].count + 0.5) / (shorter.cont + 1)
                confidence.append((1.0 - 0.5 ** shorter_length) * share)
                tokens.append(token)
                node = node.children[token]
                length += 1
            if len(tokens) < max_len:  # the indexed depth ran out: match again, draft included
                found = self.match(history[-MAX_MATCH:] + tokens)
        return Draft(tokens, confidence)


def _size(node: _Node) -> int:
    return 1 + sum(_size(child) for child in node.children.values())


@dataclass
class SharedIndex:
    """Earlier requests' text in one tree, and each request's tokens, oldest first (to evict)."""

    tree: SuffixTree = field(default_factory=SuffixTree)
    kept: deque[list[int]] = field(default_factory=deque)


@dataclass
class _Request:
    tree: SuffixTree
    tokens: list[int]  # what the tree holds, in order
    n_prompt: int


class SuffixDrafter:
    """Drafts from the request's own text and from earlier requests' outputs, whichever
    promises more accepted tokens. ``cache_bytes`` bounds the shared index (and the live
    requests' own, which are bounded by the context and come first)."""

    def __init__(self, cache_bytes: int = 64 << 20) -> None:
        self.cache_bytes = cache_bytes
        self.shared = SharedIndex()
        self._requests: dict[int, _Request] = {}

    @property
    def bytes_used(self) -> int:
        return NODE_BYTES * (self.shared.tree.nodes + sum(r.tree.nodes for r in self._requests.values()))

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        return [self._draft(item) for item in items]

    def _draft(self, item: DraftItem) -> Draft:
        request = self._index(item)
        if item.max_len <= 0:
            return Draft([])
        own = request.tree.draft(item.history, item.max_len)
        shared = self.shared.tree.draft(item.history, item.max_len)
        return max(own, shared, key=lambda d: expected_gain(d.confidence or [])[-1])

    def _index(self, item: DraftItem) -> _Request:
        """The request's tree, brought up to its history (which only grows within a request)."""
        request = self._requests.get(item.seq)
        if request is None or request.n_prompt != item.n_prompt or len(item.history) < len(request.tokens):
            request = self._requests[item.seq] = _Request(SuffixTree(), [], item.n_prompt)
        for token in item.history[len(request.tokens):]:
            request.tree.append(token)
            request.tokens.append(token)
        return request

    def release(self, seq: int, history: list[int] | None = None) -> None:
        """The request is over: its output (after its prompt's last tokens; all of ``history``,
        the tokens of its last step included, where given) joins the shared index, which then
        drops the oldest requests until it fits."""
        request = self._requests.pop(seq, None)
        if request is None:
            return
        if history is not None and history[:len(request.tokens)] == request.tokens:
            request.tokens += history[len(request.tokens):]
        kept = request.tokens[max(0, request.n_prompt - PROMPT_TAIL):]
        if len(kept) > PROMPT_TAIL:
            self.shared.tree.insert(kept)
            self.shared.kept.append(kept)
        while self.shared.kept and self.bytes_used > self.cache_bytes:
            self.shared.tree.remove(self.shared.kept.popleft())

