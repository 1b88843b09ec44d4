"""Reusing the memory of earlier requests: a new request does not decode its cached prefix again.

When a request ends, the memory its sequence holds becomes a cache entry, saved to host memory
(``state_seq_get``): its attention cells are freed, because llama.cpp attends over every used
cell of the KV buffer, whichever sequence holds it, so entries kept in cells would slow every
decode of every slot (a cached turn's prefill on LFM2-1.2B took ~5% longer with two other
conversations, 2,100 cells, cached). On a hybrid target the partial (recurrent) states saved
along the way are kept too: at the end of each prompt chunk (chunks are cut so that one ends at
every CHECKPOINT_EVERY positions and CHECKPOINT_TAIL tokens before the end of a prompt whose new
part is long enough), at the end of the prompt and at the end of the generation. A new request
then gets the longest prefix of its prompt that an entry holds: the entry is restored into a
scratch sequence and its cells up to the match are shared into the request's own (up to a
position where a recurrent checkpoint exists on a hybrid target: recurrent state cannot be
trimmed, so it is restored from the nearest checkpoint at or below the match), and only the rest
of the prompt is prefilled. Chat turns hit the cache because turn k+1's rendered prompt starts
with turn k's prompt and answer.

Bounded: entries cost their saved bytes plus their checkpoints, within ``budget`` bytes and
MAX_ENTRIES entries; the least recently used go first. Entries hold no KV cells between
requests, so the cache never takes a slot's room.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from hyspec._native import Context, Model, StateError, max_parallel_sequences
from hyspec.gguf_header import read_keys
from hyspec.types import BatchShape, prefix_chunks

MIN_REUSE = 4  # fewer cached tokens than this are not worth the bookkeeping
MAX_ENTRIES = 64  # a lookup compares the prompt with every entry
# Hybrid targets: prompt chunks end at these positions so that a recurrent checkpoint is there
# (as llama-server checkpoints a few tokens before a prompt's end).
CHECKPOINT_EVERY = 256
CHECKPOINT_TAIL = 4
# A tail checkpoint costs a weight pass of its own (~100 ms on LFM2-1.2B F16) on every prompt; it
# pays only when a later prompt resumes there instead of at the checkpoint the chunk started
# from, so it is cut only this far past that one (a chat turn's short new part gets none: the
# next turn resumes from the end of this turn's generation anyway).
CHECKPOINT_TAIL_GAP = 64


@dataclass
class Entry:
    tokens: list[int]
    memory: bytes  # the sequence's whole memory after ``tokens`` (state_seq_get, not partial)
    checkpoints: dict[int, bytes]  # recurrent state after the first n tokens (hybrid targets)
    nbytes: int
    shapes: list[BatchShape] | None = None  # the batches that computed the memory (Trace.memory_chunks)
    last_used: float = field(default_factory=time.monotonic)


class Hit(NamedTuple):
    """What ``attach`` gave a sequence: its first ``tokens`` prompt tokens, the recurrent
    checkpoint there, and the batches that computed them (where the entry recorded them)."""

    tokens: int
    checkpoint: bytes | None = None
    shapes: list[BatchShape] | None = None


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share. List comparisons run in C: the usual case (one
    extends the other) is one comparison, and a difference is found by halving, not by a Python
    loop over every token (a draft model's sync does this each step, over the whole history)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same]; the first difference is before `differs`
    while differs - same > 1:
        mid = (same + differs) // 2
        if a[same:mid] == b[same:mid]:
            same = mid
        else:
            differs = mid
    return same


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
    """What a context needs for a prefix cache: room for one restored entry on top of the slots'
    cells, and a scratch sequence id (after the slots') to restore it into."""

    budget: int  # bytes
    kv_bytes_per_token: int
    cells: int
    scratch_seq: int | None  # None: no cache

    @property
    def n_seqs(self) -> int:
        """Sequence ids the cache needs on top of the slots'."""
        return int(self.scratch_seq is not None)

    @classmethod
    def of(cls, model: Model, budget: int, ctx: int, slots: int) -> CacheSizing:
        per_token = kv_bytes_per_token(model)
        on = budget > 0 and max_parallel_sequences() > slots
        return cls(budget, per_token, ctx if on else 0, slots if on else None)


class PrefixCache:
    def __init__(self, ctx: Context, sizing: CacheSizing, *, recurrent: bool) -> None:
        assert sizing.scratch_seq is not None
        self.ctx = ctx
        self.scratch = sizing.scratch_seq
        self.budget = sizing.budget
        self.kv_bytes_per_token = sizing.kv_bytes_per_token
        self.recurrent = recurrent
        self.entries: list[Entry] = []
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def hit_rate(self) -> float:
        return self.stats.hits / self.stats.lookups if self.stats.lookups else 0.0

    def attach(self, seq: int, prompt: list[int]) -> Hit:
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
            return Hit(0)
        try:
            self.ctx.state_seq_set(self.scratch, best.memory, partial=False)
        except StateError:  # no contiguous room for it in the KV buffer now: a miss
            self.ctx.memory_seq_rm(self.scratch, -1, -1)
            return Hit(0)
        self.ctx.memory_seq_cp(self.scratch, seq, 0, best_n)  # shares the cells, copies no data
        self.ctx.memory_seq_rm(self.scratch, -1, -1)
        checkpoint = best.checkpoints.get(best_n) if self.recurrent else None
        if checkpoint is not None:
            # Attention cells were shared up to best_n; the recurrent part gets its state there.
            self.ctx.state_seq_set(seq, checkpoint, partial=True)
        best.last_used = time.monotonic()
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        return Hit(best_n, checkpoint, prefix_chunks(best.shapes, best_n) if best.shapes is not None else None)

    def store(self, seq: int, tokens: list[int], checkpoints: dict[int, bytes],
              shapes: list[BatchShape] | None = None) -> None:
        """Keep what sequence ``seq`` holds (``tokens``, its memory position by position) as an
        entry; the caller then clears ``seq``. An entry that the new one extends is replaced.
        ``shapes``: the batches that computed that memory, for hyspec.exactness."""
        if len(tokens) < MIN_REUSE or self.budget <= 0:
            return
        kept = {n: data for n, data in checkpoints.items() if n <= len(tokens)}
        for entry in list(self.entries):  # an entry this one extends is redundant: its checkpoints move over
            if len(entry.tokens) <= len(tokens) and tokens[:len(entry.tokens)] == entry.tokens:
                kept = {**entry.checkpoints, **kept}
                self._drop(entry)
        if self.recurrent and not kept:
            return  # no state to resume from: nothing reusable
        estimate = len(tokens) * self.kv_bytes_per_token + sum(len(d) for d in kept.values())
        if estimate > self.budget:
            return
        self.ctx.memory_seq_cp(seq, self.scratch, 0, len(tokens))
        try:
            memory = self.ctx.state_seq_get(self.scratch, partial=False)
        except StateError:  # not kept: a cache that cannot save an entry must not fail the request
            return
        finally:
            self.ctx.memory_seq_rm(self.scratch, -1, -1)
        nbytes = len(memory) + sum(len(d) for d in kept.values())
        while self.entries and (len(self.entries) >= MAX_ENTRIES or self.nbytes + nbytes > self.budget):
            self._drop(min(self.entries, key=lambda e: e.last_used))
        if nbytes <= self.budget:
            self.entries.append(Entry(list(tokens), memory, kept, nbytes, shapes))

    def clear(self) -> None:
        self.entries.clear()

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
