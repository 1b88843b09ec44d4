"""From generated tokens to streamed text: finishing rules, UTF-8 safety, stop strings."""

from __future__ import annotations

import codecs

from hyspec._native import Model
from hyspec.types import Chunk, FinishReason


class OutputStream:
    """Collects one request's output.

    Text never splits a UTF-8 character (an incremental decoder keeps partial bytes), text
    that could still become a stop string is held back, and a stop string is cut off with
    everything after it. End-of-generation and stop token ids end the output without being
    part of it.
    """

    def __init__(
        self, model: Model, *, max_tokens: int, stop: list[str], stop_token_ids: list[int], ignore_eos: bool
    ) -> None:
        self._model = model
        self._max_tokens = max_tokens
        stops = [s for s in stop if s]
        self._matcher = _StopMatcher(stops) if stops else None
        self._stop_ids = set(stop_token_ids)
        self._ignore_eos = ignore_eos
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet released (a stop string may begin in it)
        self._stopped_by_string = False
        self.token_ids: list[int] = []
        self.text = ""  # released text
        self._chunk_tokens: list[int] = []
        self._chunk_text = ""

    @property
    def remaining(self) -> int:
        """Tokens the request may still produce."""
        return self._max_tokens - len(self.token_ids)

    def push(self, token: int) -> FinishReason | None:
        """Add one generated token; returns why the output ends here, if it does."""
        if token in self._stop_ids or (not self._ignore_eos and self._model.is_eog(token)):
            return FinishReason.STOP
        self.token_ids.append(token)
        self._chunk_tokens.append(token)
        piece = self._decoder.decode(self._model.token_to_piece(token))
        self._held += piece
        if self._release_until_stop(piece):
            return FinishReason.STOP
        if len(self.token_ids) >= self._max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self) -> None:
        """The output ends for another reason than a stop string: release what was held."""
        if not self._stopped_by_string:
            self._release(self._held + self._decoder.decode(b"", final=True))
            self._held = ""

    def take_chunk(self) -> Chunk | None:
        """Tokens and text since the last call, or None when there are none."""
        if not self._chunk_tokens and not self._chunk_text:
            return None
        chunk = Chunk(token_ids=self._chunk_tokens, text=self._chunk_text)
        self._chunk_tokens, self._chunk_text = [], ""
        return chunk

    def _release(self, text: str) -> None:
        self.text += text
        self._chunk_text += text

    def _release_until_stop(self, piece: str) -> bool:
        """Release the held text that cannot begin a stop string; True when ``piece`` (the
        newest text, at the end of what is held) completed one: the text before it is
        released, the rest dropped."""
        if self._matcher is None:
            self._release(self._held)
            self._held = ""
            return False
        base = len(self._held) - len(piece)
        start: int | None = None
        for i, ch in enumerate(piece):
            n = self._matcher.feed(ch)
            if n and (start is None or base + i + 1 - n < start):
                start = base + i + 1 - n  # the earliest-starting stop string ending here
        if start is not None:
            self._release(self._held[: max(start, 0)])
            self._held = ""
            self._stopped_by_string = True
            return True
        cut = len(self._held) - min(self._matcher.depth, len(self._held))
        self._release(self._held[:cut])
        self._held = self._held[cut:]
        return False


class _StopMatcher:
    """Aho-Corasick over the stop strings, fed one character at a time: the work per character
    does not grow with the number of stop strings (amortized constant)."""

    def __init__(self, stops: list[str]) -> None:
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._longest = [0]  # the longest stop string ending at this state (0: none)
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self._next[state].get(ch)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[state][ch] = nxt
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._longest.append(0)
                state = nxt
            self._longest[state] = len(stop)
        # Failure links, breadth first: the longest proper suffix that is also a prefix.
        self._fail = [0] * len(self._next)
        order = list(self._next[0].values())
        for state in order:
            for ch, child in self._next[state].items():
                f = self._fail[state]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                target = self._next[f].get(ch, 0)
                self._fail[child] = target if target != child else 0
                self._longest[child] = max(self._longest[child], self._longest[self._fail[child]])
                order.append(child)
        self._state = 0

    @property
    def depth(self) -> int:
        """Length of the longest end of the text fed so far that begins a stop string."""
        return self._depth[self._state]

    def feed(self, ch: str) -> int:
        """Advance by one character; the length of the longest stop string ending with it (0: none)."""
        state = self._state
        while state and ch not in self._next[state]:
            state = self._fail[state]
        self._state = state = self._next[state].get(ch, 0)
        return self._longest[state]
