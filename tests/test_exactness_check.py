"""The exactness checker itself (hyspec.exactness.check): it accepts the plain run and rejects a
token the plain run would not have chosen, greedy and sampled, so that the tests built on it can
fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hyspec import _native as N
from hyspec.engine import Engine, EngineConfig
from hyspec.exactness import _cdf_bound, _draw_distance, _select, check
from hyspec.types import BatchShape, GenerationRequest, SamplingParams, SpecMode, SpecParams, Trace

PROMPT = [1, 4021, 977, 15000, 301, 8812, 64, 20931]
SAMPLED = SamplingParams(temperature=1.0, top_k=5, seed=7)


def _plain(model: Path, sampling: SamplingParams) -> list[int]:
    with Engine(EngineConfig(model=model, threads=2, ctx=256)) as engine:
        result = engine.generate(GenerationRequest(token_ids=PROMPT, max_tokens=12, ignore_eos=True,
                                                   sampling=sampling))
    return result.token_ids


def _least_likely(model: Path, history: list[int]) -> int:
    """The token with the lowest logit after ``history``: far outside any near-tie or top-k."""
    ctx = N.Context(N.Model(str(model)), n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2)
    ctx.decode(np.asarray(history, np.int32), np.arange(len(history), dtype=np.int32),
               np.zeros(len(history), np.int32), np.asarray([False] * (len(history) - 1) + [True]))
    return int(np.argmin(ctx.logits(0)))


def test_the_plain_run_passes_and_a_wrong_greedy_token_does_not(tiny_lfm2: Path) -> None:
    plain = _plain(tiny_lfm2, SamplingParams())
    assert check(tiny_lfm2, PROMPT, plain, allow_ties=False).ok
    wrong = list(plain)
    wrong[5] = _least_likely(tiny_lfm2, PROMPT + plain[:5])
    verdict = check(tiny_lfm2, PROMPT, wrong)
    assert not verdict.ok and verdict.mismatch is not None and verdict.mismatch.index == 5, verdict.describe()
    assert verdict.mismatch.gap > 1.0 and "DIFFERENT at token 5" in verdict.describe()


def test_a_sampled_token_the_chain_cuts_is_rejected(tiny_lfm2: Path) -> None:
    plain = _plain(tiny_lfm2, SAMPLED)
    assert check(tiny_lfm2, PROMPT, plain, sampling=SAMPLED, allow_ties=False).ok
    wrong = list(plain)
    wrong[3] = _least_likely(tiny_lfm2, PROMPT + plain[:3])  # outside top-k 5: no draw reaches it
    verdict = check(tiny_lfm2, PROMPT, wrong, sampling=SAMPLED)
    assert not verdict.ok and verdict.mismatch is not None and verdict.mismatch.index == 3, verdict.describe()
    assert verdict.mismatch.gap == float("inf")


def test_near_equal_candidates_walked_by_logit_may_change_places() -> None:
    """Top-k walks its candidates by logit: candidates within the noise of each other may swap
    places, moving the intervals by their whole probability (the trained target's flat
    positions, where the draw landed three candidates away). A fixed order, or candidates
    further apart than the noise, does not allow it."""
    flat = np.array([3.0, 1.004, 1.003, 1.002, 1.001, 1.0], np.float32)
    weights = np.exp(flat - flat.max()) / np.exp(flat - flat.max()).sum()
    draw = float(weights[0] + 0.1 * weights[1])  # early in candidate 1's interval
    assert _select(np.arange(6), flat, draw) == 1
    distance = _draw_distance(flat, draw, 4)
    assert distance > 2 * weights[1]  # two whole candidates away: no weight change reaches it
    assert _cdf_bound(flat, 1, 4, 0.005, 0.0) >= distance  # within 2 x noise: 4 may come first
    assert _cdf_bound(flat, 1, 4, 0.001, 0.0) < distance  # 1.001 vs 1.004: too far for this noise
    by_id = flat[[0, 2, 1, 4, 3, 5]]  # the same candidates walked by token id: they cannot swap
    assert _cdf_bound(by_id, 1, 4, 0.005, 0.0) < _draw_distance(by_id, draw, 4)


# A sampled request of the trained-pair concurrency test (seed 2, request 7: `auto`, a prefix-cache
# hit), as the engine wrote it: its first token a near-tie of the draw, and its last one the
# 42nd candidate of a top-40 whose tail lay within 0.009 logits, taken by a draw at 0.989.
CUT_PROMPT = [1, 2861, 2292, 530, 2142, 2588, 1240, 3514, 1474, 3457, 2566, 1958, 183, 3184, 465, 1691, 3501, 660,
              3999, 552, 432, 2281, 3416, 3288, 815, 1862, 2792, 2375, 163, 111, 2233, 724, 2075, 2716, 1807, 3665,
              3993, 2429, 1173, 3246, 3495, 2810, 977, 1182, 341, 1686, 896, 3949, 1451, 1163, 1351, 399, 1430, 596,
              2400, 3261, 3597, 3402, 1637, 1520, 2426, 3662, 829, 2244, 1223, 2819, 3530, 765, 2584, 1667, 4032, 356,
              3952, 3431, 2185, 2259, 3401, 2853, 976]
CUT_OUTPUT = [203, 536, 462, 423, 263, 735, 273, 516, 339, 348, 1015, 31, 443, 263, 1035, 273, 391, 16, 443, 402,
              510, 299, 348, 291, 828, 30, 443, 970, 462, 781, 301, 402, 593, 299, 491]
CUT_SAMPLING = SamplingParams(temperature=1.0, top_k=40, seed=1143800664)


def test_a_token_just_past_the_cut_is_a_near_tie_only_where_the_draw_reaches_it(trained_target: Path) -> None:
    """The chain cut the engine's token, but the noise of other batch shapes moves a cut that
    flat: a near-tie where the draw lies at the end of the chain, a mismatch where it does not."""
    history = CUT_PROMPT + CUT_OUTPUT[:-1]
    ctx = N.Context(N.Model(str(trained_target)), n_ctx=256, n_batch=128, n_ubatch=128, n_seq_max=1, n_threads=2)
    ctx.decode(np.asarray(history, np.int32), np.arange(len(history), dtype=np.int32),
               np.zeros(len(history), np.int32), np.ones(len(history), bool))
    ranks = {j: list(np.argsort(-ctx.logits(len(CUT_PROMPT) - 1 + j), kind="stable")) for j in (24, 34)}
    assert ranks[34].index(CUT_OUTPUT[34]) >= 40  # outside the top 40
    verdict = check(trained_target, CUT_PROMPT, CUT_OUTPUT, sampling=CUT_SAMPLING)
    assert verdict.ok and [t.index for t in verdict.ties] == [0, 34], verdict.describe()
    # Position 24: its draw (0.40) lies mid-chain; the token just past the cut is still not chosen.
    wrong = CUT_OUTPUT[:24] + [int(ranks[24][40])]
    verdict = check(trained_target, CUT_PROMPT, wrong, sampling=CUT_SAMPLING)
    assert not verdict.ok and verdict.mismatch is not None and verdict.mismatch.index == 24, verdict.describe()
    assert 0.1 < verdict.mismatch.gap < 1.0


def test_a_requests_memory_is_described_in_the_batches_that_computed_it() -> None:
    """Trace.memory_chunks (what a prefix cache entry records): the prompt's chunks, then each
    decode's fed token and the drafts it accepted, in a batch of the decode's size; positions a
    later decode fed again (a replay) take its shape; the first n positions only."""
    s = BatchShape
    trace = Trace(prefill=[s(16, 15, 16), s(4, 3, 20)], tokens=[
        s(4, 3, 20),  # token 0: the prompt's last chunk chose it
        s(1, 0, 3),  # token 1: a plain step beside two other slots (fed position 20)
        s(5, 0, 9), s(5, 1, 9), s(5, 2, 9),  # tokens 2-4: a verify of 1 + 4 drafts, two accepted (21-23)
        s(1, 0, 1),  # token 5: fed position 24
        s(2, 1, 2),  # token 6: fed positions 24 and 25 again
    ])
    assert trace.memory_chunks(20, 26) == [s(16, 15, 16), s(4, 3, 20), s(1, 0, 3), s(3, 2, 9), s(2, 1, 2)]
    assert trace.memory_chunks(20, 22) == [s(16, 15, 16), s(4, 3, 20), s(1, 0, 3), s(1, 0, 9)]
    assert trace.memory_chunks(20, 10) == [s(10, 9, 16)]
    assert [(start, end, last) for start, end, _, last in trace.decodes(20, 6)] == \
        [(20, 21, 1), (21, 24, 4), (24, 25, 5), (24, 26, 6)]


def test_replays_in_recorded_batches_explain_float_noise_not_a_runner_up(tiny_llama: Path) -> None:
    """With a recorded trace the judge replays the engine's batches in many cell layouts; what
    those explain stays float noise: the plain run's runner-up, trailing by a tenth of a logit
    or more, is still a mismatch (the layouts' noise on this model is a few hundredths)."""
    with Engine(EngineConfig(model=tiny_llama, threads=2, ctx=256, record_shapes=True, draft_max=4)) as engine:
        result = engine.generate(GenerationRequest(token_ids=PROMPT * 3, max_tokens=24, ignore_eos=True,
                                                   spec=SpecParams(mode=SpecMode.NGRAM)))
    assert result.trace is not None and check(tiny_llama, PROMPT * 3, result.token_ids, trace=result.trace).ok
    history = PROMPT * 3 + result.token_ids
    ctx = N.Context(N.Model(str(tiny_llama)), n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2)
    ctx.decode(np.asarray(history, np.int32), np.arange(len(history), dtype=np.int32),
               np.zeros(len(history), np.int32), np.ones(len(history), bool))
    runner_up: dict[int, tuple[float, int]] = {}  # output index -> (margin, token)
    for j in range(1, len(result.token_ids)):
        logits = ctx.logits(len(PROMPT) * 3 + j - 1)
        first, second = np.argsort(logits)[::-1][:2]
        if int(first) == result.token_ids[j] and logits[first] - logits[second] >= 0.1:
            runner_up[j] = (float(logits[first] - logits[second]), int(second))
    j = min(runner_up, key=lambda k: runner_up[k][0])
    wrong = list(result.token_ids)
    wrong[j] = runner_up[j][1]
    verdict = check(tiny_llama, PROMPT * 3, wrong, trace=result.trace)
    assert not verdict.ok and verdict.mismatch is not None and verdict.mismatch.index == j, verdict.describe()
