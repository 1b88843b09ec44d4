"""Is an output what the plain run of the target would have produced? (REFERENCE section 5)

The plain run is one sequence on a fresh context: the prompt in n_batch chunks, then one token
per decode. ``check`` walks an output along it: at every position it decodes the output's
previous token and asks what the plain run would choose there, greedy (the first highest
logit) or sampled (llama.cpp's chain with the request's seed: the candidates in the chain's
order and the same uniform draw as llama.cpp's ``dist`` sampler). Where the output chose
otherwise, the difference is forgiven only at a true near-tie, and the walk then continues
with the output's token forced into the plain run, so every later position is checked too.

A near-tie: speculation and busy slots decode a position inside a batch, and llama.cpp's CPU
kernels give slightly different logits for batches of different shapes. At a difference,
``check`` recomputes the position with the batch shapes that produced it: from the engine's
record (``EngineConfig.record_shapes``: every prompt chunk, a prefix from the prefix cache in
the batches of the request that computed it, and every decode of the output, as segments of
their length inside batches of their size, so the noise those shapes left in the memory is
there too), or, without one, with each of a set of typical verify and multi-slot shapes. The
recorded shapes are also replayed with the sequence's memory cells spread among another
sequence's and starting anywhere in the buffer, as busy slots leave them (the order of the
attention sums follows the cells). The difference is a near-tie when one of those
recomputations, through the same chain and the same draw, chooses the output's token: batch
shapes and cell layout alone explain it. Failing that, it is one when twice the largest noise
those recomputations showed covers the margin (greedy) or the draw's distance (sampled); a token
the sampling chain cut (top-k, top-p, min-p) counts only if that noise reaches the cut's edge,
and is then judged where the chain would have walked it. Rollbacks, checkpoints and other slots
are not reproduced, so a wrong state is not explained. A difference within ``TIE_EPSILON``
logits (greedy) or ``CDF_EPSILON`` of the draw (sampled) is a tie whatever the shapes. Anything
else is a bug. The tests and ``hyspec bench`` share this code.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hyspec._native import Context, Model, Sampler
from hyspec.types import BatchShape, SamplingParams, Trace

TIE_EPSILON = 0.02  # logits: a greedy margin this small is a tie whatever the shapes
CDF_EPSILON = 1e-4  # probability: a draw this close to the boundary is a tie whatever the shapes
N_BATCH = 512
NOISE_MARGIN = 2.0  # the measured noise is a sample's maximum, not a bound
SCATTER_SEEDS = (1, 2, 3, 4, 5, 6)  # replays with the sequence's cells spread out, besides the contiguous one
SCATTER_START = 255  # a spread-out replay's first cell lies up to this many cells into the buffer
# Without a record: a verify of 2, 5 and 9 tokens with the position first or last, and the
# same inside busy steps.
TYPICAL_SHAPES: tuple[BatchShape, ...] = (
    BatchShape(2, 0, 2), BatchShape(2, 1, 2), BatchShape(5, 0, 5), BatchShape(5, 4, 5), BatchShape(9, 0, 9),
    BatchShape(9, 8, 9), BatchShape(1, 0, 4), BatchShape(5, 4, 8), BatchShape(9, 8, 36))


@dataclass(frozen=True)
class Tie:
    """A position where the output differs from the plain run."""

    index: int  # in the output
    plain: int  # the plain run's token
    got: int  # the output's token
    gap: float  # greedy: the plain run's logit margin; sampled: the draw's distance to the output token
    noise: float  # how far the recomputed shapes moved the two tokens' logits against each other
    explained: bool  # the recomputed shapes choose the output's token (or the gap is within epsilon)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a walk: ``ties`` forgiven, or the first ``mismatch`` that is not one."""

    checked: int
    sampled: bool = False
    ties: tuple[Tie, ...] = ()
    mismatch: Tie | None = None

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def describe(self) -> str:
        unit = "draw distance" if self.sampled else "margin"
        if self.mismatch is not None:
            m = self.mismatch
            return (f"DIFFERENT at token {m.index}: plain {m.plain}, got {m.got}, {unit} {m.gap:.5f}, batch-shape "
                    f"noise {m.noise:.5f} does not explain it ({len(self.ties)} near-tie(s) before it)")
        if not self.ties:
            return f"same ({self.checked} tokens)"
        where = ", ".join(f"{t.index} ({unit} {t.gap:.4f}, noise {t.noise:.4f})" for t in self.ties[:4])
        return f"same but {len(self.ties)} near-tie(s) forgiven at token {where}"


