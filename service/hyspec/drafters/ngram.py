"""Prompt lookup: the continuation of the latest earlier occurrence of the history's suffix."""

from __future__ import annotations

from hyspec.drafters import Draft, DraftItem

NGRAM_MAX = 8
NGRAM_MIN = 2


class _SeqIndex:
    """Latest start of every n-gram of one sequence's history, built incrementally: a
    request's history only grows."""

    def __init__(self) -> None:
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed_until = 0  # n-grams ending before this position are indexed

    def update(self, history: list[int]) -> None:
        # Index n-grams ending at most at len - 2, so the history's own suffix is never its match.
        end = len(history) - 1
        for stop in range(self.indexed_until + 1, end + 1):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                start = stop - n
                if start >= 0:
                    self.latest[tuple(history[start:stop])] = start
        self.indexed_until = max(self.indexed_until, end)


class NgramDrafter:
    """No model: copies what followed the longest (up to NGRAM_MAX) matching suffix."""

    def __init__(self) -> None:
        self._index: dict[int, _SeqIndex] = {}

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        return [Draft(self._draft(item)) for item in items]

    def _draft(self, item: DraftItem) -> list[int]:
        history = item.history
        index = self._index.setdefault(item.seq, _SeqIndex())
        index.update(history)
        if item.max_len <= 0:
            return []
        for n in range(min(NGRAM_MAX, len(history) - 1), NGRAM_MIN - 1, -1):
            start = index.latest.get(tuple(history[-n:]))
            if start is None:
                continue
            # Reading past the history's end continues through the draft itself, which is
            # what a repeating pattern would do.
            extended = list(history)
            draft: list[int] = []
            for i in range(item.max_len):
                token = extended[start + n + i]
                draft.append(token)
                extended.append(token)
            return draft
        return []

    def release(self, seq: int) -> None:
        self._index.pop(seq, None)
