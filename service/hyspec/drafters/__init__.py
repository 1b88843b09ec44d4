"""Drafters propose the tokens the target model then verifies in one batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftItem:
    """One slot asking for a draft: its sequence id, every token so far (prompt, accepted
    output and the last sampled token, not yet in the target's memory) and the most tokens
    the draft may have."""

    seq: int
    history: list[int]
    max_len: int


class Drafter(Protocol):
    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """One draft per item (possibly empty, at most max_len tokens), all slots at once."""
        ...

    def release(self, seq: int) -> None:
        """The slot's request is over: forget everything about the sequence."""
        ...
