"""A smaller model sharing the target's vocabulary drafts greedily, all slots batched.

The draft context mirrors the target's slots. Its memory must follow the target's accepted
tokens; when it holds rejected draft tokens they are rolled back with the same machinery as
the target (a recurrent draft needs checkpoints too, or it drifts and acceptance collapses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyspec._native import Context, Model
from hyspec.drafters import Draft, DraftItem
from hyspec.prefix_cache import CacheSizing, PrefixCache, common_prefix
from hyspec.rollback import Checkpoint, RollbackMethod, SeqRollback, probe_rollback


class VocabMismatchError(ValueError):
    """The draft model cannot draft for the target: different vocabularies."""


def check_same_vocab(target: Model, draft: Model) -> None:
    """Refuse a draft whose tokens would mean something else to the target."""
    if target.n_vocab != draft.n_vocab:
        raise VocabMismatchError(
            f"draft vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}: "
            "the draft must share the target's tokenizer"
        )
    step = max(1, target.n_vocab // 997)
    for token in range(0, target.n_vocab, step):
        if target.token_to_piece(token, special=True) != draft.token_to_piece(token, special=True):
            raise VocabMismatchError(f"draft and target disagree on token {token}: different tokenizers")


@dataclass
class _SeqState:
    tokens: list[int] = field(default_factory=list)  # what the draft memory holds
    checkpoint: Checkpoint | None = None


class DraftModelDrafter:
    def __init__(self, model: Model, *, n_slots: int, n_ctx_seq: int, n_batch: int, n_threads: int,
                 cache_budget: int = 0) -> None:
        sizing = CacheSizing.of(model, cache_budget, n_ctx_seq, n_slots)
        self.ctx = Context(
            model, n_ctx=n_ctx_seq * n_slots + sizing.cells, n_batch=n_batch, n_ubatch=n_batch,
            n_seq_max=n_slots + sizing.n_seqs, n_threads=n_threads, kv_unified=True,
        )
        self.n_batch = n_batch
        self.rollback = SeqRollback(self.ctx, probe_rollback(self.ctx))
        self._seqs: dict[int, _SeqState] = {}
        # The draft's memory of earlier requests, as the target's (prefix_cache.py): a new turn of
        # a conversation does not make the draft read the whole history again.
        recurrent = self.rollback.method is not RollbackMethod.SEQ_RM
        self.cache = PrefixCache(self.ctx, sizing, recurrent=recurrent) if sizing.scratch_seq is not None else None

    def close(self) -> None:
        """Free the draft context's memory (its engine has stopped)."""
        if self.cache is not None:
            self.cache.clear()
        self.ctx.close()

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        drafts: dict[int, list[int]] = {item.seq: [] for item in items}
        active = [item for item in items if item.max_len > 0]
        if active:
            # 1. Bring each draft sequence to the item's history and draft its first token.
            first = self._decode_last({item.seq: self._sync(item) for item in active})
            for item in active:
                drafts[item.seq].append(first[item.seq])
                state = self._seqs[item.seq]
                state.tokens = list(item.history)
                if item.max_len > 1:
                    # The memory holds exactly the accepted history: the best state to return to.
                    state.checkpoint = self.rollback.checkpoint(item.seq, len(state.tokens), state.checkpoint)
            # 2. One token per slot and step, greedily, until each slot has max_len.
            for step in range(1, max(item.max_len for item in active)):
                going = {item.seq: [drafts[item.seq][-1]] for item in active if item.max_len > step}
                nxt = self._decode_last(going)
                for seq, token in nxt.items():
                    self._seqs[seq].tokens.append(drafts[seq][-1])
                    drafts[seq].append(token)
        return [Draft(drafts[item.seq]) for item in items]

    def _sync(self, item: DraftItem) -> list[int]:
        """Roll the draft memory back to the longest prefix it shares with the history and
        return the history tokens it still has to decode (at least the last one)."""
        if item.seq not in self._seqs and self.cache is not None:
            hit = self.cache.attach(item.seq, item.history)
            checkpoint = Checkpoint(hit.tokens, hit.checkpoint) if hit.checkpoint is not None else None
            self._seqs[item.seq] = _SeqState(list(item.history[:hit.tokens]), checkpoint)
        state = self._seqs.setdefault(item.seq, _SeqState())
        keep = common_prefix(state.tokens, item.history[:-1])
        if keep < len(state.tokens):
            kept = self.rollback.truncate(item.seq, keep, state.checkpoint)
            state.tokens = state.tokens[:kept]
        return item.history[len(state.tokens):]

    def _decode_last(self, feeds: dict[int, list[int]]) -> dict[int, int]:
        """Decode every sequence's feed (long ones in n_batch chunks, all sequences batched)
        and return each sequence's argmax after its feed's last token."""
        result: dict[int, int] = {}
        queue = {seq: list(toks) for seq, toks in feeds.items()}
        while queue:
            tokens: list[int] = []
            positions: list[int] = []
            seqs: list[int] = []
            wants: list[bool] = []
            finishing: list[int] = []
            budget = self.n_batch
            for seq, toks in list(queue.items()):
                if budget <= 0:
                    break
                take = toks[:budget]
                start = self.ctx.memory_seq_pos_max(seq) + 1
                done = len(take) == len(toks)
                tokens += take
                positions += range(start, start + len(take))
                seqs += [seq] * len(take)
                wants += [False] * (len(take) - 1) + [done]
                if done:
                    finishing.append(seq)
                    del queue[seq]
                else:
                    queue[seq] = toks[len(take):]
                budget -= len(take)
            self.ctx.decode(tokens, positions, seqs, wants)
            best = self.ctx.argmax_all()
            for k, seq in enumerate(finishing):
                result[seq] = int(best[k])
        return result

    def release(self, seq: int, history: list[int] | None = None) -> None:
        state = self._seqs.pop(seq, None)
        if state is not None and self.cache is not None and state.tokens:
            n = len(state.tokens)
            checkpoints = {n: self.ctx.state_seq_get(seq, partial=True)} if self.cache.recurrent else {}
            self.cache.store(seq, state.tokens, checkpoints)
        self.rollback.clear(seq)
