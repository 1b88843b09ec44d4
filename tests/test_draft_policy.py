"""The adaptive draft length."""

from hyspec.draft_policy import DraftPolicy


def test_full_drafts_while_accepted() -> None:
    policy = DraftPolicy(8)
    for _ in range(20):
        assert policy.length() == 8
        policy.update(8, 8)


def test_rejections_shorten_then_pause_drafting_with_probes() -> None:
    policy = DraftPolicy(8)
    lengths = []
    for _ in range(40):
        k = policy.length()
        lengths.append(k)
        policy.update(k, 0)
    assert lengths[0] == 8 and lengths[1] < 8
    assert 0 in lengths[5:] and lengths[-16:].count(1) >= 1  # paused, but still probing
    assert sum(lengths[10:]) <= 30 // 8 + 1


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
