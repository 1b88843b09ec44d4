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
        self._stop = [s for s in stop if s]
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
        self._held += self._decoder.decode(self._model.token_to_piece(token))
        if self._release_until_stop():
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

    def _release_until_stop(self) -> bool:
        if not self._stop:
            self._release(self._held)
            self._held = ""
            return False
        found = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if found:
            self._release(self._held[: min(found)])
            self._held = ""
            self._stopped_by_string = True
            return True
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._held) - keep
        self._release(self._held[:cut])
        self._held = self._held[cut:]
        return False

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
