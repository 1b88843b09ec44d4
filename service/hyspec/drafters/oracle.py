"""A controlled-acceptance drafter for benchmarks: acceptance is a parameter, not luck.

Given the target's real greedy continuation of a prompt (recorded from a plain run), it
proposes, position by position, the reference token with probability ``alpha`` and a wrong
token otherwise, each position on its own, for the whole length asked. So a drafted token whose
predecessors were accepted is accepted with probability ``alpha``, while the output, decided by
the greedy target, stays exactly the plain run's. Which output positions are drafted wrong is
drawn once per seed, not per call: every setting given the same seed meets the same wrong
positions, whatever lengths it drafts, so a pair of settings compares their policies and not
their luck (drawn per call, a setting drafting other lengths drew other wrong tokens; scenario
4's fixed drafts at α = 0.9 had 2 to 10 rollbacks a request from one pair to the next).

Like a real drafter it cannot tell where it went wrong: a fixed length is verified in full,
whatever follows a wrong token. The cost of speculation and rollback can then be charted against
acceptance on any target, with no draft model of the right quality.

An output can leave the reference at a near-tie that a batched verify broke the other way.
The drafter then looks for a longer registered prompt that starts the output (the bench
registers the plain continuation from the point of departure, see ``add_reference``) and drafts
on from its reference; with none, it cannot know the continuation and proposes nothing for the
rest of the sequence. ``diverged`` counts the sequences that went silent.
"""

from __future__ import annotations

import random

from hyspec.drafters import Draft, DraftItem


class OracleDrafter:
    def __init__(self, alpha: float = 0.5, seed: int = 0) -> None:
        self._references: dict[tuple[int, ...], list[int]] = {}
        self._prompt_of: dict[int, tuple[int, ...] | None] = {}  # seq -> its reference's prompt
        self.diverged = 0
        self.set_alpha(alpha, seed)

    def set_alpha(self, alpha: float, seed: int = 0) -> None:
        """Acceptance probability of each drafted token; reseeds the drafter's RNG."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._rng = random.Random(seed)
        self._right: list[bool] = []  # by history position: drafted right or wrong (drawn on first use)

    def add_reference(self, prompt: list[int], continuation: list[int]) -> None:
        """The target's greedy continuation of ``prompt`` (at least as long as the outputs to draft).
        A prompt that extends another one with part of an output takes over from it there."""
        if not prompt:
            raise ValueError("the prompt is empty")
        self._references[tuple(prompt)] = list(continuation)

    def clear_references(self) -> None:
        self._references.clear()

    def _find_prompt(self, history: list[int]) -> tuple[int, ...] | None:
        # The longest registered prompt that starts the history (or is all of it: one registered
        # where an output left a reference is, at the step after that token).
        best: tuple[int, ...] | None = None
        for prompt in self._references:
            if len(prompt) <= len(history) and tuple(history[:len(prompt)]) == prompt:
                if best is None or len(prompt) > len(best):
                    best = prompt
        return best

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        return [Draft(self._draft(item)) for item in items]

    def _draft(self, item: DraftItem) -> list[int]:
        if item.seq not in self._prompt_of:
            self._prompt_of[item.seq] = self._find_prompt(item.history)
        prompt = self._prompt_of[item.seq]
        if prompt is None or item.max_len <= 0:
            return []
        if not self._follows(item.history, prompt):
            prompt = self._find_prompt(item.history)  # a longer prompt may have been registered past here
            if prompt is None or not self._follows(item.history, prompt):
                self.diverged += 1
                self._prompt_of[item.seq] = None  # stays off the reference: no more drafts
                return []
            self._prompt_of[item.seq] = prompt
        done = len(item.history) - len(prompt)  # tokens past the prompt, the last sampled one included
        # A wrong token is any but the right one: the greedy target rejects it (short of a near-tie).
        # Positions count from the start of the history, whichever prompt the reference extends.
        return [token if self._is_right(len(item.history) + i) else (token - 1 if token > 0 else 1)
                for i, token in enumerate(self._references[prompt][done:done + item.max_len])]

    def _follows(self, history: list[int], prompt: tuple[int, ...]) -> bool:
        done = len(history) - len(prompt)
        return history[len(prompt):] == self._references[prompt][:done]

    def _is_right(self, position: int) -> bool:
        while len(self._right) <= position:
            self._right.append(self._rng.random() < self.alpha)
        return self._right[position]

    def release(self, seq: int, history: list[int] | None = None) -> None:
        self._prompt_of.pop(seq, None)