@lru_cache(maxsize=8)
def _model(path: str) -> Model:
    return Model(path)


def _draws(seed: int, n: int) -> list[float]:
    """The first ``n`` uniforms of llama.cpp's ``dist`` sampler seeded with ``seed``:
    ``std::uniform_real_distribution<double>(0, 1)`` over ``std::mt19937(seed)``, which
    libstdc++ makes from two 32-bit outputs (generate_canonical)."""
    state = [seed & 0xFFFFFFFF]
    for i in range(1, 624):  # std::mt19937's seeding (init_genrand)
        prev = state[-1]
        state.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    mt = random.Random()
    mt.setstate((3, (*state, 624), None))  # Python's Random is MT19937: the same outputs from here
    out = []
    for _ in range(n):
        total = float(mt.getrandbits(32)) + float(mt.getrandbits(32)) * 4294967296.0
        u = total / 18446744073709551616.0
        out.append(u if u < 1.0 else float(np.nextafter(1.0, 0.0)))
    return out


def _select(ids: np.ndarray, logits: np.ndarray, draw: float | None) -> int:
    """The index llama.cpp's final selector takes: greedy the first highest logit; dist the
    first candidate whose cumulative softmax (float32 terms summed in double) reaches the draw."""
    if draw is None:
        return int(np.argmax(logits))
    weights = np.exp((logits - logits.max()).astype(np.float32)).astype(np.float64)
    cumulative = np.cumsum(weights)
    return min(int(np.searchsorted(cumulative, cumulative[-1] * draw, side="left")), len(ids) - 1)


def _draw_distance(logits: np.ndarray, draw: float, index: int) -> float:
    """How far the draw lies from candidate ``index``'s interval of the cumulative distribution."""
    weights = np.exp((logits - logits.max()).astype(np.float64))
    cumulative = np.concatenate([[0.0], np.cumsum(weights) / weights.sum()])
    return max(cumulative[index] - draw, draw - cumulative[index + 1], 0.0)


def _walked_by_logit(logits: np.ndarray) -> bool:
    """Does the chain walk its candidates by logit (top-k and top-p sort them), not by token id?"""
    return bool(np.all(np.diff(logits) <= 0))


def _cdf_bound(logits: np.ndarray, plain: int, got: int, noise: float, edge_mass: float) -> float:
    """How far logit noise of ``noise`` (each candidate's logit moved by at most that much
    against the others) can move candidate ``got``'s interval of the cumulative distribution
    towards the draw in candidate ``plain``'s interval: the candidates before ``got`` pushed
    one way and the rest the other. Where the chain walks its candidates by logit (top-k sorts
    them), every candidate within ``2 * noise`` of ``got`` may also change places with it: on a
    flat distribution several near-equal candidates reorder at once, each moving the
    intervals by its whole probability (seen on the trained target: ``got`` three places
    after the plain token, all four within 0.01 logits). Plus ``edge_mass``, the probability
    of the tokens that the same noise can move into or out of the chain's cut (top-k, top-p,
    min-p)."""
    weights = np.exp((logits - logits.max()).astype(np.float64))
    weights /= weights.sum()
    order = np.arange(len(logits))
    others = order != got
    if _walked_by_logit(logits):  # near-equal candidates may swap
        always_before = others & (logits > logits[got] + 2 * noise)
        maybe_before = others & (logits >= logits[got] - 2 * noise)
    else:  # walked in a fixed order (token ids): only the weights move
        always_before = maybe_before = order < got
    cumulative = np.concatenate([[0.0], np.cumsum(weights)])
    if got > plain:  # the draw lies before got's interval: how early can that interval start?
        moved = weights * np.where(always_before, np.exp(-noise), np.exp(noise))
        reach = float(cumulative[got] - moved[always_before].sum() / moved.sum())
    else:  # the draw lies after it: how late can it end?
        upto = maybe_before | ~others
        moved = weights * np.where(upto, np.exp(noise), np.exp(-noise))
        reach = float(moved[upto].sum() / moved.sum() - cumulative[got + 1])
    return max(reach, 0.0) + edge_mass


