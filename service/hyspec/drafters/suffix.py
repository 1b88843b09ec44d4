"""Suffix drafting (as in SuffixDecoding, Oliaro et al. 2025): no model, just what followed.

Two indexes of the same kind, a suffix tree cut at ``DEPTH`` tokens whose every node counts how
often its path occurred (a path that occurred once is kept as its place in the text): one per
request over its prompt and output so far, and one shared by all slots over earlier requests
(their prompt's last tokens and their output), bounded in bytes and emptied oldest request
first. A draft starts at the node of the longest suffix of the history (up to ``MAX_MATCH``
tokens) that the index holds with a continuation, follows the most frequent child at each step,
and gives each token a confidence: the share of the occurrences that went on with it, discounted
for short matches. Where two continuations compete ("It is the" -> capital / largest) the
longest context the index holds (up to ``LONG_MATCH`` tokens) picks one, and drafting goes on
with the shorter match's lower confidence instead of stopping; the speculation policy picks the
length from those confidences. Work per step: O(MAX_MATCH^2) lookups to match, O(1) per drafted
token plus O(LONG_MATCH^2) at a competition, at most O(DEPTH) per new history token (one per
repeated suffix); nothing ever walks the whole history.
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
    """A path that occurred more than once (or the root, or one whose other occurrences left)."""

    __slots__ = ("best", "children", "count", "cont")

    def __init__(self, count: int = 0) -> None:
        self.count = count  # occurrences of the path ending here
        self.cont = 0  # of those, how many went on (the children's counts summed)
        self.children: dict[int, _Node | _Tail] = {}
        self.best = -1  # the most frequent child's token

    @property
    def branches(self) -> int:
        return len(self.children)

    def child(self, token: int) -> _Node | _Tail | None:
        return self.children.get(token)

    def recount_best(self) -> None:
        """``best`` again from the children's counts (after some went down)."""
        self.best = max(self.children, key=lambda t: self.children[t].count, default=-1)


class _Tail:
    """A path that occurred once: it ends at ``stream[index]`` and what follows it is the rest of
    that stream (up to DEPTH), so nothing below it is stored. Prose repeats few paths longer than
    a few tokens, and a tree of nodes all the way down held DEPTH nodes per token (~26 MB for a
    4,096-token prose prompt); a second occurrence turns the tail into a node (``SuffixTree._split``)."""

    __slots__ = ("depth", "index", "stream")
    count = 1

    def __init__(self, stream: list[int], index: int, depth: int) -> None:
        self.stream = stream  # only read: a request's history (which only grows), or a kept stream
        self.index = index
        self.depth = depth

    @property
    def cont(self) -> int:
        return int(self.depth < DEPTH and self.index + 1 < len(self.stream))

    @property
    def best(self) -> int:
        return self.stream[self.index + 1] if self.cont else -1

    @property
    def branches(self) -> int:
        return self.cont

    def child(self, token: int) -> _Tail | None:
        if self.cont and self.stream[self.index + 1] == token:
            return _Tail(self.stream, self.index + 1, self.depth + 1)
        return None


def _measure_bytes() -> tuple[int, int]:
    """What one more node and one more tail cost: the object, a node's (small) dict, and the
    slot in the parent's dict."""
    node, parent = _Node(), _Node()
    node.children[1 << 20] = _Node()
    parent.children[1 << 21] = node
    per_entry = (sys.getsizeof({i: None for i in range(8)}) - sys.getsizeof({})) // 8 + sys.getsizeof(1 << 20)
    tail = _Tail([], 0, 1)
    return sys.getsizeof(node) + sys.getsizeof(node.children) + per_entry, sys.getsizeof(tail) + per_entry


NODE_BYTES, TAIL_BYTES = _measure_bytes()
TOKEN_BYTES = 8 + sys.getsizeof(1 << 20)  # a stream's slot and the int it holds (tails read the streams)


