"""How many tokens to draft, and with which drafter: speculate only where it is expected to pay.

Every drafted token costs a verified position in the target's decode, the drafter's time and,
when a rejection forces a restore on a hybrid target, a rollback; on a CPU that can cost more
than the tokens it wins. ``Costs`` knows what this machine pays (calibrated at start-up, then
refined by every step): a decode pass by its width in tokens, a draft-model token and a
rollback. A drafter stating no confidence (a draft model) is judged by what earlier requests'
drafts were worth, each earlier request one kind the slot's may be (``EarlierRequests``: a
mixture weighted by what the slot has seen); until a few requests have finished, by
``Acceptance``, how often a drafted token at each position was accepted given the ones before
it, blended with the slot's own record. So a new request starts from experience, not
optimism. A drafter that states a confidence per token (the suffix drafter) is taken at its
word only as far as ``Calibration`` has seen that word kept: acceptance is learnt per band of
stated confidence.

For a slot offered a draft whose tokens are accepted with chances a_1..a_K (in a row), drafting
k of them yields on average

    gain(k) = sum_{i<=k} a_1 a_2 ... a_i         extra tokens this step

and makes the step longer by

    delay(k) = pass(base + k) - pass(base) + k draft + (1 - a_1..a_k) rollback

where pass(n) is a decode pass of n tokens and base the step's tokens without drafts (one per
busy slot); when the drafted tokens go in a ubatch of their own, as they do on a hybrid target
with several busy slots, the first term is a whole pass(k + 1).

``best_length`` takes the k that gives the step the most tokens per second,

    (base + gain(k)) / (pass(base) + delay(k)),

and 0 unless that beats the step without drafts: gain(k) must beat rate x delay(k), the rate
being every busy slot's token per step time. So a drafter that is as slow as the target, or
rarely right, is not used, and with many busy slots a verified token must be more likely to be
accepted to be worth its place in the batch. Among lengths that pay, a longer draft must also
keep up the rate the shorter one already gives: the ninth token of a pass that ggml's kernels
take four columns at a time costs most of a weight pass, which beats plain decoding's rate but
not that of the eight before it (LFM2-1.2B Q8_0: eight tokens in 2.1 steps, nine in 2.9).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
from collections import deque
from dataclasses import dataclass, field

_WEIGHT = 0.2  # of a new measurement in the running cost estimates
# A slot's own observations count against this many of its drafter's record: one verification's
# worth, so that a request whose drafts fail after requests whose drafts were right stops
# drafting within a couple of verifications (8 had let scenario 4's α = 0.6 requests with
# checkpoints draft 16-40 tokens and roll back 2-10 times after the α = 0.9 ones).
PRIOR_WEIGHT = 4.0
# Once this many requests have finished, a slot's drafts are judged by theirs (EarlierRequests).
EARLIER_REQUESTS_NEEDED = 3
EARLIER_REQUESTS_KEPT = 32  # the latest finished requests it keeps
EARLIER_MIN_COMPARED = 8  # a request that compared fewer tokens says too little to count
KNOWN_CHANCES_KEPT = 256  # EarlierRequests' remembered answers (busy slots' counts) at most
MAX_ACCEPTANCE = 0.98  # no estimate is ever certain
CONFIDENCE_BANDS = 10  # a calibration learns the acceptance of each tenth of stated confidence
CALIBRATION_PRIOR = 4.0  # a band starts at its stated confidence, worth this many observations


# Draft lengths whose expected rates are within this share of the best are taken as equal, and
# the longest of them drafted. The rates rest on pass times that drift between the machine's
# spells and on chances capped at MAX_ACCEPTANCE (which undervalues a long draft that is always
# right), and a width that is not drafted is not timed again: a nine-token pass read in a slow
# spell at 1.73 steps made five drafts of the F16 echo target look as good as eight, and it
# drafted five for four requests (one verify pass more each, ~9%).
RATE_TOLERANCE = 0.05
FOLLOW_PACE = 0.5  # of a width's learnt drift that the other widths take (Costs._follow)
KERNEL_BLOCK = 4  # the batch columns ggml's repacked CPU kernels take at a time


def _bounded(chance: float) -> float:
    """A chance of acceptance within [0, MAX_ACCEPTANCE]."""
    return min(MAX_ACCEPTANCE, max(0.0, chance))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


@dataclass
class Costs:
    """What speculation costs on this machine, in seconds (shared by an engine's slots).

    A decode's time is far from linear in its tokens on a CPU: going from one token to two can
    cost most of a weight pass (matrix-vector kernels give way to matrix-matrix ones) while the
    next few are nearly free, so a pass's time is kept per width (tokens in the ubatch) and
    interpolated between the widths seen. Wider passes are kept as multiples of the one-token
    pass measured when they ran: a shared machine drifts between fast and slow spells (plain
    steps of 60 or 85 ms from one request to the next here), and a nine-token pass timed in a slow
    spell, held against one-token passes of a fast one, made drafting look 40% dearer than it was.
    The spells are not one factor for every width: a one-token pass reads the weights and moves
    with memory bandwidth, a nine-token one computes more and moves less (LFM2-1.2B F16 here: 57
    and 182 ms in one hour, 93 and 196 in another), so a width's multiple follows the step."""

    step: float = 0.0  # a one-token pass (0: none seen)
    relative: dict[int, float] = field(default_factory=dict)  # a wider pass's time ÷ step's, by width
    draft_token: float = 0.0  # a draft model's token (all slots drafting together share it)
    rollback: float = 0.0  # restoring a checkpoint and replaying, on a hybrid target
    _widths: list[int] = field(default_factory=list, repr=False)  # sorted keys of relative

    def decoded(self, seconds: float, ubatch_sizes: list[int]) -> None:
        """A target decode made of ubatches of these sizes: each pass is credited its predicted
        share of the time (a width is first learnt from one-pass decodes and the calibration).
        Wider passes are learnt once a one-token pass is known."""
        predicted = [self.pass_time(n) for n in ubatch_sizes]
        total = sum(predicted)
        if len(ubatch_sizes) == 1 or total <= 0:
            shares = [seconds / len(ubatch_sizes)] * len(ubatch_sizes)
        else:
            shares = [seconds * p / total for p in predicted]
        for n, share in zip(ubatch_sizes, shares, strict=True):
            if n == 1:
                self.step = _ema(self.step or None, share)
                if 1 not in self.relative:
                    self.relative[1] = 1.0
                    bisect.insort(self._widths, 1)
            elif self.step > 0:
                before = self.relative.get(n)
                if before is None:
                    bisect.insort(self._widths, n)
                    self.relative[n] = share / self.step
                else:
                    self.relative[n] = _ema(before, share / self.step)
                    self._follow(n, before, set(ubatch_sizes))

    def _follow(self, width: int, before: float, measured: set[int]) -> None:
        """Move the wide passes' multiples not ``measured`` in this decode along with ``width``'s,
        at half its pace. A one-token pass is M + C (weights read, one token computed), an n-token
        pass M + C(n), so a drift of either moves every width's excess over a step,
        (C(n) - C) / (M + C), by one factor: learnt on the width a slot drafts most, it holds for
        the widths it seldom tries. Kept apart, a nine-token pass learnt 3.3 steps in a fast spell
        while the eight-token one kept the 2.2 of the warm-up's slow one, and the F16 echo target
        drafted seven tokens, not eight, in three of its next steps. Half the pace, so the widths'
        own measurements still shape the curve."""
        if before <= 1.0:
            return
        factor = min(2.0, max(0.5, (self.relative[width] - 1.0) / (before - 1.0)))
        follow = 1.0 + (factor - 1.0) * FOLLOW_PACE
        for other, multiple in self.relative.items():
            if other > 1 and other not in measured:
                self.relative[other] = 1.0 + (multiple - 1.0) * follow

    def calibrated(self, steps: list[float], multiples: dict[int, list[float]]) -> None:
        """Start-up timings: one-token passes, and each wider pass's multiples of the one-token
        pass timed just before it. Medians: a server starting shares the machine with whatever
        else is starting (the bench's llama-servers loading their models made a one-token pass
        read 158 ms where it takes 57, and widths 7-9 read cheaper than one token)."""
        self.step = statistics.median(steps)
        self.relative.update({1: 1.0} | {n: statistics.median(m) for n, m in multiples.items()})
        self._widths = sorted(self.relative)

    def pass_time(self, n: int) -> float:
        """A one-ubatch decode of ``n`` tokens: linear between the nearest widths seen, flat
        below the narrowest and, beyond the widest, along the slope of the last four widths
        or more (0: none seen)."""
        return self.step * self._relative(n)

    def _relative(self, n: int) -> float:
        known = self.relative.get(n)
        if known is not None:
            return known
        widths = self._widths
        if not widths:
            return 0.0
        i = bisect.bisect(widths, n)
        above = widths[i] if i < len(widths) else None
        below = widths[max(0, i - 2):i]
        if above is None:
            if len(below) < 2:
                return self.relative[widths[-1]]
            # The slope over a kernel's column block (four widths) or more: between neighbours
            # it is that of the block's edge (a 9-token pass can cost a step more than 8).
            b = widths[-1]
            a = widths[max(0, bisect.bisect(widths, b - KERNEL_BLOCK) - 1)]
        elif not below:
            return self.relative[above]
        else:
            a, b = below[-1], above
        slope = max(0.0, (self.relative[b] - self.relative[a]) / (b - a))
        return self.relative[a] + slope * (n - a)

    def drafted(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.draft_token = _ema(self.draft_token or None, seconds / tokens)

    def rolled_back(self, seconds: float) -> None:
        self.rollback = _ema(self.rollback or None, seconds)

    @property
    def known(self) -> bool:
        return self.step > 0


@dataclass
class Acceptance:
    """Per-position acceptance of one drafter over all requests: the chance that the token at
    position i of a draft is accepted given the ones before it were."""

    accepted: list[float] = field(default_factory=list)
    compared: list[float] = field(default_factory=list)
    prior: float = 0.5  # before any observation (calibrated at start-up where possible)

    def rate(self, position: int) -> float:
        """The chance at ``position``, the prior counting as one observation: a position seen
        once or twice (deep ones, after a record of short accepted runs) must not read as
        certainty, nor as hopeless."""
        if position < len(self.compared):
            return self._smoothed(self.accepted[position], self.compared[position])
        return self.prior

    def overall(self) -> float:
        """The chance of any compared token, whatever its position (the prior as one observation):
        what a slot's own record, which does not keep positions, is measured against."""
        return self._smoothed(sum(self.accepted), sum(self.compared))

    def _smoothed(self, accepted: float, compared: float) -> float:
        return _bounded((accepted + self.prior) / (compared + 1.0))

    def update(self, drafted: int, accepted: int, decay: float = 0.98, offset: int = 0) -> None:
        """One verification of a draft's tokens from position ``offset`` on (its earlier ones were
        accepted): tokens after the first rejection were never compared. Older observations
        fade by ``decay`` per token compared, so the record follows what the drafter does now
        (a verification of eight tokens says more than one of a single token)."""
        compared = min(drafted, accepted + 1)
        fade = decay ** compared
        for i in range(compared):
            while len(self.compared) <= offset + i:
                self.compared.append(0.0)
                self.accepted.append(0.0)
            self.compared[offset + i] = fade * self.compared[offset + i] + 1.0
            self.accepted[offset + i] = fade * self.accepted[offset + i] + (1.0 if i < accepted else 0.0)


@dataclass
class Calibration:
    """What a drafter's stated confidence turns out to mean: the acceptance observed per band of
    confidence, each band starting from the confidence itself. One factor for all confidences
    cannot do this: a continuation seen once after a ten-token match states 0.75 and is usually
    copied text, right more often than that, while short matches may be worth less than stated."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BANDS)
    compared: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BANDS)

    @staticmethod
    def _band(confidence: float) -> int:
        return min(CONFIDENCE_BANDS - 1, max(0, int(confidence * CONFIDENCE_BANDS)))

    def chance(self, confidence: float) -> float:
        band = self._band(confidence)
        chance = (self.accepted[band] + CALIBRATION_PRIOR * confidence) / (self.compared[band] + CALIBRATION_PRIOR)
        return _bounded(chance)

    def update(self, confidence: list[float], accepted: int, decay: float = 0.98) -> None:
        """One verification of tokens drafted with these confidences, ``accepted`` of them in a
        row; tokens after the first rejection were never compared. A band's older observations
        fade by ``decay`` per new one, so it follows what the drafter does now."""
        for i, stated in enumerate(confidence[:accepted + 1]):
            band = self._band(stated)
            self.compared[band] = decay * self.compared[band] + 1.0
            self.accepted[band] = decay * self.accepted[band] + (1.0 if i < accepted else 0.0)


@dataclass
class EarlierRequests:
    """What finished requests' drafts stating no confidence were worth, one rate per request:
    what a new slot's drafts are expected to be worth, once enough requests have finished (before,
    the drafter's token record is). The drafter's token record follows the latest requests
    (older tokens fade), so a request after one of another kind started from that one: scenario
    4 serves α = 0.3, 0.6 and 0.9 requests in a shuffled order, and an α = 0.9 request after
    α = 0.3 ones declined its first 14-19 steps. Their mean (0.6, a beta prior fitted to them)
    was no better with checkpoint + replay, where drafts pay only when nearly always right: it took
    20 observations to read 0.85. Requests come in kinds (clients, prompts), so each earlier
    request is one possibility, weighted by how likely it makes what the slot has seen so far
    (an empirical mixture): nine right of ten rules out 0.3 and 0.6 at once."""

    # Each request's rate with the logarithms of it and of its complement, taken once: a slot's
    # choice weighs every kept request each step.
    rates: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=EARLIER_REQUESTS_KEPT))
    # chances() by a slot's counts and length, until the next request finishes: a slot's counts
    # stay put while the suffix drafter drafts for it, and `auto` weighs the draft model every
    # step (the mixture takes ~25 us; a tiny target's step, ~2 ms).
    _known: dict[tuple[float, float, int], list[float]] = field(default_factory=dict, repr=False)

    def finished(self, accepted: float, compared: float) -> None:
        """A request ended having compared ``compared`` tokens of such drafts, ``accepted`` right."""
        if compared >= EARLIER_MIN_COMPARED:
            rate = min(MAX_ACCEPTANCE, max(1.0 - MAX_ACCEPTANCE, accepted / compared))
            self.rates.append((rate, math.log(rate), math.log(1.0 - rate)))
            self._known.clear()

    def chances(self, accepted: float, compared: float, max_len: int) -> list[float] | None:
        """The chance of each of ``max_len`` drafted tokens, given the ones before it were
        accepted, for a slot that has seen ``accepted`` right of ``compared``; None until
        EARLIER_REQUESTS_NEEDED requests have finished. Each kind is weighted by how likely it
        makes what the slot has seen, and one more kind stands for any rate at all (uniform): a
        slot right far more often than every earlier request must still find out. A draft's
        first k tokens are all right with the mixture's mean of rate^k, so a deep token is
        likelier than the first (reaching it says the request is of a better kind): at α = 0.9
        after α = 0.3 and 0.6 requests, the mean rate scaled by the drafter's per-position record,
        whose deep positions pool the good requests, had read a slot's first token at 0.6 and
        its whole draft far better, and drafted four or five tokens where eight paid."""
        if len(self.rates) < EARLIER_REQUESTS_NEEDED:
            return None
        key = (accepted, compared, max_len)
        if key not in self._known:
            if len(self._known) >= KNOWN_CHANCES_KEPT:
                self._known.clear()
            self._known[key] = self._mixture(accepted, compared, max_len)
        return list(self._known[key])

    def _mixture(self, accepted: float, compared: float, max_len: int) -> list[float]:
        rejected = compared - accepted
        logs = [accepted * log_right + rejected * log_wrong for _, log_right, log_wrong in self.rates]
        logs.append(math.lgamma(accepted + 1) + math.lgamma(rejected + 1) - math.lgamma(compared + 2))  # any rate
        top = max(logs)
        weights = [math.exp(x - top) for x in logs]
        runs, any_rate = weights[:-1], weights[-1]  # each kind's weight x the chance of a run of k right
        before = sum(weights)
        chances = []
        for k in range(max_len):
            runs = [run * rate for run, (rate, _, _) in zip(runs, self.rates, strict=True)]
            any_rate *= (accepted + 1 + k) / (compared + 2 + k)  # a beta distribution's moments
            now = sum(runs) + any_rate
            chances.append(_bounded(now / before))
            before = now
        return chances


@dataclass
class SlotRecord:
    """One slot's own acceptance, blended with its drafter's record over all requests."""

    accepted: float = 0.0  # tokens of drafts stating no confidence: accepted of compared
    compared: float = 0.0
    # Tokens of drafts stating a confidence: accepted, against the chances their calibration
    # gave the compared ones (what the slot does beyond what the drafter's record predicts).
    stated_accepted: float = 0.0
    stated_expected: float = 0.0
    idle_steps: int = 0
    failed_probes: int = 0
    # Drafters without a confidence that chose 0 tokens, and for what (max_len, busy slots, finishing):
    # their inputs change only with observations, so the choice stands for a few steps.
    declined: dict[str, tuple[int, int, bool]] = field(default_factory=dict)

    def chances(self, max_len: int, record: Acceptance, confidence: list[float] | None,
                calibration: Calibration) -> list[float]:
        """The chance each drafted token is accepted: the drafter's own confidence where it has
        one (read through its calibration), else the global per-position rate; either scaled by
        how this slot's record compares with what the drafter's record predicted (for rates,
        both pool every compared token: an unweighted mean of the per-position rates had let a
        deep position seen once, at 0.98, hide a slot's 35 of 41 against a record of 0.3). A
        request that copies text from its prompt has its drafts right far more often than the
        drafter's confidence bands say over all requests; the slot's record finds that out
        within a few verifications (Gemma 3's first agentic request drafted two tokens a step,
        each right, for most of its answer while the bands caught up). Rates are read this way
        only until earlier requests say what kinds of request there are (EarlierRequests)."""
        if confidence is not None:
            shift = (self.stated_accepted + PRIOR_WEIGHT) / (self.stated_expected + PRIOR_WEIGHT)
            return [_bounded(calibration.chance(c) * shift) for c in confidence[:max_len]]
        overall = record.overall()
        own = (self.accepted + PRIOR_WEIGHT * overall) / (self.compared + PRIOR_WEIGHT)
        shift = own / max(overall, 1e-6)
        return [_bounded(record.rate(i) * shift) for i in range(max_len)]

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted += accepted
            self.compared += min(drafted, accepted + 1)

    def update_stated(self, chances: list[float], accepted: int) -> None:
        """Drafted tokens that had these calibrated chances, ``accepted`` of them in a row (those
        after the first rejection were never compared)."""
        self.stated_accepted += accepted
        self.stated_expected += sum(chances[:accepted + 1])


def expected_gain(chances: list[float]) -> list[float]:
    """gain[k]: the expected accepted drafts when drafting the first k tokens (gain[0] = 0)."""
    gain, run = [0.0], 1.0
    for a in chances:
        run *= a
        gain.append(gain[-1] + run)
    return gain


def best_length(chances: list[float], costs: Costs, *, rate: float, base: int, draft_model: bool, own_pass: bool,
                rollback: bool, finishing: bool = False) -> tuple[int, float]:
    """The draft length (0..len(chances)) that gives the step the most tokens per second, and
    its value: the tokens it gains over plain decoding in the time of a step without drafts (0
    for k = 0). ``rate``: the step's tokens per second without drafts; ``base``: the tokens of
    that step's pass (one per busy slot); ``draft_model``: each token costs a draft-model step;
    ``own_pass``: drafting puts this slot in a ubatch of its own (a weight pass); ``rollback``: a
    rejection costs a restore and a replay.

    ``finishing``: the step's token and all of ``chances`` are the request's last tokens (its
    budget). A lone busy slot then takes the length that ends the request soonest on average
    (``_finishing_times``), not the step's best rate: at the end of an answer, four tokens at the
    best rate and three more in a pass of their own took longer than all seven in one pass.
    Either way, the longest length within RATE_TOLERANCE of the best rate is taken."""
    if not chances or not costs.known:
        return 0, 0.0
    step = base / rate  # the step's time without drafts
    start = 1 if own_pass else base
    passes = [costs.pass_time(start + k) for k in range(len(chances) + 1)]
    runs = list(itertools.accumulate(chances, operator.mul, initial=1.0))  # all of the first k accepted
    delays = [0.0]
    for k in range(1, len(chances) + 1):
        delay = passes[k] if own_pass else max(0.0, passes[k] - passes[0])
        delay += k * costs.draft_token if draft_model else 0.0
        delay += (1.0 - runs[k]) * costs.rollback if rollback else 0.0
        delays.append(delay)
    if finishing and base == 1:
        n = len(chances) + 1
        rates = [n / t for t in _finishing_times(chances, runs, [step + d for d in delays])]
    else:
        rates = [(base + gain) / (step + delay) for gain, delay in zip(expected_gain(chances), delays, strict=True)]
    best = max(rates)
    if best <= rates[0]:
        return 0, 0.0
    k = max(k for k, r in enumerate(rates) if r >= (1.0 - RATE_TOLERANCE) * best and r > rates[0])
    return k, (rates[k] - rates[0]) * step


def _finishing_times(chances: list[float], runs: list[float], step_times: list[float]) -> list[float]:
    """The expected time to write the request's last len(chances) + 1 tokens when this step drafts
    k of them, for each k, every later step drafting as well as it can (a step drafting k tokens
    takes ``step_times[k]`` and writes 1 + a of them, a being the accepted run)."""
    n = len(chances) + 1
    # accepted[k][a]: the chance that a draft of k tokens has exactly its first a accepted
    accepted = [[runs[a] * (1.0 - chances[a]) for a in range(k)] + [runs[k]] for k in range(n)]

    def after(k: int, left: list[float], need: int) -> float:  # a step of k drafts, then `left`
        return step_times[k] + sum(p * left[need - 1 - a] for a, p in enumerate(accepted[k]))

    best = [0.0]  # best[m]: the least expected time to write m more tokens
    for need in range(1, n):
        best.append(min(after(k, best, need) for k in range(need)))
    return [after(k, best, n) for k in range(n)]


@dataclass
class Choice:
    """A slot's drafting this step: which drafter, how many tokens, what was expected."""

    drafter: str
    length: int
    expected: float = 0.0  # expected accepted tokens
    value: float = 0.0  # tokens gained over plain decoding in the time of a step without drafts
    probe: bool = False  # a try of a drafter that stopped paying (its record must learn)
    confidence: list[float] | None = None  # the drafter's stated confidence per drafted token


class SpeculationPolicy:
    """The engine's speculation policy: its costs, every drafter's record, and the choice of
    drafter and length per slot and step (``--spec auto``, and the adaptive length of a fixed mode)."""

    PROBE_EVERY = 16  # steps between probes of a draft model that stopped paying (doubles per failure)
    RECHECK_EVERY = 4  # idle steps a declined drafter's choice stands unless an observation came
    MAX_PROBE_WAIT = 512
    # A new request starts with the probe backoff of the requests before it, up to this many
    # failures (a first probe after 64 steps): each probe of a draft model makes it catch up on
    # every token since it last drafted, so probing a draft that never pays afresh in every
    # request cost a short request ~10% (the trained pair's draft mode read 0.91x plain).
    INHERITED_PROBE_FAILURES = 2

    def __init__(self, *, hybrid: bool, rollback_costs: bool) -> None:
        self.costs = Costs()
        self.hybrid = hybrid  # drafted tokens of several slots make an extra ubatch
        self.rollback_costs = rollback_costs  # a rejection means restore + replay
        self.acceptance: dict[str, Acceptance] = {}
        self.calibrations: dict[str, Calibration] = {}  # what each drafter's confidence means
        self.failed_probes = 0  # probes in a row, over all slots and requests, that found nothing
        self.earlier = EarlierRequests()  # where a slot's record of rates starts

    def record(self, drafter: str) -> Acceptance:
        return self.acceptance.setdefault(drafter, Acceptance())

    def calibration(self, drafter: str) -> Calibration:
        return self.calibrations.setdefault(drafter, Calibration())

    def rate(self, n_generating: int) -> float:
        """Tokens per second the busy slots produce without drafts."""
        return n_generating / self.costs.pass_time(max(1, n_generating))

    def choose(self, slot: SlotRecord, drafter: str, max_len: int, n_generating: int, *,
               confidence: list[float] | None = None, draft_model: bool = False, finishing: bool = False) -> Choice:
        """The best length for ``drafter`` on this slot (0: not worth it); a stated
        ``confidence`` is read as what it has turned out to mean so far (its calibration).
        ``finishing``: ``max_len`` drafts and the step's own token would end the request."""
        if max_len <= 0 or not self.costs.known:
            return Choice(drafter, 0, 0.0)
        if confidence is None and slot.declined.get(drafter) == (max_len, n_generating, finishing) \
                and slot.idle_steps % self.RECHECK_EVERY:
            return Choice(drafter, 0, 0.0)  # on a tiny target the full choice is a tenth of a step
        stated = confidence[:max_len] if confidence is not None else None
        record = self.record(drafter)
        chances = self.earlier.chances(slot.accepted, slot.compared, max_len) if stated is None else None
        if chances is None:
            chances = slot.chances(max_len, record, stated, self.calibration(drafter))
        k, value = self._best_length(chances, n_generating, draft_model=draft_model,
                                     finishing=finishing and len(chances) == max_len)
        if confidence is None and k == 0:
            slot.declined[drafter] = (max_len, n_generating, finishing)
        else:
            slot.declined.pop(drafter, None)
        return Choice(drafter, k, expected_gain(chances)[k], value, confidence=stated[:k] if stated else None)

    def could_pay(self, max_len: int, n_generating: int, *, draft_model: bool) -> bool:
        """Whether drafts accepted as surely as any ever are would pay: a probe can at best
        show that acceptance is high, so where even that would not pay (a draft model nearly
        as slow as the target) probing is waste (on top of the draft model catching up on
        every token since it last drafted). False too while costs are unknown (best_length)."""
        return self._best_length([MAX_ACCEPTANCE] * max_len, n_generating, draft_model=draft_model)[0] > 0

    def _best_length(self, chances: list[float], n_generating: int, *, draft_model: bool,
                     finishing: bool = False) -> tuple[int, float]:
        """``best_length`` in this engine's step: its busy slots, its target and rollback."""
        return best_length(chances, self.costs, rate=self.rate(n_generating), base=max(1, n_generating),
                           draft_model=draft_model, own_pass=self.hybrid and n_generating > 1,
                           rollback=self.rollback_costs, finishing=finishing)

    def probe(self, slot: SlotRecord) -> bool:
        """Whether a slot that drafts nothing should try the draft model now (its worth can
        change within a request; without probes its record would never learn it)."""
        slot.idle_steps += 1
        failures = max(slot.failed_probes, min(self.failed_probes, self.INHERITED_PROBE_FAILURES))
        if slot.idle_steps >= min(self.PROBE_EVERY << failures, self.MAX_PROBE_WAIT):
            slot.idle_steps = 0
            return True
        return False

    def observe(self, slot: SlotRecord, choice: Choice, accepted: int) -> None:
        """One verification of ``choice.length`` drafted tokens of which ``accepted`` were accepted."""
        if choice.length == 0:
            return
        self.record(choice.drafter).update(choice.length, accepted)
        slot.declined.clear()
        if choice.confidence:
            self._learn_stated(slot, choice.drafter, choice.confidence[:choice.length], accepted)
        else:
            slot.update(choice.length, accepted)
        if choice.probe:
            # An accepted probe only feeds the record: at acceptance 0.3 a probe's first token
            # is accepted one time in three, which says nothing about whether drafting pays.
            # The backoff ends when the record makes the drafter chosen again and it is right.
            if not accepted:
                slot.failed_probes += 1
                self.failed_probes += 1
        elif accepted:
            slot.failed_probes = self.failed_probes = 0

    def finished(self, slot: SlotRecord) -> None:
        """A slot's request ended: what its drafts were worth is where the next slots start."""
        self.earlier.finished(slot.accepted, slot.compared)

    def unverified(self, slot: SlotRecord, drafter: str, confidence: list[float] | None, compared: int,
                   accepted: int) -> None:
        """Tokens of a draft nobody verified, checked as the target writes them: ``compared`` more
        of them are known, the first ``accepted`` matched (then one differed, if ``accepted <
        compared``). They count as a verification's would, token by token as they come: towards
        the confidence's calibration, or the slot's record (the drafter's per-position record
        learns from the whole draft once it is settled)."""
        if compared <= 0:
            return
        if confidence is not None:
            self._learn_stated(slot, drafter, confidence[:compared], accepted)
        else:
            slot.update(compared, accepted)
        slot.declined.pop(drafter, None)

    def _learn_stated(self, slot: SlotRecord, drafter: str, confidence: list[float], accepted: int) -> None:
        """Tokens drafted with these confidences, the first ``accepted`` right: the slot's record
        against what the calibration predicted for them, then the calibration itself."""
        calibration = self.calibration(drafter)
        slot.update_stated([calibration.chance(c) for c in confidence], accepted)
        calibration.update(confidence, accepted)

    def settled(self, drafter: str, offset: int, compared: int, accepted: int) -> None:
        """An unverified draft stating no confidence is settled from its position ``offset`` on:
        ``compared`` of its tokens were checked, the first ``accepted`` matched. The drafter's
        per-position record learns from it as from a verification."""
        if compared > 0:
            self.record(drafter).update(compared, accepted, offset=offset)
