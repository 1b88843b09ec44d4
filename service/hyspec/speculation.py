"""Which drafter proposes how many tokens for each slot, every step.

``--spec auto`` chains the drafters an engine has: the suffix drafter first (its proposals
cost next to nothing and carry a confidence from how often each continuation followed the
match), the draft model where that is worth more, and nothing where neither is expected to
pay (draft_policy.py weighs expected tokens against measured costs). ``ngram`` and ``draft``
use one drafter, with the same adaptive length unless the request asks for fixed drafts.
``calibrate`` measures the costs at start-up, before the first request, so that the first
request is not the one that pays for learning them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from hyspec._native import Context
from hyspec.draft_policy import KERNEL_BLOCK, Choice, SlotRecord, SpeculationPolicy
from hyspec.drafters import Draft, Drafter, DraftItem
from hyspec.rollback import SeqRollback
from hyspec.types import SpecMode

log = logging.getLogger("hyspec.speculation")

SUFFIX = "suffix"
DRAFT_MODEL = "draft"
CALIBRATION_ROUNDS = 3  # timings of each verify width at start-up (their median multiple of the step)
CALIBRATION_ATTEMPTS = 4  # warm-up timings taken again while rounds disagree (calibrate)
CALIBRATION_PAUSE = 1.0  # seconds before the second attempt, doubling after each
CALIBRATION_SPREAD = 2.0  # the most a majority of one kind's timings may differ by in a steady attempt


@dataclass
class DraftRequest:
    """One generating slot that may draft this step."""

    seq: int
    history: list[int]
    n_prompt: int
    mode: SpecMode
    max_len: int  # bounded by the context, max_tokens, the snapshot ring and draft_max
    draft_min: int
    adaptive: bool
    record: SlotRecord
    finishing: bool = False  # max_len is what is left of max_tokens after the step's own token


@dataclass
class Proposal:
    choice: Choice
    tokens: list[int]


@dataclass
class _Unverified:
    """A suffix draft (free) whose tokens, or the tail of them a slot did not verify, are compared
    with the tokens the target goes on with: a record learns without paying a probe, and a slot
    that verifies short drafts learns whether longer ones would have been right."""

    at: int  # the history's length when it was drafted
    tokens: list[int]
    confidence: list[float] | None
    verified: int = 0  # the leading tokens a verification compared (it learnt from them)
    compared: int = 0  # the tokens known so far (the policy has learnt from those)
    accepted: int = 0  # how many of them matched, in a row


class Speculator:
    def __init__(self, drafters: dict[SpecMode, Drafter], policy: SpeculationPolicy) -> None:
        self.suffix = drafters.get(SpecMode.NGRAM)
        self.model = drafters.get(SpecMode.DRAFT)
        self.policy = policy
        self._unverified: dict[int, _Unverified] = {}  # per slot, at most one at a time

    @property
    def modes(self) -> list[SpecMode]:
        """The modes a request may ask for."""
        modes = [SpecMode.OFF, SpecMode.AUTO]
        if self.suffix is not None:
            modes.append(SpecMode.NGRAM)
        if self.model is not None:
            modes.append(SpecMode.DRAFT)
        return modes

    def propose(self, requests: list[DraftRequest], n_generating: int) -> dict[int, Proposal]:
        """Each slot's draft for this step (slots left out draft nothing)."""
        for r in requests:
            self._settle(r)
        suffix_drafts = self._suffix([r for r in requests if r.mode in (SpecMode.AUTO, SpecMode.NGRAM)])
        proposals: dict[int, Proposal] = {}
        model_wanted: list[tuple[DraftRequest, Choice]] = []
        for r in requests:
            options: list[tuple[Choice, list[int]]] = []
            draft = suffix_drafts.get(r.seq)
            if draft is not None and draft.tokens:
                if r.adaptive:
                    choice = self.policy.choose(r.record, SUFFIX, len(draft.tokens), n_generating,
                                                confidence=draft.confidence,
                                                finishing=r.finishing and len(draft.tokens) == r.max_len)
                else:
                    choice = Choice(SUFFIX, len(draft.tokens), value=float("inf"), confidence=draft.confidence)
                options.append((choice, draft.tokens[:choice.length]))
            if self.model is not None and r.mode in (SpecMode.AUTO, SpecMode.DRAFT):
                if r.adaptive:
                    choice = self.policy.choose(r.record, DRAFT_MODEL, r.max_len, n_generating, draft_model=True,
                                                finishing=r.finishing)
                else:
                    choice = Choice(DRAFT_MODEL, r.max_len, value=float("inf"))
                options.append((choice, []))
            best = max(options, key=lambda o: o[0].value, default=None)
            if best is None or best[0].length < max(1, r.draft_min) or best[0].value <= 0:
                # Nothing pays now. The draft model is still tried now and then with one token,
                # or its record could never learn that the text became predictable. The suffix
                # drafter needs no probe: its declined drafts cost nothing and are compared with
                # the tokens the target writes (_settle), which is how its record learns (a
                # probe verified a whole draft, and on a hybrid target a rejection meant a
                # rollback: scenario 4's α = 0.6 paid ~10% for probes of eight tokens).
                if r.adaptive and self.policy.probe(r.record) and self.model is not None \
                        and r.mode in (SpecMode.AUTO, SpecMode.DRAFT) and r.draft_min <= 1 \
                        and self.policy.could_pay(r.max_len, n_generating, draft_model=True):
                    model_wanted.append((r, Choice(DRAFT_MODEL, 1, probe=True)))
                continue
            r.record.idle_steps = 0
            choice, tokens = best
            if choice.drafter == DRAFT_MODEL:
                model_wanted.append((r, choice))
            else:
                proposals[r.seq] = Proposal(choice, tokens)
        proposals.update(self._model(model_wanted))
        for r in requests:
            self._keep_unverified(r, suffix_drafts.get(r.seq), proposals.get(r.seq))
        return proposals

    def _keep_unverified(self, r: DraftRequest, draft: Draft | None, proposal: Proposal | None) -> None:
        """What of this step's suffix draft is compared with the target's tokens to come: all of
        it when the slot does not verify it (unless an earlier draft is still being compared), the
        tail beyond what it verifies when it verifies a part. A verified suffix draft supersedes
        an earlier unverified one (their tokens would be counted twice)."""
        if draft is None or not draft.tokens:
            return
        if proposal is not None and proposal.choice.drafter == SUFFIX:
            self._drop_unverified(r.seq)
            used = len(proposal.tokens)
            if used < len(draft.tokens):
                self._unverified[r.seq] = _Unverified(len(r.history), draft.tokens, draft.confidence,
                                                         verified=used, compared=used, accepted=used)
        elif r.seq not in self._unverified:
            self._unverified[r.seq] = _Unverified(len(r.history), draft.tokens, draft.confidence)

    def _settle(self, r: DraftRequest) -> None:
        """Compare the slot's unverified draft with the tokens written since: the policy learns
        from each token as it comes, and from the whole once it is settled (a token differed,
        or all were compared)."""
        pending = self._unverified.get(r.seq)
        if pending is None:
            return
        since = r.history[pending.at:pending.at + len(pending.tokens)]
        accepted = next((i for i, token in enumerate(since) if token != pending.tokens[i]), len(since))
        if accepted < pending.verified:  # the verification rejected it: it learnt all there was
            self._drop_unverified(r.seq)
            return
        compared = min(len(since), accepted + 1)
        confidence = pending.confidence
        new = slice(pending.compared, compared)
        self.policy.unverified(r.record, SUFFIX, confidence[new] if confidence is not None else None,
                               compared - pending.compared, accepted - pending.compared)
        pending.compared, pending.accepted = compared, accepted
        if accepted < len(since) or len(since) == len(pending.tokens):
            self._drop_unverified(r.seq)

    def _drop_unverified(self, seq: int) -> None:
        """The slot's unverified draft is settled, superseded or its request ended: the record of
        a drafter without confidence learns from what of it was compared (a calibration learnt
        token by token)."""
        pending = self._unverified.pop(seq, None)
        if pending is not None and pending.confidence is None:
            self.policy.settled(SUFFIX, pending.verified, pending.compared - pending.verified,
                                pending.accepted - pending.verified)

    def _suffix(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        if self.suffix is None or not requests:
            return {}
        items = [DraftItem(r.seq, r.history, r.max_len, r.n_prompt) for r in requests]
        return {r.seq: d for r, d in zip(requests, self.suffix.propose(items), strict=True)}

    def _model(self, wanted: list[tuple[DraftRequest, Choice]]) -> dict[int, Proposal]:
        if self.model is None or not wanted:
            return {}
        items = [DraftItem(r.seq, r.history, c.length, r.n_prompt) for r, c in wanted]
        started = time.perf_counter()
        drafts = self.model.propose(items)
        # The draft model drafts every slot's k-th token in one decode: a slot's own cost is the
        # steps of the longest draft, whoever else drafts along.
        self.policy.costs.drafted(time.perf_counter() - started, max(c.length for _, c in wanted))
        return {r.seq: Proposal(Choice(c.drafter, len(d.tokens), c.expected, c.value, c.probe), d.tokens)
                for (r, c), d in zip(wanted, drafts, strict=True)}

    def verified(self, record: SlotRecord, choice: Choice, drafted: int, accepted: int) -> None:
        """The target verified ``drafted`` of the proposal's tokens (the step may have had room
        for fewer than proposed) and accepted ``accepted``."""
        stated = choice.confidence[:drafted] if choice.confidence is not None else None
        # Choices are built, not dataclasses.replace'd: that costs ~50 us, a twentieth of a tiny target's step.
        verified = Choice(choice.drafter, drafted, choice.expected, choice.value, choice.probe, stated)
        self.policy.observe(record, verified, accepted)

    def release(self, seq: int, record: SlotRecord, history: list[int]) -> None:
        """The slot's request ended; ``record`` is what its drafts were worth, ``history`` all
        its tokens."""
        self._drop_unverified(seq)
        self.policy.finished(record)
        for drafter in (self.suffix, self.model):
            if drafter is not None:
                drafter.release(seq, history)


def calibrate(ctx: Context, policy: SpeculationPolicy, rollback: SeqRollback, prompt: list[int],
              model: Drafter | None, max_width: int) -> None:
    """Measure what a decode pass of each verify width up to ``max_width`` tokens costs here (as a
    multiple of a one-token pass timed just before it, ``CALIBRATION_ROUNDS`` times), a draft-model
    token and a rollback, on sequence 0 of an idle context (cleared again), and how often the
    draft model agrees with the target on a short greedy run from ``prompt``.

    Timings whose rounds mostly disagree (something else seized the cores) are taken again after
    a pause, up to CALIBRATION_ATTEMPTS times, and the steadiest attempt is kept: a wide pass is
    timed again only when it is drafted, so a multiple read far too high is never corrected. A
    trained pair's worker started while a test suite ran read a 2-token pass at 28 one-token ones
    and a 3-token pass at 0.1, and its n-gram mode drafted nothing in any of its requests."""
    best: _Timings | None = None
    best_spread = math.inf
    for attempt in range(CALIBRATION_ATTEMPTS):
        timings = _time_passes(ctx, rollback, prompt, max_width)
        spread = timings.spread()
        if spread < best_spread:
            best, best_spread = timings, spread
        if spread <= CALIBRATION_SPREAD:
            break
        last = attempt + 1 == CALIBRATION_ATTEMPTS
        log.warning("warm-up timings vary %.1fx between rounds (attempt %d of %d): something else is busy; %s",
                    spread, attempt + 1, CALIBRATION_ATTEMPTS,
                    "keeping the steadiest attempt" if last else "timing again")
        if not last:
            time.sleep(CALIBRATION_PAUSE * 2 ** attempt)  # a busy spell may pass
    assert best is not None
    policy.costs.calibrated(best.steps, best.multiples)
    for seconds in best.rollbacks:
        policy.costs.rolled_back(seconds)
    if model is not None:
        _calibrate_model(model, policy, prompt, best.greedy)


@dataclass
class _Timings:
    """One attempt of the warm-up's timings (see calibrate)."""

    steps: list[float]  # one-token passes
    multiples: dict[int, list[float]]  # each wider pass ÷ the one-token pass just before it, by width
    rollbacks: list[float]
    greedy: list[int]  # the target's greedy run from the prompt

    def spread(self) -> float:
        """How far apart the timings of one kind (the one-token passes, or one width's
        multiples) are where most of them agree: the tightest ratio that spans a majority of
        them, the largest over the kinds. The medians kept stand for most rounds while it is
        small; one pass held up by something else does not count (of three rounds, the two
        nearest decide)."""
        def tightest_majority(group: list[float]) -> float:
            ordered, k = sorted(group), len(group) // 2 + 1
            return min(ordered[i + k - 1] / max(ordered[i], 1e-9) for i in range(len(ordered) - k + 1))

        return max(tightest_majority(g) for g in (self.steps, *self.multiples.values()) if g)


def _time_passes(ctx: Context, rollback: SeqRollback, prompt: list[int], max_width: int) -> _Timings:
    ctx.memory_clear()
    try:
        ctx.decode(prompt, range(len(prompt)), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        greedy = [int(ctx.argmax_all()[0])]
        pos = len(prompt)

        def plain_step() -> float:
            nonlocal pos
            started = time.perf_counter()
            ctx.decode([greedy[-1]], [pos], [0], [True])
            seconds = time.perf_counter() - started
            greedy.append(int(ctx.argmax_all()[0]))
            pos += 1
            return seconds

        timings = _Timings([plain_step() for _ in range(4)], {}, [], greedy)
        # Each round keeps two tokens per width (a plain step and a verified one) and needs room for the widest.
        room = min(max_width, ctx.n_batch, (ctx.n_ctx_seq - pos) // (2 * CALIBRATION_ROUNDS + 1))
        for width in _calibration_widths(room) * CALIBRATION_ROUNDS:  # verifies, all but one token rejected
            timings.steps.append(plain_step())
            filler = (greedy * (width // len(greedy) + 1))[:width]
            checkpoint = rollback.checkpoint(0, pos, None, ring_unsafe=True)
            started = time.perf_counter()
            ctx.decode(filler, range(pos, pos + width), [0] * width, [True] * width)
            timings.multiples.setdefault(width, []).append((time.perf_counter() - started) / timings.steps[-1])
            started = time.perf_counter()
            kept = rollback.truncate(0, pos + 1, checkpoint)
            if kept <= pos:  # restored: replay the accepted token, as a hybrid target does
                ctx.decode(filler[:pos + 1 - kept], range(kept, pos + 1), [0] * (pos + 1 - kept),
                           [False] * (pos + 1 - kept))
                timings.rollbacks.append(time.perf_counter() - started)
            pos += 1
        return timings
    finally:
        ctx.memory_clear()


def _calibration_widths(room: int) -> list[int]:
    """The verify widths the warm-up times: every one up to 17, then every kernel block's and ``room``.
    Neighbouring widths are far from linear on a CPU: ggml's repacked quantized kernels take the
    batch four columns at a time, so here Gemma 3's 8-token pass took 44 ms and its 9-token pass
    60 ms (LFM2-1.2B Q8_0: 146 and 198 ms); interpolating between widths 5 and 9 had the policy
    draft 8 tokens where 7 verify 20% more tokens a second."""
    return [w for w in range(2, room + 1) if w <= 17 or w % KERNEL_BLOCK == 0 or w == room]


def _calibrate_model(model: Drafter, policy: SpeculationPolicy, prompt: list[int], greedy: list[int]) -> None:
    """The draft model's cost per token and its agreement with the target's greedy run, as the
    prior of its acceptance record (on sequence 0 of its context, released again)."""
    agreed = 0
    for i in range(len(greedy) - 1):
        started = time.perf_counter()
        draft = model.propose([DraftItem(0, prompt + greedy[:i + 1], 1, len(prompt))])[0]
        if i:  # the first call decodes the prompt
            policy.costs.drafted(time.perf_counter() - started, 1)
        agreed += int(bool(draft.tokens) and draft.tokens[0] == greedy[i + 1])
    model.release(0)
    policy.record(DRAFT_MODEL).prior = float(np.clip(agreed / max(1, len(greedy) - 1), 0.05, 0.95))
