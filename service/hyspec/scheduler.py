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
from hyspec.draft_policy import DraftPolicy, StepCosts
from hyspec.drafters import Drafter, DraftItem
from hyspec.handle import RequestHandle
from hyspec.output import OutputStream
from hyspec.rollback import Checkpoint, RollbackMethod, SeqRollback
from hyspec.types import FinishReason, Result, SamplingParams, SpecMode, Stats

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
    policy: DraftPolicy = field(default_factory=lambda: DraftPolicy(0))
    stats: Stats = field(default_factory=Stats)
    t_prompt_done: float = 0.0

    @property
    def feed(self) -> list[int]:
        return self.history[self.n_mem:]


@dataclass
class _Planned:
    slot: Slot
    tokens: list[int]  # fed tokens then draft
    n_feed: int
    draft: list[int]
    first_output: int  # index of the slot's first output in the decode


class _Stop:
    pass


class Scheduler:
    def __init__(self, *, target: Context, rollback: SeqRollback, drafters: dict[SpecMode, Drafter],
                 n_slots: int, n_ctx_seq: int, n_batch: int, max_rollback: int | None = None) -> None:
        self.ctx = target
        self.model: Model = target.model
        self.rollback = rollback
        self.drafters = drafters
        self.n_ctx_seq = n_ctx_seq
        self.n_batch = n_batch
        self.max_rollback = max_rollback  # a snapshot ring bounds how many tokens can be dropped
        self.costs = StepCosts()  # what decoding, drafting and replaying take here
        self.inbox: queue.SimpleQueue[Job | RequestHandle | _Stop] = queue.SimpleQueue()
        self.waiting: deque[Job] = deque()
        self.free_seqs: list[int] = list(range(n_slots))  # a heap: the lowest free id first
        self.slots: dict[int, Slot] = {}

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
                try:
                    self._step()
                except Exception:
                    log.exception("decode step failed; failing the running requests")
                    for slot in list(self.slots.values()):
                        self._finish(slot, FinishReason.CANCELLED)
        for slot in list(self.slots.values()):
            self._finish(slot, FinishReason.CANCELLED)
        while self.waiting:
            self._end_waiting(self.waiting.popleft())

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
            policy = DraftPolicy(job.draft_max, job.adaptive, costs=self.costs)
            slot = Slot(seq=seq, job=job, history=list(job.prompt), policy=policy)
            slot.stats.prompt_tokens = len(job.prompt)
            slot.stats.accepted_by_position = [0] * job.draft_max
            self.slots[seq] = slot

    def _finish(self, slot: Slot, reason: FinishReason) -> None:
        job = slot.job
        job.output.finish()
        chunk = job.output.take_chunk()
        if chunk is not None:
            job.handle.emit(chunk)
        stats = slot.stats
        stats.completion_tokens = len(job.output.token_ids)
        elapsed = time.perf_counter() - slot.t_prompt_done if slot.generating else 0.0
        stats.tokens_per_second = stats.completion_tokens / elapsed if elapsed > 0 else 0.0
        job.handle.emit(Result(job.output.text, job.output.token_ids, reason, stats))
        # Free everything the request held before its sequence id is reused.
        self.rollback.clear(slot.seq)
        for drafter in self.drafters.values():
            drafter.release(slot.seq)
        del self.slots[slot.seq]
        heapq.heappush(self.free_seqs, slot.seq)

    # -- one step --------------------------------------------------------------------------

    def _step(self) -> None:
        for slot in list(self.slots.values()):
            if slot.n_mem + len(slot.feed) > self.n_ctx_seq:
                self._finish(slot, FinishReason.LENGTH)  # no room for the next token
        # In sequence order: llama.cpp keeps consecutive ascending sequences in one ubatch.
        slots = sorted(self.slots.values(), key=lambda s: s.seq)
        generating = [s for s in slots if s.generating]
        prefilling = [s for s in slots if not s.generating]
        drafts = self._drafts(generating)

        plan: list[_Planned] = []
        budget = self.n_batch
        n_outputs = 0
        for slot in generating + prefilling:
            feed = slot.feed
            if budget <= 0 or (slot.generating and len(feed) > budget):
                continue
            if slot.generating:
                draft = drafts.get(slot.seq, [])[: budget - len(feed)]
                if len(draft) < slot.job.draft_min:
                    draft = []
                tokens = feed + draft
                outputs = 1 + len(draft)
            else:
                tokens = feed[:budget]
                draft = []
                outputs = 1 if len(tokens) == len(feed) else 0
            if draft:
                slot.checkpoint = self.rollback.checkpoint(slot.seq, slot.n_mem, slot.checkpoint)
            plan.append(_Planned(slot, tokens, min(len(feed), len(tokens)), draft, n_outputs))
            n_outputs += outputs
            budget -= len(tokens)
        if not plan:
            return

        tokens, positions, seqs, wants = [], [], [], []
        for p in plan:
            n = len(p.tokens)
            tokens += p.tokens
            positions += range(p.slot.n_mem, p.slot.n_mem + n)
            seqs += [p.slot.seq] * n
            if p.slot.generating:
                wants += [False] * (p.n_feed - 1) + [True] * (1 + len(p.draft))
            else:
                wants += [False] * (n - 1) + [p.n_feed == len(p.slot.feed)]
        started = time.perf_counter()
        self.ctx.decode(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                        np.asarray(seqs, np.int32), np.asarray(wants, bool))
        if not prefilling:
            self.costs.decoded(time.perf_counter() - started, sum(len(p.draft) for p in plan))
        argmax = self.ctx.argmax_all() if n_outputs else None

        for p in plan:
            slot = p.slot
            if slot.generating:
                self._verify(p, argmax)
            elif p.n_feed < len(slot.feed):
                slot.n_mem += p.n_feed  # a prompt chunk; more to come
            else:
                slot.n_mem += p.n_feed
                slot.generating = True
                slot.t_prompt_done = time.perf_counter()
                token = self._sample(slot, p.first_output, argmax)
                slot.stats.ttft_ms = (slot.t_prompt_done - slot.job.t_submit) * 1000.0
                self._emit(slot, [token])
        self._replay([p.slot for p in plan if p.slot.seq in self.slots])

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
            self.ctx.decode(tokens, positions, seqs, [False] * len(tokens))
            self.costs.replayed(time.perf_counter() - started)

    def _drafts(self, generating: list[Slot]) -> dict[int, list[int]]:
        by_drafter: dict[SpecMode, list[DraftItem]] = {}
        for slot in generating:
            job = slot.job
            if job.spec is SpecMode.OFF or job.draft_max <= 0:
                continue
            room = self.n_ctx_seq - slot.n_mem - len(slot.feed)
            left = job.output.remaining - 1  # the target always adds one token of its own
            max_len = min(slot.policy.length(), room, left, self.max_rollback or job.draft_max)
            if max_len >= max(1, job.draft_min):
                by_drafter.setdefault(job.spec, []).append(DraftItem(slot.seq, slot.history, max_len))
        drafts: dict[int, list[int]] = {}
        for mode, items in by_drafter.items():
            started = time.perf_counter()
            proposed = self.drafters[mode].propose(items)
            self.costs.drafted(time.perf_counter() - started, sum(len(d) for d in proposed))
            for item, draft in zip(items, proposed, strict=True):
                drafts[item.seq] = draft
        if self.rollback.method is not RollbackMethod.SEQ_RM and len(generating) > 1:
            # Recurrent memory makes llama.cpp split a batch into ubatches holding the same
            # number of tokens of every sequence, one weight pass each: cutting the drafts to
            # one length keeps a step at most two passes (slots without a draft have one token).
            common = min((len(d) for d in drafts.values() if d), default=0)
            drafts = {seq: d[:common] for seq, d in drafts.items()}
        return drafts

    def _sample(self, slot: Slot, output: int, argmax: np.ndarray | None) -> int:
        job = slot.job
        if job.sampling.greedy and not job.sampling.penalized and argmax is not None:
            return int(argmax[output])  # the greedy chain would pick the same (first) maximum
        return job.sampler.sample(self.ctx, output)

    def _verify(self, p: _Planned, argmax: np.ndarray | None) -> None:
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
        slot.policy.update(len(draft), accepted)
        if draft:
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.verify_steps += 1
            for i in range(accepted):
                stats.accepted_by_position[i] += 1
        if accepted < len(draft):
            stats.rollbacks += 1
            slot.n_mem = self.rollback.truncate(slot.seq, valid, slot.checkpoint)
            stats.replayed_tokens += valid - slot.n_mem
        else:
            slot.n_mem = valid
        self._emit(slot, emitted)

    def _emit(self, slot: Slot, tokens: list[int]) -> None:
        job = slot.job
        reason = None
        for token in tokens:
            slot.history.append(token)
            reason = job.output.push(token)
            if reason is not None:
                break
        if reason is not None:
            self._finish(slot, reason)
            return
        chunk = job.output.take_chunk()
        if chunk is not None:
            job.handle.emit(chunk)
