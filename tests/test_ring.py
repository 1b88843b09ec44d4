"""llama.cpp's recurrent-state snapshot ring on a bare hyspec._native context: the corruption
the scheduler must avoid (llama.cpp behaviour, documented) and hyspec.ring's rule for when a
ring rollback is exact, checked against the real library."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from hyspec import _native as N
from hyspec.ring import safe_rollbacks, ubatches

RING = 4
NOISE = 0.05  # multi-sequence batch-shape noise on the tiny F32 model is ~0.006


def _ring_ctx(model: N.Model, n_seq: int) -> N.Context:
    return N.Context(model, n_ctx=2048, n_batch=512, n_ubatch=512, n_seq_max=n_seq, n_threads=2, n_rs_seq=RING,
                     kv_unified=True)


def _error_after(model: N.Model, history: list[int], logits: np.ndarray) -> float:
    """How far ``logits`` (after ``history``) are from a fresh one-sequence context's."""
    ref = N.Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2)
    ref.decode(history, range(len(history)), [0] * len(history), [False] * (len(history) - 1) + [True])
    return float(np.abs(ref.logits(0) - logits).max())


class _Run:
    """Sequences on one ring context, with their token histories."""

    def __init__(self, model: N.Model, n_seq: int, rng: random.Random) -> None:
        self.ctx, self.rng = _ring_ctx(model, n_seq), rng
        self.history: dict[int, list[int]] = {s: [] for s in range(n_seq)}

    def decode(self, layout: list[tuple[int, int]]) -> list[int]:
        tokens, positions, seqs = [], [], []
        for seq, n in layout:
            for _ in range(n):
                token = self.rng.randrange(200, 5000)
                self.history[seq].append(token)
                tokens.append(token)
                positions.append(len(self.history[seq]) - 1)
                seqs.append(seq)
        self.ctx.decode(tokens, positions, seqs, [True] * len(tokens))
        return seqs

    def roll_back(self, seq: int, r: int) -> None:
        assert self.ctx.memory_seq_rm(seq, len(self.history[seq]) - r, -1)  # llama.cpp says it worked
        del self.history[seq][-r:]


def test_a_moved_cell_restores_another_sequences_snapshot(tiny_lfm2: Path) -> None:
    """The load test's reproduction: sequence 0's cell is not first, a verify of 5 tokens of
    sequence 0 shares a decode with one token of 1, 2 and 3; llama.cpp verifies 0 alone, then
    gathers {1, 2, 3}, moving 0's cell without its snapshots. Rolling 0 back then succeeds on
    paper and restores a wrong state. hyspec.ring calls that rollback unsafe; with the
    drafted sequence last the same rollback is exact."""
    model = N.Model(str(tiny_lfm2))
    errors = {}
    for name, layout in {"drafted first": [(0, 5), (1, 1), (2, 1), (3, 1)],
                         "drafted last": [(1, 1), (2, 1), (3, 1), (0, 5)]}.items():
        run = _Run(model, 4, random.Random(7))
        for seq in (1, 0, 2, 3):  # each alone: sequence 0 lands in cell 1
            run.decode([(seq, 12)])
        seqs = run.decode(layout)
        assert safe_rollbacks(ubatches(seqs, 512, RING), RING)[0] == (0 if name == "drafted first" else RING)
        run.roll_back(0, 3)
        run.decode([(s, 1) for s in range(4)])
        errors[name] = _error_after(model, run.history[0], run.ctx.logits(0))
    assert ubatches([0] * 5 + [1, 2, 3], 512, RING) == [[(0, 5)], [(1, 1), (2, 1), (3, 1)]]
    assert errors["drafted first"] > 1.0, errors  # llama.cpp's behaviour: a stale snapshot
    assert errors["drafted last"] < NOISE, errors


def test_whole_decode_and_late_rollbacks_are_unsafe(tiny_lfm2: Path) -> None:
    """Removing every token of the last decode, or rolling back after a later decode, also
    restores planes that were never written (llama.cpp #26695, #22746): the rule forbids both."""
    model = N.Model(str(tiny_lfm2))
    assert safe_rollbacks(ubatches([0, 0, 0], 512, RING), RING)[0] == 2  # never all 3 of them
    run = _Run(model, 1, random.Random(3))
    run.decode([(0, 8)])
    run.decode([(0, 3)])
    run.roll_back(0, 3)
    run.decode([(0, 1)])
    assert _error_after(model, run.history[0], run.ctx.logits(0)) > 1.0


