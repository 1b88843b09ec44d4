"""The worker: continuous batching of every slot into one target decode per step.

Each step builds one target decode holding, for every generating slot, its last sampled
token followed by its draft, plus chunks of prompts still being prefilled, bounded by
n_batch. The target's sampler then verifies each draft position by position; rejected tails
are rolled back (rollback.py), and one more decode replays, for every slot that restored a
checkpoint, the accepted tokens it lost (they are never verified again). Only this thread
touches the native contexts.
"""

from __future__ import annotations

import heapq
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hyspec._native import Context, Model, Sampler
from hyspec.draft_policy import Choice, SlotRecord
from hyspec.handle import RequestHandle
from hyspec.output import OutputStream
from hyspec.planner import Demand, plan
from hyspec.prefix_cache import CHECKPOINT_EVERY, CHECKPOINT_TAIL, CHECKPOINT_TAIL_GAP, PrefixCache
from hyspec.ring import safe_rollbacks, ubatches
from hyspec.rollback import Checkpoint, RollbackMethod, SeqRollback
from hyspec.speculation import DraftRequest, Proposal, Speculator
from hyspec.types import (
    BatchShape,
    ErrorCode,
    FinishReason,
    RequestError,
    Result,
    SamplingParams,
    SpecMode,
    Stats,
    Trace,
)

log = logging.getLogger("hyspec.scheduler")


@dataclass
class Job:
    """A validated request, ready to run."""

    handle: RequestHandle
    prompt: list[int]
    sampling: SamplingParams
    sampler: Sampler
    output: OutputStream
    spec: SpecMode
    draft_min: int
    draft_max: int
    adaptive: bool = True  # draft length follows the acceptance rate (draft_policy.py)
    t_submit: float = field(default_factory=time.perf_counter)


@dataclass
class Slot:
    """A job running on one sequence of the target context."""

    seq: int
    job: Job
    history: list[int]  # prompt + output; history[n_mem:] is not yet in the target's memory
    n_mem: int = 0
    generating: bool = False  # the prompt is in and the first token sampled
    checkpoint: Checkpoint | None = None
    record: SlotRecord = field(default_factory=SlotRecord)  # this request's acceptance, for the policy
    stats: Stats = field(default_factory=Stats)
    # Recurrent state after the first n tokens, kept for the prefix cache (hybrid targets).
    checkpoints: dict[int, bytes] = field(default_factory=dict)
    ring_pending: bool = False  # a ring rollback waits for the next decode: the state is not readable
    t_prompt_done: float = 0.0
    trace: Trace | None = None  # recorded for hyspec.exactness (record_shapes)

    @property
    def feed(self) -> list[int]:
        return self.history[self.n_mem:]


@dataclass
class _Planned:
    slot: Slot
    tokens: list[int]  # fed tokens then draft
    n_feed: int
    draft: list[int]
    choice: Choice | None = None  # who drafted and what was expected
    first_output: int = 0  # index of the slot's first output in the decode


class _Stop:
    pass


