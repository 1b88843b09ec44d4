"""Returning a sequence's memory to an earlier length after rejected draft tokens.

Attention memory keeps one entry per position, so dropping the rejected tail with
``memory_seq_rm`` is enough. Recurrent layers (LFM2's short convolutions, Mamba, Gated
DeltaNet) keep one rolling state per sequence, so a partial tail cannot be removed: the
seed's algorithm saves the recurrent part (``PARTIAL_ONLY``) before speculating, and on a
rejection restores it, trims the attention part with ``memory_seq_rm`` and replays the
accepted tokens. The replay is left to the caller.

Where the context keeps a ring of recurrent-state snapshots (llama.cpp's EXPERIMENTAL
``n_rs_seq``), ``memory_seq_rm`` of a tail of the last decode works on recurrent memory too,
and a rollback needs neither checkpoint nor replay, but only under conditions on the shape
of that decode (hyspec.ring); where they do not hold, the scheduler takes a checkpoint and
this module restores it as on a context without a ring.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hyspec._native import Context


class RollbackMethod(str, enum.Enum):
    SEQ_RM = "seq_rm"  # attention only: trim the tail
    CHECKPOINT = "checkpoint"  # recurrent state: restore a partial checkpoint, trim, replay
    RING = "ring"  # recurrent state with a snapshot ring: trim a bounded tail


def probe_rollback(ctx: Context) -> RollbackMethod:
    """Which method ``ctx`` needs, found the way llama.cpp's common_context_can_seq_rm does:
    a snapshot ring if it has one, else decode two tokens on sequence 0 and try to remove
    the second."""
    if ctx.n_rs_seq > 0:
        return RollbackMethod.RING
    ctx.memory_clear()
    try:
        ctx.decode([0, 0], [0, 1], [0, 0], [False, False])
        trimmed = ctx.memory_seq_rm(0, 1, -1)
    finally:
        ctx.memory_clear()
    return RollbackMethod.SEQ_RM if trimmed else RollbackMethod.CHECKPOINT


@dataclass(frozen=True)
class Checkpoint:
    """The partial (recurrent) state of a sequence holding its first ``n_tokens`` tokens."""

    n_tokens: int
    data: bytes


class SeqRollback:
    """Rollback for the sequences of one context."""

    def __init__(self, ctx: Context, method: RollbackMethod) -> None:
        self.ctx = ctx
        self.method = method

    def checkpoint(self, seq: int, n_tokens: int, current: Checkpoint | None, *,
                   ring_unsafe: bool = False) -> Checkpoint | None:
        """A checkpoint of ``seq`` at ``n_tokens`` (its current length) before speculating.

        Reuses ``current`` when it is already at that length (after a rollback the restored
        state is still the one saved). Needs none on attention memory, nor with a snapshot ring
        unless the decode's shape makes the ring's rollback unsafe (``ring_unsafe``)."""
        needed = self.method is RollbackMethod.CHECKPOINT or (self.method is RollbackMethod.RING and ring_unsafe)
        if not needed:
            return None
        if current is not None and current.n_tokens == n_tokens:
            return current
        return Checkpoint(n_tokens, self.ctx.state_seq_get(seq, partial=True))

    def truncate(self, seq: int, n_keep: int, checkpoint: Checkpoint | None) -> int:
        """Cut ``seq`` back to at most ``n_keep`` tokens; returns the length it now has.

        Tokens between the returned length and ``n_keep`` must be replayed by the caller. With
        a snapshot ring, a ``checkpoint`` given means the ring's rollback was unsafe: restore it."""
        if self.method is RollbackMethod.SEQ_RM or (self.method is RollbackMethod.RING and checkpoint is None):
            if not self.ctx.memory_seq_rm(seq, n_keep, -1):
                raise RuntimeError(f"memory_seq_rm refused to trim sequence {seq} at {n_keep}")
            return n_keep
        if checkpoint is None or checkpoint.n_tokens > n_keep:
            # Nothing to restore to: start the sequence over (correct, only slower).
            self.ctx.memory_seq_rm(seq, -1, -1)
            return 0
        self.ctx.state_seq_set(seq, checkpoint.data, partial=True)
        # After the restore the recurrent part holds nothing past the checkpoint, so trimming
        # the attention part succeeds.
        if not self.ctx.memory_seq_rm(seq, checkpoint.n_tokens, -1):
            raise RuntimeError(f"memory_seq_rm failed after restoring sequence {seq}")
        return checkpoint.n_tokens

    def clear(self, seq: int) -> None:
        """Forget a sequence entirely (removing a whole sequence never fails)."""
        self.ctx.memory_seq_rm(seq, -1, -1)