def _chain_shift(raw: np.ndarray, ids: np.ndarray, logits: np.ndarray, temperature: float) -> float:
    """The chain's logit of a token is its raw logit / temperature + this."""
    return float(logits.max()) - float(raw[ids].max()) / temperature


def _edge_mass(raw: np.ndarray, ids: np.ndarray, logits: np.ndarray, noise: float, temperature: float) -> float:
    """The probability (in the chain's distribution) of the tokens within ``noise`` of the
    edge of the chain's cut, on either side: those the noise can add to or take from it."""
    if len(ids) == len(raw):
        return 0.0  # nothing cut
    edge = float(raw[ids].min())
    near = (raw >= edge - noise) & (raw <= edge + noise)
    total = np.exp((logits - logits.max()).astype(np.float64)).sum()
    return float(np.exp(raw[near] / temperature + _chain_shift(raw, ids, logits, temperature)
                        - logits.max()).sum() / total)


def _let_in(ids: np.ndarray, logits: np.ndarray, raw: np.ndarray, token: int,
            temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The chain's candidates with ``token``, which it cut, put back where it would walk it:
    by logit where the chain walks by logit (top-k and top-p sort), else by token id, at the
    chain logit its raw logit maps to."""
    value = np.float32(raw[token] / temperature + _chain_shift(raw, ids, logits, temperature))
    if _walked_by_logit(logits):
        at = int(np.count_nonzero(logits >= value))
    else:
        at = int(np.count_nonzero(ids < token))
    return np.insert(ids, at, token), np.insert(logits, at, value)


def _decode_chunks(ctx: Context, tokens: list[int], start: int) -> None:
    for at in range(0, len(tokens), N_BATCH):
        part = tokens[at:at + N_BATCH]
        ctx.decode(part, range(start + at, start + at + len(part)), [0] * len(part),
                   [False] * (len(part) - 1) + [True])


def _decode_padded(ctx: Context, tokens: list[int], start: int, total: int, want: int | None) -> None:
    """Decode ``tokens`` of sequence 0 from position ``start`` inside a batch of ``total``
    tokens, the rest filler of sequence 1 (removed again): the shape of a busy step."""
    others = max(0, total - len(tokens))
    filler = tokens[-1]
    ctx.decode(tokens + [filler] * others, list(range(start, start + len(tokens))) + list(range(others)),
               [0] * len(tokens) + [1] * others, [k == want for k in range(len(tokens))] + [False] * others)
    if others:
        ctx.memory_seq_rm(1, -1, -1)


def _shape_context(model: Model, n_tokens: int, widest: int, n_threads: int) -> Context:
    n_batch = max(N_BATCH, widest)
    return Context(model, n_ctx=max(256, 2 * n_tokens + widest + 16), n_batch=n_batch, n_ubatch=n_batch,
                   n_seq_max=3, n_threads=n_threads, kv_unified=True)


class _Scatter:
    """Spreads sequence 0's memory cells between those of a third sequence, as requests that
    come and go do in the engine's shared KV buffer: where the cells lie changes the order of
    llama.cpp's attention sums, and so the logits a little (0.04 logits seen on the tiny F32
    llama, 0.006 on the tiny LFM2). The first cell lies anywhere in the first SCATTER_START,
    as behind other slots' cells or a prefix restored from the cache: with the first cell near
    the start only, six layouts left a true near-tie of the tiny llama unexplained (their
    noise 0.021 against its 0.0225 margin; one layout in 120 reproduced the engine's token)."""

    def __init__(self, ctx: Context, seed: int | None) -> None:
        self.ctx, self.rng, self.active, self.n = ctx, random.Random(seed), seed is not None, 0
        if self.active:
            self._fill(self.rng.randint(0, SCATTER_START))

    def _fill(self, k: int) -> None:
        if k:
            self.ctx.decode([0] * k, range(self.n, self.n + k), [2] * k, [False] * k)
            self.n += k

    def __call__(self) -> None:
        if not self.active:
            return
        self._fill(self.rng.randint(0, 3))
        if self.n and self.rng.random() < 0.3:
            self.ctx.memory_seq_rm(2, -1, -1)
            self.n = 0


def _in_shape(model: Model, history: list[int], shape: BatchShape, n_threads: int) -> Context:
    """A context whose output 0 holds the logits after ``history`` with its last token decoded
    at offset ``shape.offset`` of a segment of ``shape.length`` inside a batch of ``shape.total``."""
    offset = min(shape.offset, len(history) - 1)
    start = len(history) - 1 - offset
    segment = history[start:] + [history[-1]] * (shape.length - offset - 1)
    ctx = _shape_context(model, len(history) + shape.length, max(shape.total, shape.length), n_threads)
    if start:
        _decode_chunks(ctx, history[:start], 0)
    _decode_padded(ctx, segment, start, max(shape.total, len(segment)), want=offset)
    return ctx


def _replayed(model: Model, prompt: list[int], output: list[int], trace: Trace, index: int,
              n_threads: int, scatter: int | None = None) -> Context:
    """A context whose output 0 holds the logits that chose ``output[index]``, recomputed
    with the recorded shapes: the prompt in its chunks, then each decode of the output as a
    segment of its length inside a batch of its size (the accepted tokens only; the rest
    filler). ``scatter``: a seed to spread the sequence's cells as busy slots do."""
    history = prompt + output
    widest = max(s.total for s in (*trace.prefill, *trace.tokens[:index + 1]))
    ctx = _shape_context(model, len(history) + SCATTER_START, widest, n_threads)
    spread = _Scatter(ctx, scatter)
    pos = 0
    for chunk in trace.prefill:
        spread()
        _decode_padded(ctx, prompt[pos:pos + chunk.length], pos, chunk.total, want=chunk.length - 1)
        pos += chunk.length
    for start, end, total, last in trace.decodes(len(prompt), index):
        spread()
        _decode_padded(ctx, history[start:end], start, total, want=end - start - 1 if last == index else None)
    return ctx


@dataclass
class _Judge:
    """Decides whether a difference is a near-tie."""

    model: Model
    prompt: list[int]
    output: list[int]
    trace: Trace | None
    sampler: Sampler | None
    temperature: float
    n_threads: int

    def _recomputed(self, index: int) -> Iterator[Context]:
        if self.trace is not None and len(self.trace.tokens) > index:
            for scatter in (None, *SCATTER_SEEDS):
                yield _replayed(self.model, self.prompt, self.output, self.trace, index, self.n_threads, scatter)
            return
        history = self.prompt + self.output[:index]
        for shape in TYPICAL_SHAPES:
            yield _in_shape(self.model, history, shape, self.n_threads)

    def _candidates(self, ctx: Context) -> tuple[np.ndarray, np.ndarray]:
        if self.sampler is None:
            logits = ctx.logits(0)
            return np.arange(len(logits), dtype=np.int32), logits
        return self.sampler.candidates(ctx, 0)

    def _chooses(self, ctx: Context, draw: float | None, token: int) -> bool:
        """Does the chain, with the same draw, pick ``token`` from ``ctx``'s logits?"""
        ids, logits = self._candidates(ctx)
        return int(ids[_select(ids, logits, draw)]) == token

    def __call__(self, walk: Context, index: int, plain: int, got: int, draw: float | None,
                 allow_ties: bool) -> Tie:
        kept, kept_logits = ids, logits = self._candidates(walk)
        raw = walk.logits(0)
        cut = got not in {int(t) for t in kept}
        if cut:
            # The chain cut the token (top-k/top-p/min-p) in the plain run. Judged as if the noise
            # had let it in, at the logit it has: the cut's edge is as flat as the tail it ends
            # (the trained target: a draw at 0.989 of a top-40 whose last three candidates lay
            # within 0.009 logits, and the engine took the 42nd).
            ids, logits = _let_in(ids, logits, raw, got, self.temperature)
        position = {int(t): k for k, t in enumerate(ids)}
        a, b = position[plain], position[got]
        gap = float(logits[a] - logits[b]) if draw is None else _draw_distance(logits, draw, b)
        if not allow_ties:
            return Tie(index, plain, got, float("inf") if cut else gap, 0.0, False)
        # Noise: how far the recomputations move the two tokens' logits against each other
        # (greedy), or the candidates that carry the probability against each other (sampled).
        watched = [plain, got] if draw is None else [int(t) for t, lg in zip(ids, logits, strict=True)
                                                     if lg >= logits.max() - 30.0]
        noise = 0.0
        for ctx in self._recomputed(index):
            delta = ctx.logits(0)[watched] - raw[watched]
            noise = max(noise, float(delta.max() - delta.min()))
            if self._chooses(ctx, draw, got):
                return Tie(index, plain, got, gap, noise, True)
        # The engine's own cell layout is one more draw of the noise the replays sampled: allow
        # twice their largest (a wrong state moves logits by whole units, not hundredths).
        noise *= NOISE_MARGIN
        if cut and raw[got] < float(raw[kept].min()) - noise:  # the noise cannot bring it in
            return Tie(index, plain, got, float("inf"), noise, False)
        if draw is None:
            return Tie(index, plain, got, gap, noise, gap <= max(TIE_EPSILON, noise))
        # The chain divides logits by the temperature (penalties only shrink them further).
        edge = _edge_mass(raw, kept, kept_logits, noise, self.temperature)
        bound = _cdf_bound(logits, a, b, noise / self.temperature, edge)
        return Tie(index, plain, got, gap, noise, gap <= max(CDF_EPSILON, bound))


def check(model_path: Path | str, prompt: list[int], output: list[int], *, sampling: SamplingParams | None = None,
          trace: Trace | None = None, allow_ties: bool = True, n_threads: int = 2) -> Verdict:
    """Walk ``output`` along the plain run of the target at ``model_path`` for ``prompt``.

    ``sampling``: the request's parameters (None or greedy without penalties: argmax); a
    sampled request needs its seed. ``trace``: the batch shapes the engine recorded (None:
    typical shapes are tried at a difference). ``allow_ties=False``: any difference fails
    (one slot on F32, where there is no noise)."""
    model = _model(str(model_path))
    params = sampling or SamplingParams()
    sampled = not params.greedy
    if sampled and params.seed is None:
        raise ValueError("a sampled output can only be checked with its seed")
    sampler = None
    if sampled or params.penalized:
        sampler = Sampler(model, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, repeat_penalty=params.repeat_penalty,
                          frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                          penalty_last_n=params.penalty_last_n, seed=params.seed or 0)
    draws = _draws(params.seed, len(output)) if sampled else []
    judge = _Judge(model, prompt, output, trace, sampler, params.temperature or 1.0, n_threads)
    walk = Context(model, n_ctx=max(256, len(prompt) + len(output) + 16), n_batch=N_BATCH, n_ubatch=N_BATCH,
                   n_threads=n_threads)
    _decode_chunks(walk, prompt, 0)
    ties: list[Tie] = []
    for i, got in enumerate(output):
        draw = draws[i] if sampled else None
        ids, logits = judge._candidates(walk)
        plain = int(ids[_select(ids, logits, draw)])
        if got != plain:
            tie = judge(walk, i, plain, got, draw, allow_ties)
            if not tie.explained:
                return Verdict(i, sampled, tuple(ties), tie)
            ties.append(tie)
        if sampler is not None:
            sampler.accept(got)
        walk.decode([got], [len(prompt) + i], [0], [True])
    return Verdict(len(output), sampled, tuple(ties))
