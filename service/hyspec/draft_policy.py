"""How many tokens to draft next, from how often the slot's drafts were accepted.

Every drafted token costs a verified position (and, when it is rejected on a hybrid target,
a restore and a replay); on a CPU that is close to the price of a plain decode step. So a
slot drafts k tokens only while the k-th one is likely to be accepted: the estimated
acceptance rate to the k-th power must stay above ``min_chance``. When even one token is not
worth it the slot stops drafting, and probes with a single token every ``probe_every`` steps
so that it notices when the text turns predictable again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DraftPolicy:
    draft_max: int
    adaptive: bool = True
    min_chance: float = 0.4
    decay: float = 0.7  # weight of the past in the acceptance estimate
    probe_every: int = 8
    # Optimistic start (Beta-like prior): a new request drafts fully until evidence says otherwise.
    _accepted: float = 2.0
    _drafted: float = 2.0
    _idle_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._drafted

    def length(self) -> int:
        """Tokens to draft this step (0: skip drafting)."""
        if not self.adaptive or self.draft_max == 0:
            return self.draft_max
        alpha = self.acceptance
        if alpha >= 1.0:
            k = self.draft_max
        elif alpha <= 0.0:
            k = 0
        else:
            k = int(math.log(self.min_chance) / math.log(alpha))
        k = min(k, self.draft_max)
        if k == 0:
            self._idle_steps += 1
            if self._idle_steps >= self.probe_every:
                self._idle_steps = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification; a rejection counts as the draft position it happened at."""
        if drafted == 0:
            return
        # Tokens after the first rejected one say nothing about acceptance: they were
        # never compared.
        compared = min(drafted, accepted + 1)
        self._accepted = self.decay * self._accepted + accepted
        self._drafted = self.decay * self._drafted + compared
