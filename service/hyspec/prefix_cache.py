"""Reusing the memory of earlier requests: a new request does not decode its cached prefix again.

When a request ends, the memory its sequence holds becomes a cache entry: its attention cells
pass to a cache sequence id (``memory_seq_cp`` shares cells in the unified KV buffer, no data
is copied) and, on a hybrid target, the partial (recurrent) states saved along the way stay in
host memory: at the end of each prompt chunk (chunks are cut so that one ends at every
CHECKPOINT_EVERY positions and CHECKPOINT_TAIL tokens before the end of the prompt), at the
end of the prompt and at the end of the generation. A new request then gets the longest
prefix of its prompt that an entry holds: the attention cells are shared again into its own
sequence, up to a position where a recurrent checkpoint exists on a hybrid target (recurrent
state cannot be trimmed, so it is restored from the nearest checkpoint at or below the match),
and only the rest of the prompt is prefilled. Chat turns hit the cache because turn k+1's
rendered prompt starts with turn k's prompt and answer.

Bounded: entries cost their tokens' KV bytes plus their checkpoints, within ``budget`` bytes
and a fixed number of cache sequence ids; the least recently used go first, and an entry is
dropped whenever a running request needs the cells (``make_room``), so the cache never blocks
a slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hyspec._native import Context, Model, max_parallel_sequences
from hyspec.gguf_header import read_keys

MIN_REUSE = 4  # fewer cached tokens than this are not worth the bookkeeping
# Hybrid targets: prompt chunks end at these positions so that a recurrent checkpoint is there
# (as llama-server checkpoints a few tokens before a prompt's end).
CHECKPOINT_EVERY = 256
CHECKPOINT_TAIL = 4


@dataclass
class Entry:
    seq: int  # the cache sequence id whose attention cells hold ``tokens``
    tokens: list[int]
    checkpoints: dict[int, bytes]  # recurrent state after the first n tokens (hybrid targets)
    nbytes: int
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def kv_bytes_per_token(model: Model) -> int:
    """Bytes of attention memory (F16 keys and values) one token takes, from the GGUF header."""
    arch = model.arch
    keys = {f"{arch}.{k}" for k in ("block_count", "embedding_length", "attention.head_count",
                                     "attention.head_count_kv", "attention.key_length", "attention.value_length")}
    meta = {k.split(".", 1)[1]: v for k, v in read_keys(model.path, keys).items()}
    n_layer = int(meta.get("block_count", model.n_layer))
    heads = int(meta.get("attention.head_count", 1) or 1)
    head_dim = int(meta.get("embedding_length", model.n_embd)) // heads
    kv = meta.get("attention.head_count_kv", heads)
    per_layer = kv if isinstance(kv, list) else [kv] * n_layer
    k_len = int(meta.get("attention.key_length", head_dim))
    v_len = int(meta.get("attention.value_length", head_dim))
    return sum(int(h) for h in per_layer) * (k_len + v_len) * 2


@dataclass(frozen=True)
class CacheSizing:
    """What a context needs for a prefix cache: KV cells on top of the slots' and sequence ids
    of its own (after the slots')."""

    budget: int  # bytes
    kv_bytes_per_token: int
    cells: int
    seqs: list[int]

    @classmethod
    def of(cls, model: Model, budget: int, ctx: int, slots: int) -> CacheSizing:
        per_token = kv_bytes_per_token(model)
        # At most twice the slots' cells: the buffer is allocated up front.
        cells = min(budget // max(1, per_token), 2 * ctx * slots) if budget > 0 else 0
        n_seqs = min(max(4, 2 * slots), max_parallel_sequences() - slots) if cells else 0
        return cls(budget, per_token, cells, list(range(slots, slots + n_seqs)))


class PrefixCache:
    def __init__(self, ctx: Context, sizing: CacheSizing, *, recurrent: bool) -> None:
        self.ctx = ctx
        self.free_seqs = list(sizing.seqs)
        self.budget = sizing.budget
        self.kv_bytes_per_token = sizing.kv_bytes_per_token
        self.recurrent = recurrent
        self.entries: list[Entry] = []
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def tokens(self) -> int:
        """KV cells the entries hold (cells shared with running slots counted again)."""
        return sum(len(e.tokens) for e in self.entries)

    @property
    def hit_rate(self) -> float:
        return self.stats.hits / self.stats.lookups if self.stats.lookups else 0.0

    def attach(self, seq: int, prompt: list[int]) -> tuple[int, bytes | None]:
        """Give empty sequence ``seq`` the longest cached prefix of ``prompt`` (at least one
        prompt token is left to decode, for its logits). Returns how many tokens it now holds
        and the recurrent checkpoint there (None on a miss or without recurrent state)."""
        self.stats.lookups += 1
        best, best_n = None, 0
        for entry in self.entries:
            match = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if self.recurrent:
                match = max((n for n in entry.checkpoints if n <= match), default=0)
            if match > best_n:
                best, best_n = entry, match
        if best is None or best_n < MIN_REUSE:
            return 0, None
        self.ctx.memory_seq_cp(best.seq, seq, 0, best_n)
        checkpoint = best.checkpoints.get(best_n) if self.recurrent else None
        if checkpoint is not None:
            # Attention cells were shared up to best_n; the recurrent part gets its state there.
            self.ctx.state_seq_set(seq, checkpoint, partial=True)
        best.last_used = time.monotonic()
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        return best_n, checkpoint

    def store(self, seq: int, tokens: list[int], checkpoints: dict[int, bytes]) -> None:
        """Keep what sequence ``seq`` holds (``tokens``, its memory position by position) as an
        entry; the caller then clears ``seq``. An entry that the new one extends is replaced."""
        if len(tokens) < MIN_REUSE or self.budget <= 0:
            return
        kept = {n: data for n, data in checkpoints.items() if n <= len(tokens)}
        for entry in list(self.entries):  # an entry this one extends is redundant: its checkpoints move over
            if len(entry.tokens) <= len(tokens) and tokens[:len(entry.tokens)] == entry.tokens:
                kept = {**entry.checkpoints, **kept}
                self._drop(entry)
        if self.recurrent and not kept:
            return  # no state to resume from: nothing reusable
        nbytes = len(tokens) * self.kv_bytes_per_token + sum(len(d) for d in kept.values())
        if nbytes > self.budget:
            return
        while self.entries and (not self.free_seqs or self.nbytes + nbytes > self.budget):
            self._drop(min(self.entries, key=lambda e: e.last_used))
        if not self.free_seqs:
            return
        cache_seq = self.free_seqs.pop()
        self.ctx.memory_seq_cp(seq, cache_seq, 0, len(tokens))
        self.entries.append(Entry(cache_seq, list(tokens), kept, nbytes))

    def make_room(self, cells: int) -> bool:
        """Drop least recently used entries until they hold at most ``cells`` cells fewer than now
        (a running request needs them); False if the cache had nothing left to give."""
        freed = 0
        while freed < cells and self.entries:
            entry = min(self.entries, key=lambda e: e.last_used)
            freed += len(entry.tokens)
            self._drop(entry)
        return freed > 0

    def clear(self) -> None:
        for entry in list(self.entries):
            self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        self.ctx.memory_seq_rm(entry.seq, -1, -1)
        self.entries.remove(entry)
        self.free_seqs.append(entry.seq)