class SuffixTree:
    """Counted suffix tree of token streams, each path at most ``DEPTH`` tokens; a path that
    occurred once is a tail (a place in its stream), not a chain of nodes."""

    def __init__(self) -> None:
        self.root = _Node()
        self.nodes = 0
        self.tails = 0
        self._open: list[tuple[_Node, int]] = []  # the node paths the stream's next token extends

    @property
    def bytes(self) -> int:
        return NODE_BYTES * self.nodes + TAIL_BYTES * self.tails

    def append(self, stream: list[int], index: int) -> None:
        """The stream goes on by ``stream[index]`` (its tokens before it are indexed): every
        suffix of its last DEPTH - 1 tokens extends. Suffixes that occurred once extend by
        themselves (their tail reads the stream), so only node paths are open."""
        token = stream[index]
        still_open: list[tuple[_Node, int]] = []
        for node, depth in [*self._open, (self.root, 0)]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Tail(stream, index, depth + 1)
                self.tails += 1
            else:
                if isinstance(child, _Tail):
                    child = node.children[token] = self._split(child)
                child.count += 1
            node.cont += 1
            if node.best < 0 or child.count > node.children[node.best].count:
                node.best = token
            if isinstance(child, _Node) and depth + 1 < DEPTH:
                still_open.append((child, depth + 1))
        self._open = still_open

    def _split(self, tail: _Tail) -> _Node:
        """A node for the path that ``tail``'s occurrence had alone (the caller counts the
        new one); that occurrence goes on below it as a tail. Its next token is always known
        by then: an earlier occurrence in the same stream ends before the new one does."""
        node = _Node(count=1)
        self.nodes += 1
        self.tails -= 1
        below = tail.child(tail.best)
        if below is not None:
            node.best = tail.best
            node.children[node.best] = below
            node.cont = 1
            self.tails += 1
        return node

    def end_stream(self) -> None:
        self._open = []

    def insert(self, stream: list[int]) -> None:
        """Index a whole stream, which must not change while it is indexed (tails read it)."""
        for index in range(len(stream)):
            self.append(stream, index)
        self.end_stream()

    def remove(self, stream: list[int]) -> None:
        """Undo ``insert(stream)``: counts go down, what no occurrence reaches any more goes. A
        node left with one occurrence stays a node (its stream is not known from it)."""
        for start in range(len(stream)):
            node = self.root
            for token in stream[start:start + DEPTH]:
                child = node.children[token]
                node.cont -= 1
                if child.count == 1:  # this stream's occurrence alone: the rest of the path goes with it
                    del node.children[token]
                    self._forget(child)
                    node.recount_best()
                    break
                assert isinstance(child, _Node)
                child.count -= 1
                if token == node.best:
                    node.recount_best()
                node = child

    def _forget(self, gone: _Node | _Tail) -> None:
        stack = [gone]
        while stack:
            item = stack.pop()
            if isinstance(item, _Tail):
                self.tails -= 1
            else:
                self.nodes -= 1
                stack.extend(item.children.values())

    def match(self, context: list[int], longest: int = MAX_MATCH,
              shortest: int = MIN_MATCH) -> tuple[_Node | _Tail, int] | None:
        """The node of the longest suffix of ``context`` (``shortest``..``longest`` tokens) that
        has occurred with a continuation, and its length."""
        for length in range(min(longest, len(context)), shortest - 1, -1):
            node: _Node | _Tail | None = self.root
            for token in context[len(context) - length:]:
                node = node.child(token)  # type: ignore[union-attr]
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
                if node.branches > 1 and length < LONG_MATCH:
                    longer = self.match(history[-LONG_MATCH:] + tokens, LONG_MATCH, length + 1)
                    if longer is not None:
                        node, length = longer
                token = node.best
                # The shorter match's share of it, smoothed (a continuation seen once is likely,
                # not certain) and discounted for a short match, which says less about what follows.
                share = (shorter.child(token).count + 0.5) / (shorter.cont + 1)  # type: ignore[union-attr]
                confidence.append((1.0 - 0.5 ** shorter_length) * share)
                tokens.append(token)
                node = node.child(token)  # type: ignore[assignment]
                length += 1
            if len(tokens) < max_len:  # the indexed depth ran out: match again, draft included
                found = self.match(history[-MAX_MATCH:] + tokens)
        return Draft(tokens, confidence)


@dataclass
class SharedIndex:
    """Earlier requests' text in one tree, and each request's tokens, oldest first (to evict)."""

    tree: SuffixTree = field(default_factory=SuffixTree)
    kept: deque[list[int]] = field(default_factory=deque)
    tokens: int = 0  # in ``kept``

    @property
    def bytes(self) -> int:
        return self.tree.bytes + TOKEN_BYTES * self.tokens

    def add(self, stream: list[int]) -> None:
        self.tree.insert(stream)
        self.kept.append(stream)
        self.tokens += len(stream)

    def drop_oldest(self) -> None:
        stream = self.kept.popleft()
        self.tree.remove(stream)
        self.tokens -= len(stream)


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
        return self.shared.bytes + self._live_bytes()

    def _live_bytes(self) -> int:
        return sum(r.tree.bytes + TOKEN_BYTES * len(r.tokens) for r in self._requests.values())

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
            request.tokens.append(token)
            request.tree.append(request.tokens, len(request.tokens) - 1)
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
            self.shared.add(kept)
        live = self._live_bytes()  # summed once: the live requests don't change while the shared index shrinks
        while self.shared.kept and self.shared.bytes + live > self.cache_bytes:
            self.shared.drop_oldest()

