"""How many tokens to draft next: speculate only while it is expected to pay.

Every drafted token costs a verified position, the draft model's time to propose it and,
when it is rejected on a hybrid target, a replay; on a CPU that can cost more than the
tokens it wins. ``StepCosts`` learns on this machine what a target decode costs (a fixed
part, one pass over the weights, and a part per token), what drafting a token costs and
what a replay costs. Each slot's ``DraftPolicy`` keeps its own estimate of the acceptance
rate α and picks the draft length k that maximises expected tokens per second:

    tokens(k) = (1 - α^(k+1)) / (1 - α)          the accepted drafts plus the target's own
    cost(k)   = base + k (per_token + draft) + P(rejection) replay

k = 0 is plain decoding. When it wins, the slot still probes with one token now and then
(every 8 steps, twice as rarely after each probe that failed) to notice predictable text.
Until the costs are known it drafts while α^k stays above ``min_chance``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_WEIGHT = 0.2  # of a new observation in the running estimates


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


@dataclass
class StepCosts:
    """Running estimates, in seconds, of what speculation costs on this machine (shared by
    the slots of one engine; measured by the scheduler)."""

    base: float | None = None  # a target decode without drafts
    per_token: float | None = None  # each more token in a target decode
    draft: float | None = None  # proposing one draft token
    replay: float | None = None  # a replay decode after a hybrid rollback

    def decoded(self, seconds: float, extra_tokens: int) -> None:
        """A target decode that held ``extra_tokens`` draft tokens besides one per slot."""
        if extra_tokens == 0:
            self.base = _ema(self.base, seconds)
        elif self.base is not None:
            self.per_token = _ema(self.per_token, max(0.0, seconds - self.base) / extra_tokens)

    def drafted(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.draft = _ema(self.draft, seconds / tokens)

    def replayed(self, seconds: float) -> None:
        self.replay = _ema(self.replay, seconds)

    @property
    def known(self) -> bool:
        return self.base is not None and self.base > 0


@dataclass
class DraftPolicy:
    draft_max: int
    adaptive: bool = True
    costs: StepCosts = field(default_factory=StepCosts)
    min_chance: float = 0.4
    decay: float = 0.7  # weight of the past in the acceptance estimate
    probe_every: int = 8
    # A mildly optimistic start: a new request drafts until evidence says otherwise.
    _accepted: float = 1.5
    _drafted: float = 2.0
    _idle_steps: int = 0
    _probing: bool = False
    _failed_probes: int = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._drafted

    def length(self) -> int:
        """Tokens to draft this step (0: skip drafting)."""
        if not self.adaptive or self.draft_max == 0:
            return self.draft_max
        k = self._best_length(self.acceptance)
        if k > 0:
            self._idle_steps = 0
            return k
        self._idle_steps += 1
        if self._idle_steps >= self.probe_every << min(self._failed_probes, 4):
            self._idle_steps = 0
            self._probing = True
            return 1
        return 0

    def _best_length(self, alpha: float) -> int:
        if alpha >= 1.0:
            return self.draft_max
        if alpha <= 0.0:
            return 0
        if not self.costs.known:
            return min(self.draft_max, int(math.log(self.min_chance) / math.log(alpha)))
        c = self.costs
        assert c.base is not None
        per_token = (c.per_token or 0.0) + (c.draft or 0.0)
        replay = c.replay or 0.0
        best_k, best_rate = 0, 1.0 / c.base
        for k in range(1, self.draft_max + 1):
            tokens = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
            cost = c.base + k * per_token + (1.0 - alpha**k) * replay
            if tokens / cost > best_rate:
                best_k, best_rate = k, tokens / cost
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification."""
        if drafted == 0:
            return
        # Tokens after the first rejected one say nothing about acceptance: they were
        # never compared.
        compared = min(drafted, accepted + 1)
        self._accepted = self.decay * self._accepted + accepted
        self._drafted = self.decay * self._drafted + compared
        if accepted:
            self._failed_probes = 0
        elif self._probing:
            self._failed_probes += 1
        self._probing = False
