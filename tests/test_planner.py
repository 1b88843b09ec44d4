"""The step planner (hyspec.planner): fair shares of n_batch, without a model."""

from __future__ import annotations

from collections import Counter

import pytest
from hyspec.planner import Demand, Grant, plan


def total(grants: list[Grant]) -> int:
    return sum(g.feed + g.draft for g in grants)


def test_everything_fits_everyone_gets_what_they_asked() -> None:
    demands = [Demand(0, 1, 4), Demand(1, 1, 2), Demand(2, 30, generating=False)]
    assert plan(demands, 512) == [Grant(0, 1, 4), Grant(1, 1, 2), Grant(2, 30)]


def test_every_generating_slot_is_fed_before_any_draft() -> None:
    """Drafts that exceed n_batch must not starve higher sequence ids (the old bug)."""
    demands = [Demand(s, 1, 16) for s in range(8)]
    grants = plan(demands, 32)
    assert {g.seq for g in grants} == set(range(8))
    assert all(g.feed == 1 for g in grants)
    assert total(grants) == 32
    drafts = [g.draft for g in grants]
    assert max(drafts) - min(drafts) <= 1  # shared out evenly


def test_waiting_prompts_are_not_starved_by_drafts() -> None:
    demands = [Demand(s, 1, 64) for s in range(4)] + [Demand(9, 500, generating=False)]
    grants = {g.seq: g for g in plan(demands, 128)}
    assert grants[9].feed >= (128 - 4) // 2  # at least half of what the feeds leave
    assert total(list(grants.values())) == 128


def test_rotation_spreads_a_short_budget_over_steps() -> None:
    """With fewer tokens than generating slots, the starting slot rotates: over steps every
    slot moves equally often."""
    demands = [Demand(s, 1, 0) for s in range(6)]
    served: Counter[int] = Counter()
    for step in range(12):
        grants = plan(demands, 4, start=step)
        assert len(grants) == 4
        served.update(g.seq for g in grants)
    assert set(served.values()) == {8}


def test_rotation_shares_drafts_over_steps() -> None:
    demands = [Demand(s, 1, 8) for s in range(3)]
    drafted: Counter[int] = Counter()
    for step in range(3):
        for g in plan(demands, 3 + 4, start=step):
            drafted[g.seq] += g.draft
    assert set(drafted.values()) == {4}


def test_equal_drafts_for_hybrid_targets() -> None:
    demands = [Demand(0, 1, 6), Demand(1, 1, 3), Demand(2, 1, 0), Demand(3, 1, 5)]
    grants = plan(demands, 512, equal_drafts=True)
    assert {g.seq: g.draft for g in grants} == {0: 3, 1: 3, 2: 0, 3: 3}
    assert {g.seq: g.draft for g in plan(demands, 4 + 3, equal_drafts=True)} == {0: 1, 1: 1, 2: 0, 3: 1}
    short = plan(demands, 4 + 2, equal_drafts=True, start=1)  # room for two drafts of one token
    assert {g.seq: g.draft for g in short} == {0: 0, 1: 1, 2: 0, 3: 1}


def test_prompt_chunks_and_feeds_never_exceed_the_budget() -> None:
    for n_batch in (1, 2, 7, 64):
        demands = [Demand(0, 1, 5), Demand(1, 3, 0), Demand(2, 100, generating=False),
                   Demand(3, 40, generating=False)]
        grants = plan(demands, n_batch, start=n_batch)
        assert total(grants) <= n_batch
        # A generating slot's feed is never split: its output is its last token.
        assert all(g.feed == {0: 1, 1: 3}[g.seq] for g in grants if g.seq in (0, 1))


def test_bad_budget() -> None:
    with pytest.raises(ValueError):
        plan([Demand(0, 1)], 0)
