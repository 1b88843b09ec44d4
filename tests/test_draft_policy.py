"""The adaptive draft length (draft_policy.py)."""

from hyspec.draft_policy import DraftPolicy, StepCosts


def test_ramps_up_to_full_drafts_while_accepted() -> None:
    policy = DraftPolicy(8)
    lengths = []
    for _ in range(10):
        k = policy.length()
        lengths.append(k)
        policy.update(k, k)
    assert 0 < lengths[0] < 8 and lengths[-1] == 8 and lengths == sorted(lengths)


def test_rejections_pause_drafting_and_probes_back_off() -> None:
    policy = DraftPolicy(8)
    lengths = []
    for _ in range(600):
        k = policy.length()
        lengths.append(k)
        policy.update(k, 0)
    probes = [i for i, k in enumerate(lengths) if k and i > 5]
    assert all(lengths[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:4] == [16, 32, 64, 128] and set(gaps[4:]) == {128}  # each failed probe waits longer


def test_recovers_when_drafts_are_accepted_again() -> None:
    policy = DraftPolicy(8)
    for _ in range(10):
        policy.update(max(policy.length(), 1), 0)
    for _ in range(12):
        k = max(policy.length(), 1)
        policy.update(k, k)
    assert policy.length() == 8


def test_fixed_length_when_not_adaptive() -> None:
    policy = DraftPolicy(5, adaptive=False)
    for _ in range(10):
        policy.update(5, 0)
    assert policy.length() == 5


def _at_acceptance(costs: StepCosts, alpha: float) -> int:
    policy = DraftPolicy(8, costs=costs)
    for _ in range(40):
        policy.update(10, round(10 * alpha))  # a rejection after about alpha of the tokens...
    policy._accepted, policy._drafted = alpha, 1.0  # ...and exactly alpha, to be precise
    return policy.length()


def test_known_costs_decide_whether_drafting_pays() -> None:
    cheap = StepCosts()
    cheap.decoded(0.100, 0)  # a decode is one pass over the weights: extra tokens are nearly free
    cheap.decoded(0.104, 8)
    assert cheap.known and abs(cheap.per_token - 0.0005) < 1e-9
    assert _at_acceptance(cheap, 0.6) >= 2

    expensive = StepCosts()
    expensive.decoded(0.100, 0)
    expensive.decoded(0.104, 8)
    expensive.drafted(0.070, 1)  # a draft model almost as slow as the target
    expensive.replayed(0.100)
    assert _at_acceptance(expensive, 0.6) == 0
    assert _at_acceptance(expensive, 0.97) > 0  # a draft that is nearly always right still pays
