"""Drafters propose the tokens the target model then verifies in one batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftItem:
    """One slot asking for a draft: its sequence id, every token so far (prompt, accepted
    output and the last sampled token, not yet in the target's memory), the most tokens the
    draft may have, and how many of the history's tokens are the prompt."""

    seq: int
    history: list[int]
    max_len: int
    n_prompt: int = 0


@dataclass
class Draft:
    """Proposed tokens, and where the drafter can tell, for each the chance that the target
    accepts it given that it accepted the ones before (the speculation policy's input)."""

    tokens: list[int]
    confidence: list[float] | None = None


class Drafter(Protocol):
    def propose(self, items: list[DraftItem]) -> list[Draft]:
        """One draft per item (possibly empty, at most max_len tokens), all slots at once."""
        ...

    def release(self, seq: int, history: list[int] | None = None) -> None:
        """The slot's request is over: forget everything about the sequence. ``history``: all
        its tokens, prompt and output (a drafter that learns across requests keeps them)."""
        ...
