"""The exactness checker itself (hyspec.exactness.check): it accepts the plain run and rejects a
token the plain run would not have chosen, greedy and sampled, so that the tests built on it can
fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hyspec import _native as N
from hyspec.engine import Engine, EngineConfig
from hyspec.exactness import _cdf_bound, _draw_distance, _select, check
from hyspec.types import GenerationRequest, SamplingParams

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