class Scheduler:
    def __init__(self, *, target: Context, rollback: SeqRollback, speculator: Speculator,
                 n_slots: int, n_ctx_seq: int, n_batch: int, ring: int = 0,
                 record_shapes: bool = False, cache: PrefixCache | None = None) -> None:
        self.ctx = target
        self.model: Model = target.model
        self.rollback = rollback
        self.speculator = speculator
        self.costs = speculator.policy.costs  # what decoding, drafting and rolling back take here
        self.n_ctx_seq = n_ctx_seq
        self.n_batch = n_batch
        self.ring = ring  # recurrent-state snapshots per sequence (0: no ring); bounds a rollback
        # Recurrent memory: llama.cpp splits a decode into ubatches of equal tokens per sequence.
        self.equal_split = rollback.method is not RollbackMethod.SEQ_RM
        self.inbox: queue.SimpleQueue[Job | RequestHandle | _Stop] = queue.SimpleQueue()
        self.waiting: deque[Job] = deque()
        self.free_seqs: list[int] = list(range(n_slots))  # a heap: the lowest free id first
        self.slots: dict[int, Slot] = {}
        self.record_shapes = record_shapes
        self._turn = 0  # rotates which slot the planner serves first
        self._involved: list[Slot] | None = None  # the slots of the decode under way (None: all)
        self.cache = cache

    # -- commands, from any thread ---------------------------------------------------------

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    def cancel(self, handle: RequestHandle) -> None:
        self.inbox.put(handle)

    def stop(self) -> None:
        self.inbox.put(_Stop())

    @property
    def busy(self) -> int:
        """Requests queued or running (approximate from other threads)."""
        return len(self.waiting) + len(self.slots) + self.inbox.qsize()

    # -- the worker thread -----------------------------------------------------------------

    def run(self) -> None:
        while True:
            if not self._drain(block=not self.slots and not self.waiting):
                break
            self._admit()
            if self.slots:
                self._involved = None
                try:
                    self._step()
                except Exception as e:
                    # Only the requests of the failed decode (all of them when it failed elsewhere)
                    # end, with INTERNAL; the others go on. An error freeing them kills the worker.
                    log.exception("a decode step failed; failing the requests in it")
                    error = RequestError(ErrorCode.INTERNAL, f"decoding failed: {e}")
                    for slot in self._involved if self._involved is not None else list(self.slots.values()):
                        if self.slots.get(slot.seq) is slot:
                            self._fail(slot, error)
        for slot in list(self.slots.values()):
            self._finish(slot, FinishReason.CANCELLED)
        while self.waiting:
            self._end_waiting(self.waiting.popleft())

    def abort(self, error: RequestError) -> None:
        """The worker is gone (called on its thread as it ends): fail every request it holds."""
        handles = [slot.job.handle for slot in self.slots.values()] + [job.handle for job in self.waiting]
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                handles.append(item.handle)
        for handle in handles:
            handle.fail(error)

    def _drain(self, block: bool) -> bool:
        """Take every command; False when asked to stop."""
        while True:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(item, _Stop):
                return False
            if isinstance(item, Job):
                if item.handle.cancelled:
                    self._end_waiting(item)
                else:
                    self.waiting.append(item)
            else:
                self._cancel(item)

    def _cancel(self, handle: RequestHandle) -> None:
        for slot in self.slots.values():
            if slot.job.handle is handle:
                self._finish(slot, FinishReason.CANCELLED)
                return
        for job in self.waiting:
            if job.handle is handle:
                self.waiting.remove(job)
                self._end_waiting(job)
                return

    def _end_waiting(self, job: Job) -> None:
        job.output.finish()
        stats = Stats(prompt_tokens=len(job.prompt))
        job.handle.emit(Result(job.output.text, job.output.token_ids, FinishReason.CANCELLED, stats))

    def _admit(self) -> None:
        while self.waiting and self.free_seqs:
            job = self.waiting.popleft()
            seq = heapq.heappop(self.free_seqs)
            slot = Slot(seq=seq, job=job, history=list(job.prompt), trace=Trace() if self.record_shapes else None)
            slot.stats.prompt_tokens = len(job.prompt)
            slot.stats.accepted_by_position = [0] * job.draft_max
            if self.cache is not None:
                hit = self.cache.attach(seq, job.prompt)
                slot.n_mem = slot.stats.cached_tokens = hit.tokens
                if hit.checkpoint is not None:
                    slot.checkpoints[hit.tokens] = hit.checkpoint
                if slot.trace is not None and hit.shapes:
                    # The cached memory, in the batches of the requests that computed it (an
                    # engine that records shapes keeps them with every entry it stores).
                    slot.trace.prefill += hit.shapes
            self.slots[seq] = slot

    def _finish(self, slot: Slot, reason: FinishReason) -> None:
        job = slot.job
        job.output.finish()
        chunk = job.output.take_chunk()
        if chunk is not None:
            job.handle.emit(chunk)
        stats = slot.stats
        stats.completion_tokens = len(job.output.token_ids)
        # The decode rate: tokens after the first (which comes with the prompt) over the time from
        # the first to the last, as llama-server's predicted_per_second counts it.
        elapsed = time.perf_counter() - slot.t_prompt_done if slot.generating else 0.0
        decoded = max(0, stats.completion_tokens - 1)
        stats.tokens_per_second = decoded / elapsed if elapsed > 0 else 0.0
        trace = slot.trace
        if trace is not None:
            trace = Trace(trace.prefill, trace.tokens[:len(job.output.token_ids)])
        job.handle.emit(Result(job.output.text, job.output.token_ids, reason, stats, trace))
        if self.cache is not None:
            self._keep(slot)
        self._free(slot)

    def _fail(self, slot: Slot, error: RequestError) -> None:
        """End a request with an error instead of a Result (its decode failed)."""
        slot.job.handle.fail(error)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        # Free everything the request held before its sequence id is reused.
        self.rollback.clear(slot.seq)
        self.speculator.release(slot.seq, slot.record, slot.history)
        del self.slots[slot.seq]
        heapq.heappush(self.free_seqs, slot.seq)

    def _keep(self, slot: Slot) -> None:
        """Hand what the slot's memory holds to the prefix cache."""
        assert self.cache is not None
        if self.cache.recurrent and not slot.ring_pending and slot.n_mem not in slot.checkpoints:
            slot.checkpoints[slot.n_mem] = self.ctx.state_seq_get(slot.seq, partial=True)
        shapes = slot.trace.memory_chunks(len(slot.job.prompt), slot.n_mem) if slot.trace is not None else None
        self.cache.store(slot.seq, slot.history[:slot.n_mem], slot.checkpoints, shapes)

    def _checkpoint_prefill(self, slot: Slot) -> None:
        """A prompt chunk is in: keep the recurrent state here for the prefix cache."""
        if self.cache is not None and self.cache.recurrent and self.cache.budget > 0:
            slot.checkpoints[slot.n_mem] = self.ctx.state_seq_get(slot.seq, partial=True)

    def _chunk_limit(self, slot: Slot) -> int:
        """How much of a prompt may go in this step. With a prefix cache on a hybrid target, a
        chunk ends at every CHECKPOINT_EVERY-th position and CHECKPOINT_TAIL tokens before the
        prompt's end (if that is CHECKPOINT_TAIL_GAP past where this chunk starts), so that a
        checkpoint is there: a later prompt sharing only a prefix (a system prompt, the same
        prompt again) resumes near its end. Costs a weight pass each."""
        feed = len(slot.feed)
        if self.cache is None or not self.cache.recurrent or self.cache.budget <= 0:
            return feed
        end = slot.n_mem + feed
        boundary = (slot.n_mem // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
        if end - CHECKPOINT_TAIL >= slot.n_mem + CHECKPOINT_TAIL_GAP:
            boundary = min(boundary, end - CHECKPOINT_TAIL)
        return min(feed, boundary - slot.n_mem)

    # -- one step --------------------------------------------------------------------------

    def _step(self) -> None:
        for slot in list(self.slots.values()):
            if slot.n_mem + len(slot.feed) > self.n_ctx_seq:
                self._finish(slot, FinishReason.LENGTH)  # no room for the next token
        slots = {s.seq: s for s in self.slots.values()}
        proposals = self._drafts([s for s in slots.values() if s.generating])
        demands = [Demand(s.seq, len(s.feed) if s.generating else self._chunk_limit(s),
                          len(proposals[s.seq].tokens) if s.seq in proposals else 0, s.generating)
                   for s in slots.values()]
        # Equal ubatch splits (recurrent memory) cost a weight pass per distinct draft length:
        # drafts of one length keep a step at most two passes (slots without one have one token).
        grants = plan(demands, self.n_batch, start=self._turn, equal_drafts=self.equal_split)
        self._turn += 1
        steps: list[_Planned] = []
        for grant in grants:
            slot = slots[grant.seq]
            proposal = proposals.get(slot.seq)
            draft = proposal.tokens[:grant.draft] if proposal is not None else []
            if len(draft) < slot.job.draft_min:
                draft = []
            steps.append(_Planned(slot, slot.feed[:grant.feed] + draft, grant.feed, draft,
                                  proposal.choice if proposal is not None else None))
        if not steps:
            return
        if self.rollback.method is RollbackMethod.RING:
            # Drafted slots last: llama.cpp then verifies them in the final ubatch, where the
            # ring's rollback is exact (hyspec.ring); the others first, in sequence order.
            steps.sort(key=lambda p: (bool(p.draft), p.slot.seq))
        tokens, positions, seqs, wants = [], [], [], []
        n_outputs = 0
        for p in steps:
            n = len(p.tokens)
            p.first_output = n_outputs
            tokens += p.tokens
            positions += range(p.slot.n_mem, p.slot.n_mem + n)
            seqs += [p.slot.seq] * n
            if p.slot.generating:
                wants += [False] * (p.n_feed - 1) + [True] * (1 + len(p.draft))
            else:
                wants += [False] * (n - 1) + [p.n_feed == len(p.slot.feed)]
            n_outputs += wants[-n:].count(True)
        split = ubatches(seqs, self.n_batch, self.ring) if self.equal_split else None
        safe = safe_rollbacks(split, self.ring) if split is not None and self.ring else {}
        for p in steps:
            if p.draft:
                # A rejected draft is rolled back by the ring only where this decode's shape
                # makes that exact; anywhere else by restoring a checkpoint and replaying.
                unsafe = safe.get(p.slot.seq, 0) < len(p.draft)
                p.slot.checkpoint = self.rollback.checkpoint(p.slot.seq, p.slot.n_mem, p.slot.checkpoint,
                                                             ring_unsafe=unsafe)
        started = time.perf_counter()
        self._involved = [p.slot for p in steps]
        self.ctx.decode(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                        np.asarray(seqs, np.int32), np.asarray(wants, bool))
        for p in steps:
            p.slot.ring_pending = False
        if all(p.slot.generating for p in steps):
            sizes = [sum(n for _, n in u) for u in split] if split is not None else \
                [min(self.n_batch, len(tokens) - i) for i in range(0, len(tokens), self.n_batch)]
            self.costs.decoded(time.perf_counter() - started, sizes)
        argmax = self.ctx.argmax_all() if n_outputs else None

        total = len(tokens)
        for p in steps:
            slot = p.slot
            if slot.generating:
                self._verify(p, argmax, total)
            elif p.n_feed < len(slot.feed):
                self._record_chunk(slot, p.n_feed, total)
                slot.n_mem += p.n_feed  # a prompt chunk; more to come
                self._checkpoint_prefill(slot)
            else:
                self._record_chunk(slot, p.n_feed, total)
                slot.n_mem += p.n_feed
                self._checkpoint_prefill(slot)
                slot.generating = True
                slot.t_prompt_done = time.perf_counter()
                token = self._sample(slot, p.first_output, argmax)
                slot.stats.ttft_ms = (slot.t_prompt_done - slot.job.t_submit) * 1000.0
                self._emit(slot, [token], [BatchShape(len(p.tokens), len(p.tokens) - 1, total)])
        self._replay([p.slot for p in steps if p.slot.seq in self.slots])

    def _replay(self, slots: list[Slot]) -> None:
        """One decode, without logits, of the accepted tokens every rolled-back slot lost, so
        that its next step starts from a fresh checkpoint."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        for slot in slots:
            lost = slot.history[slot.n_mem:-1] if slot.generating else []
            tokens += lost
            positions += range(slot.n_mem, slot.n_mem + len(lost))
            seqs += [slot.seq] * len(lost)
            slot.n_mem += len(lost)
        if tokens:
            started = time.perf_counter()
            self._involved = [slot for slot in slots if slot.seq in seqs]
            self.ctx.decode(tokens, positions, seqs, [False] * len(tokens))
            self.costs.rolled_back(time.perf_counter() - started)

    def _drafts(self, generating: list[Slot]) -> dict[int, Proposal]:
        requests = []
        for slot in generating:
            job = slot.job
            if job.spec is SpecMode.OFF or job.draft_max <= 0:
                continue
            room = self.n_ctx_seq - slot.n_mem - len(slot.feed)
            left = job.output.remaining - 1  # the target always adds one token of its own
            max_len = min(room, left, self.ring or job.draft_max, job.draft_max)
            if max_len >= max(1, job.draft_min):
                requests.append(DraftRequest(slot.seq, slot.history, len(job.prompt), job.spec, max_len,
                                             job.draft_min, job.adaptive, slot.record, finishing=max_len == left))
        return self.speculator.propose(requests, len(generating)) if requests else {}

    def _sample(self, slot: Slot, output: int, argmax: np.ndarray | None) -> int:
        job = slot.job
        if job.sampling.greedy and not job.sampling.penalized and argmax is not None:
            return int(argmax[output])  # the greedy chain would pick the same (first) maximum
        return job.sampler.sample(self.ctx, output)

    def _verify(self, p: _Planned, argmax: np.ndarray | None, total: int) -> None:
        """Accept the longest draft prefix the target's own sampler reproduces, plus the
        target's next token; roll back the rest."""
        slot, draft = p.slot, p.draft
        emitted: list[int] = []
        for j in range(len(draft) + 1):
            token = self._sample(slot, p.first_output + j, argmax)
            emitted.append(token)
            if j == len(draft) or token != draft[j]:
                break
        accepted = len(emitted) - 1
        stats = slot.stats
        valid = slot.n_mem + p.n_feed + accepted  # memory entries that hold accepted tokens
        if p.choice is not None:
            self.speculator.verified(slot.record, p.choice, len(draft), accepted)
        if draft:
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.verify_steps += 1
            for i in range(accepted):
                stats.accepted_by_position[i] += 1
        if accepted < len(draft):
            stats.rollbacks += 1
            slot.ring_pending = self.rollback.method is RollbackMethod.RING and slot.checkpoint is None
            slot.n_mem = self.rollback.truncate(slot.seq, valid, slot.checkpoint)
            stats.replayed_tokens += valid - slot.n_mem
        else:
            slot.n_mem = valid
        shapes = [BatchShape(len(p.tokens), p.n_feed - 1 + j, total) for j in range(len(emitted))]
        self._emit(slot, emitted, shapes)

    @staticmethod
    def _record_chunk(slot: Slot, n: int, total: int) -> None:
        if slot.trace is not None:
            slot.trace.prefill.append(BatchShape(n, n - 1, total))

    def _emit(self, slot: Slot, tokens: list[int], shapes: list[BatchShape]) -> None:
        job = slot.job
        reason = None
        for token, shape in zip(tokens, shapes, strict=True):
            slot.history.append(token)
            if slot.trace is not None:
                slot.trace.tokens.append(shape)
            reason = job.output.push(token)
            if reason is not None:
                break
        if reason is not None:
            self._finish(slot, reason)
            return
        chunk = job.output.take_chunk()
        if chunk is not None:
            job.handle.emit(chunk)
