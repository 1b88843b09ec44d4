"""When llama.cpp's recurrent-state snapshot ring (``n_rs_seq``) rolls a sequence back exactly.

With a ring, ``memory_seq_rm(seq, end - r, -1)`` on hybrid memory restores the recurrent state
from a snapshot "plane" r steps back instead of failing. The planes live at the sequence's
recurrent cell, and llama.cpp moves cells between the ubatches of one decode: each ubatch
with several sequences gathers its members into neighbouring cells, swapping bystanders
away, and only a bystander's current state moves with it, not its snapshots. A sequence
moved after its last ubatch of the decode then restores another sequence's snapshot (seen:
logits off by 20-70). The ring is also relative to the last ubatch: removing a whole decode,
or rolling back after a later decode, restores planes that were never written.

So a rollback of sequence X by r tokens, issued right after decode D (before any other
decode, once), is exact when
  (A) 1 <= r <= min(n - 1, R), n being X's tokens in the last ubatch of D that holds X, and
  (B) every ubatch of D after that one holds a single sequence (a lone sequence moves nothing).
The ubatches follow from the batch alone: hybrid memory on a unified KV buffer splits it with
``split_equal(n_ubatch, sequential=false, n_keep_tail=R+1)`` (llama-batch.cpp), mirrored by
``ubatches`` below for the pinned llama.cpp. The scheduler asks ``safe_rollbacks`` before a
verify decode and takes a checkpoint (rollback by restore + replay) for any slot whose draft
could need a deeper rollback than is safe; tests/test_ring.py checks the model against the
real library and documents the corruption on a bare context.
"""

from __future__ import annotations

from collections.abc import Sequence


def ubatches(seq_ids: Sequence[int], n_ubatch: int, ring: int) -> list[list[tuple[int, int]]]:
    """The ubatches llama.cpp makes of a batch whose i-th token belongs to ``seq_ids[i]``:
    for each, (sequence, tokens) in ubatch order."""
    keep_tail = ring + 1 if ring > 0 else 0
    if keep_tail and n_ubatch <= keep_tail:
        raise ValueError(f"n_ubatch {n_ubatch} must exceed the ring size + 1 ({keep_tail})")
    tokens: dict[int, list[int]] = {}
    for i, seq in enumerate(seq_ids):
        tokens.setdefault(seq, []).append(i)
    used = [False] * len(seq_ids)
    plan: list[list[tuple[int, int]]] = []
    while True:
        members: list[int] = []  # the sequences of this ubatch, by their first unused token
        for i, seq in enumerate(seq_ids):
            if not used[i] and seq not in members:
                members.append(seq)
                if len(members) > n_ubatch:
                    break
        if not members:
            return plan
        nxt = {s: next(k for k, t in enumerate(tokens[s]) if not used[t]) for s in members}
        taken: dict[int, list[int]] = {s: [] for s in members}
        # Equal tokens of every member, while each has one more and n_ubatch is not reached.
        while all(nxt[s] < len(tokens[s]) for s in members):
            for s in members:
                t = tokens[s][nxt[s]]
                taken[s].append(t)
                used[t] = True
                nxt[s] += 1
            if (len(taken[members[0]]) + 1) * len(members) > n_ubatch:
                break
        if keep_tail:
            def remaining(s: int, nxt: dict[int, int] = nxt) -> int:
                return len(tokens[s]) - nxt[s]

            # Keep the members that finish here or leave at least keep_tail tokens for later.
            keep = 0
            while keep < len(members) and not 0 < remaining(members[keep]) < keep_tail:
                keep += 1
            if keep == 0:  # the first member alone: all of it if it fits, else leave keep_tail
                first = members[0]
                if len(taken[first]) + remaining(first) <= n_ubatch:
                    while remaining(first) > 0:
                        t = tokens[first][nxt[first]]
                        taken[first].append(t)
                        used[t] = True
                        nxt[first] += 1
                else:
                    while remaining(first) < keep_tail:
                        used[taken[first].pop()] = False
                        nxt[first] -= 1
                keep = 1
            for s in members[keep:]:
                for t in taken[s]:
                    used[t] = False
            members = members[:keep]
        plan.append([(s, len(taken[s])) for s in members])


def safe_rollbacks(plan: list[list[tuple[int, int]]], ring: int) -> dict[int, int]:
    """For each sequence of a decode split as ``plan`` (``ubatches``), the most tokens a
    rollback right after it may remove and stay exact (0: none)."""
    safe: dict[int, int] = {}
    for u, ubatch in enumerate(plan):
        later_alone = all(len(later) == 1 for later in plan[u + 1:])
        for seq, n in ubatch:
            safe[seq] = min(n - 1, ring) if later_alone else 0
    return safe