def test_rollbacks_the_rule_allows_are_exact(tiny_lfm2: Path) -> None:
    """Random cell layouts and batch layouts; every rollback within ``safe_rollbacks`` matches a
    fresh context, and some outside it do not (the rule is needed, not just cautious)."""
    model = N.Model(str(tiny_lfm2))
    rng = random.Random(2026)
    worst_safe, n_safe, corrupted = 0.0, 0, 0
    for _ in range(24):
        n_seq = rng.choice([3, 4, 5])
        run = _Run(model, n_seq, rng)
        order = list(range(n_seq))
        rng.shuffle(order)
        for seq in order:
            run.decode([(seq, rng.randrange(3, 9))])
        mixed = [(s, rng.randrange(1, 4)) for s in range(n_seq)]
        rng.shuffle(mixed)
        run.decode(mixed)  # scrambles the cells
        k = rng.randrange(1, RING + 1)
        layout = [(s, k + 1 if rng.random() < 0.5 else 1) for s in range(n_seq)]
        rng.shuffle(layout)
        safe = safe_rollbacks(ubatches(run.decode(layout), 512, RING), RING)
        rolled = {s: rng.randrange(1, n) for s, n in layout if n > 1}
        for seq, r in rolled.items():
            run.roll_back(seq, r)
        run.decode([(s, 1) for s in range(n_seq)])
        for seq, r in rolled.items():
            error = _error_after(model, run.history[seq], run.ctx.logits(seq))
            if r <= safe[seq]:
                worst_safe, n_safe = max(worst_safe, error), n_safe + 1
            elif error > 1.0:
                corrupted += 1
    assert n_safe > 10 and worst_safe < NOISE, (n_safe, worst_safe)
    assert corrupted > 0, "some unsafe rollbacks are expected to corrupt"


def test_every_sequence_keeps_its_state_under_scheduler_shaped_churn(tiny_lfm2: Path) -> None:
    """The scheduler's use of the ring, with every sequence checked after every decode, not only
    the ones rolled back: requests come and go (a freed sequence may hold a pending ring
    rollback), prompts arrive in chunks, drafted sequences go last and roll back by the ring
    where ``safe_rollbacks`` allows it, by checkpoint and replay elsewhere."""
    model = N.Model(str(tiny_lfm2))
    n_batch, checked, by_ring, by_checkpoint, freed_pending, worst = 64, 0, 0, 0, 0, 0.0
    for seed in range(4):
        rng = random.Random(seed)
        n_seq = 4
        ctx = N.Context(model, n_ctx=2048, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq, n_threads=2,
                        n_rs_seq=RING, kv_unified=True)
        memory: dict[int, list[int]] = {}  # each live sequence's tokens in memory
        feed: dict[int, list[int]] = {}  # what it feeds next: the rest of its prompt, or one token
        pending: set[int] = set()
        for _ in range(30):
            for seq in list(memory):
                if rng.random() < 0.1 or len(memory[seq]) > 300:
                    freed_pending += seq in pending
                    ctx.memory_seq_rm(seq, -1, -1)
                    del memory[seq], feed[seq]
            for seq in set(range(n_seq)) - set(memory):
                if rng.random() < 0.5:
                    memory[seq], feed[seq] = [], [rng.randrange(200, 5000) for _ in range(rng.randrange(2, 90))]
            steps, room = [], n_batch
            for seq in sorted(memory, key=lambda _: rng.random()):
                draft = [rng.randrange(200, 5000) for _ in range(rng.randrange(1, RING + 1))] \
                    if len(feed[seq]) == 1 and rng.random() < 0.5 else []
                fed = feed[seq][:max(0, room - len(draft))]
                if fed:
                    steps.append((seq, fed, draft))
                    room -= len(fed) + len(draft)
            steps.sort(key=lambda p: (bool(p[2]), p[0]))  # drafted sequences last, as the scheduler does
            seqs = [seq for seq, fed, draft in steps for _ in fed + draft]
            safe = safe_rollbacks(ubatches(seqs, n_batch, RING), RING)
            saved = {seq: (len(memory[seq]), ctx.state_seq_get(seq, partial=True))
                     for seq, _, draft in steps if draft and safe[seq] < len(draft)}
            ctx.decode([t for _, fed, draft in steps for t in fed + draft],
                       [len(memory[s]) + k for s, fed, draft in steps for k in range(len(fed + draft))],
                       seqs, [True] * len(seqs))
            pending.clear()
            replay: list[tuple[int, list[int]]] = []
            first = 0
            for seq, fed, draft in steps:
                worst = max(worst, _error_after(model, memory[seq] + fed, ctx.logits(first + len(fed) - 1)))
                checked += 1
                first += len(fed) + len(draft)
                kept = len(memory[seq]) + len(fed) + rng.randrange(0, len(draft) + 1)
                memory[seq] += fed + draft
                feed[seq] = feed[seq][len(fed):] or [rng.randrange(200, 5000)]
                if kept < len(memory[seq]) and seq in saved:
                    length, data = saved[seq]
                    ctx.state_seq_set(seq, data, partial=True)
                    assert ctx.memory_seq_rm(seq, length, -1)
                    replay.append((seq, memory[seq][length:kept]))
                    del memory[seq][length:]
                    by_checkpoint += 1
                elif kept < len(memory[seq]):
                    assert ctx.memory_seq_rm(seq, kept, -1)
                    del memory[seq][kept:]
                    pending.add(seq)
                    by_ring += 1
            lost = [(seq, k, t) for seq, tokens in replay for k, t in enumerate(tokens)]
            if lost:
                ctx.decode([t for _, _, t in lost], [len(memory[s]) + k for s, k, _ in lost], [s for s, _, _ in lost],
                           [False] * len(lost))
                for seq, tokens in replay:
                    memory[seq] += tokens
    assert by_ring > 20 and by_checkpoint > 5 and freed_pending > 0, (by_ring, by_checkpoint, freed_pending)
    assert worst < NOISE, f"a sequence's logits moved by {worst:.3f} after {checked} checks"
