"""Token windows for training and evaluation, drawn deterministically from a seed.

Every window starts with BOS followed by text that starts at a verse, as a served prompt does
(llama.cpp adds BOS to a prompt). The plain text is the training chapters one after another,
one verse a line, each chapter closed by EOS. A ``chat_fraction`` of the windows are ChatML
conversations instead: the user says a verse, the assistant answers with the next one, turn
after turn, each turn closed by ``<|im_end|>``, which is what the bundled chat template
renders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hyspec.train.tokenizer import BOS, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from hyspec.train.corpus import Chapter

PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = (SPECIAL_TOKENS.index(t) for t in (PAD, BOS, EOS, IM_START, IM_END))


@dataclass(frozen=True)
class Text:
    """Chapters as one token stream, with where each verse starts."""

    stream: np.ndarray  # int64: chapter tokens, verses joined by "\n", EOS after each chapter
    verse_starts: np.ndarray  # int64 offsets into stream
    verse_ends: np.ndarray  # int64: one past each verse's last token
    chapter_of_verse: np.ndarray  # int64: index of the verse's chapter


def tokenize_chapters(chapters: Sequence[Chapter], tokenizer: Tokenizer) -> Text:
    """Verses are tokenized one by one and joined with the newline token: the byte-level split
    never merges across a newline, so this is how the chapter's text tokenizes as a whole."""
    (newline,) = tokenizer.encode("\n").ids
    pieces: list[np.ndarray] = []
    starts: list[int] = []
    ends: list[int] = []
    chapter_of: list[int] = []
    pos = 0
    for ci, chapter in enumerate(chapters):
        encoded = tokenizer.encode_batch(list(chapter.verses))
        for vi, verse in enumerate(encoded):
            ids = np.asarray(verse.ids, dtype=np.int64)
            starts.append(pos)
            ends.append(pos + len(ids))
            chapter_of.append(ci)
            last = vi == len(encoded) - 1
            pieces += [ids, np.asarray([EOS_ID if last else newline], dtype=np.int64)]
            pos += len(ids) + 1
    return Text(np.concatenate(pieces), np.asarray(starts), np.asarray(ends), np.asarray(chapter_of))


class Batches:
    """Training windows of ``seq_len + 1`` tokens (inputs and shifted targets), PAD past the end."""

    def __init__(self, text: Text, tokenizer: Tokenizer, seq_len: int, chat_fraction: float) -> None:
        self.text, self.seq_len, self.chat_fraction = text, seq_len, chat_fraction
        self.user = np.asarray([IM_START_ID, *tokenizer.encode("user\n").ids], dtype=np.int64)
        self.assistant = np.asarray([IM_START_ID, *tokenizer.encode("assistant\n").ids], dtype=np.int64)
        self.turn_end = np.asarray([IM_END_ID, *tokenizer.encode("\n").ids], dtype=np.int64)

    def _plain(self, verse: int) -> np.ndarray:
        start = self.text.verse_starts[verse]
        return np.concatenate(([BOS_ID], self.text.stream[start : start + self.seq_len]))

    def _chat(self, verse: int) -> np.ndarray:
        t = self.text
        parts: list[np.ndarray] = [np.asarray([BOS_ID])]
        n, role = 1, 0
        while n <= self.seq_len and verse < len(t.verse_starts):
            header = self.user if role == 0 else self.assistant
            body = t.stream[t.verse_starts[verse] : t.verse_ends[verse]]
            parts += [header, body, self.turn_end]
            n += len(header) + len(body) + len(self.turn_end)
            # The conversation follows the chapter, and stops at its end on an assistant turn.
            chapter = t.chapter_of_verse[verse]
            last_of_chapter = verse + 1 == len(t.verse_starts) or t.chapter_of_verse[verse + 1] != chapter
            if role == 1 and last_of_chapter:
                break
            verse, role = verse + 1, 1 - role
        return np.concatenate(parts)[: self.seq_len + 1]

    def batch(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """(size, seq_len + 1) int64 token ids."""
        out = np.full((size, self.seq_len + 1), PAD_ID, dtype=np.int64)
        verses = rng.integers(0, len(self.text.verse_starts), size)
        chat = rng.random(size) < self.chat_fraction
        for row, (verse, is_chat) in enumerate(zip(verses, chat, strict=True)):
            window = self._chat(int(verse)) if is_chat else self._plain(int(verse))
            out[row, : len(window)] = window
        return out


def eval_windows(text: Text, seq_len: int) -> np.ndarray:
    """The whole text as BOS-led windows of whole verses (at most ``seq_len + 1`` tokens each),
    padded with PAD: every held-out token is predicted once."""
    rows: list[np.ndarray] = []
    t, n_verses, verse = text, len(text.verse_starts), 0
    while verse < n_verses:
        start = t.verse_starts[verse]
        end = start
        # Whole verses with their separators; a verse too long for a window is cut.
        while verse < n_verses and (t.verse_ends[verse] + 1 - start <= seq_len or end == start):
            end = min(t.verse_ends[verse] + 1, start + seq_len)
            verse += 1
        rows.append(np.concatenate(([BOS_ID], t.stream[start:end])))
    out = np.full((len(rows), seq_len + 1), PAD_ID, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
