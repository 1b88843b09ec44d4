"""Which tokens go into a step's decode: a fair share of n_batch among the slots.

Every generating slot first gets its feed (the token it sampled last: without it the slot
cannot move at all), then the draft tokens share what is left, then prompts being prefilled
get the rest. Drafts are speculative: while a prompt waits they take at most half of what is
left after the feeds, so a long prompt still moves and a busy server still starts new
requests. Shares go round-robin from a starting slot that the scheduler rotates step by step,
so no sequence id is favoured when the budget is short. Pure: no model, no llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Demand:
    """What one slot would like to decode this step."""

    seq: int
    feed: int  # tokens not yet in memory: the last sampled one(s), or the rest of a prompt
    draft: int = 0  # draft tokens proposed (generating slots only)
    generating: bool = True


@dataclass(frozen=True)
class Grant:
    """What one slot decodes this step: the first ``feed`` tokens of its feed, then ``draft``
    draft tokens."""

    seq: int
    feed: int
    draft: int = 0


def _rotated(items: list[Demand], start: int) -> list[Demand]:
    if not items:
        return items
    k = start % len(items)
    return items[k:] + items[:k]


def plan(demands: list[Demand], n_batch: int, start: int = 0, equal_drafts: bool = False) -> list[Grant]:
    """Grants in sequence order (slots granted nothing are left out).

    ``start`` rotates who comes first when the budget is short. ``equal_drafts``: every
    granted draft has the same length (hybrid targets, whose batches llama.cpp splits into
    ubatches of equal tokens per sequence)."""
    if n_batch < 1:
        raise ValueError("n_batch must be at least 1")
    by_seq = sorted(demands, key=lambda d: d.seq)
    generating = [d for d in by_seq if d.generating]
    prompts = [d for d in by_seq if not d.generating and d.feed > 0]
    budget = n_batch
    feeds: dict[int, int] = {}
    for d in _rotated(generating, start):
        if d.feed <= budget:  # a generating slot's feed goes in whole: its output is its last token
            feeds[d.seq] = d.feed
            budget -= d.feed

    drafts = {d.seq: 0 for d in generating if d.seq in feeds}
    draft_budget = budget // 2 if prompts else budget
    wanting = [d for d in _rotated(generating, start) if d.seq in feeds and d.draft > 0]
    if equal_drafts and wanting:
        length = min(min(d.draft for d in wanting), draft_budget // len(wanting))
        # Too little room for a token each: one token to as many slots as fit, in rotation order.
        if length == 0:
            length = 1
            wanting = wanting[:draft_budget]
        for d in wanting:
            drafts[d.seq] = length
            draft_budget -= length
            budget -= length
    else:
        while wanting and draft_budget > 0:
            for d in list(wanting):
                if draft_budget == 0:
                    break
                drafts[d.seq] += 1
                draft_budget -= 1
                budget -= 1
                if drafts[d.seq] == d.draft:
                    wanting.remove(d)

    chunks: dict[int, int] = {}
    for d in _rotated(prompts, start):
        if budget <= 0:
            break
        chunks[d.seq] = min(d.feed, budget)
        budget -= chunks[d.seq]

    grants = [Grant(seq, feed, drafts.get(seq, 0)) for seq, feed in feeds.items()]
    grants += [Grant(seq, n) for seq, n in chunks.items()]
    return sorted(grants, key=lambda g: g.seq)
