"""Randomized concurrent load on one engine, every output checked against the plain run.

A round draws requests (prompts of different lengths, some longer than a ubatch; greedy and
seeded sampling; every speculation mode the engine has; some cancelled part-way; some
continuing or repeating an earlier request's prompt, so that the prefix cache hits) and submits
them at random moments, so that they arrive while others are mid-generation. Every output,
finished or cancelled, is then walked along the target's plain run (hyspec.exactness) with the
batch shapes the engine recorded. Shared by the make-test check and the longer soak
(test_concurrency.py).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from exactness import verify
from hyspec.engine import Engine
from hyspec.types import Chunk, FinishReason, GenerationRequest, Result, SamplingParams, SpecMode, SpecParams

# Ordinary tokens of the tiny models' byte-level BPE vocabulary, and its BOS.
LLAMA_BPE = (200, 30000, 128000)


@dataclass
class Case:
    prompt: list[int]
    max_tokens: int
    mode: SpecMode
    sampling: SamplingParams
    delay: float  # seconds after the round starts
    cancel_after: int | None  # cancel once this many tokens arrived


@dataclass
class Figures:
    """What a run of rounds saw."""

    requests: int = 0
    cancelled: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    cached: int = 0
    ties: int = 0
    mismatches: list[str] = field(default_factory=list)

    def add(self, other: Figures) -> None:
        for name in ("requests", "cancelled", "tokens", "drafted", "accepted", "rollbacks", "cached", "ties"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.mismatches += other.mismatches

    def summary(self) -> str:
        return (f"{self.requests} requests ({self.cancelled} cancelled), {self.tokens} tokens, "
                f"{self.accepted}/{self.drafted} drafts accepted, {self.rollbacks} rollbacks, "
                f"{self.cached} prompt tokens from the prefix cache, "
                f"{self.ties} near-ties forgiven, {len(self.mismatches)} mismatches")


def draw_cases(rng: random.Random, modes: list[SpecMode], n: int, long_prompt: int,
               vocab: tuple[int, int, int] = LLAMA_BPE) -> list[Case]:
    """``vocab``: the lowest and highest ordinary token id to draw prompts from, and BOS."""
    low, high, bos = vocab
    cases = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.2:
            length = rng.randint(long_prompt + 1, 2 * long_prompt + 20)  # longer than a ubatch
        else:
            length = rng.randint(2, 40)
        delay = rng.random() * 0.3
        if cases and rng.random() < 0.25:  # a later turn of an earlier request: the prefix cache hits
            parent = rng.choice(cases)
            prompt = parent.prompt[1:] + [rng.randint(low, high) for _ in range(length // 4 + 1)]
            delay = parent.delay + 0.5 + rng.random() * 0.5  # mostly after the parent finished
        elif cases and rng.random() < 0.3:  # a retry: the whole prompt but its last token is cached
            parent = rng.choice(cases)
            prompt = parent.prompt[1:]
            delay = parent.delay + 0.5 + rng.random() * 0.5
        elif rng.random() < 0.3:  # repetitive: the n-gram drafter finds something
            unit = [rng.randint(low, high) for _ in range(rng.randint(2, 6))]
            prompt = (unit * (length // len(unit) + 1))[:length]
        else:
            prompt = [rng.randint(low, high) for _ in range(length)]
        sampled = rng.random() < 0.3
        sampling = (SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 40]),
                                   seed=rng.randrange(2**32)) if sampled else SamplingParams())
        cases.append(Case(prompt=[bos] + prompt, max_tokens=rng.randint(8, 56), mode=rng.choice(modes),
                          sampling=sampling, delay=delay,
                          cancel_after=rng.randint(1, 12) if rng.random() < 0.15 else None))
    return cases


def run_round(engine: Engine, model: Path, cases: list[Case]) -> Figures:
    results: list[Result | BaseException | None] = [None] * len(cases)
    start = time.monotonic()

    def drive(i: int, case: Case) -> None:
        try:
            time.sleep(max(0.0, start + case.delay - time.monotonic()))
            handle = engine.submit(GenerationRequest(token_ids=case.prompt, max_tokens=case.max_tokens,
                                                     ignore_eos=True, sampling=case.sampling,
                                                     spec=SpecParams(mode=case.mode)))
            seen = 0
            for event in handle:
                if isinstance(event, Chunk):
                    seen += len(event.token_ids)
                    if case.cancel_after is not None and seen >= case.cancel_after:
                        handle.cancel()
                else:
                    results[i] = event
        except BaseException as e:  # reported below, with the case
            results[i] = e

    threads = [threading.Thread(target=drive, args=(i, c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    figures = Figures()
    for case, result in zip(cases, results, strict=True):
        assert isinstance(result, Result), f"{case}: {result!r}"
        if result.finish_reason is FinishReason.CANCELLED:
            assert case.cancel_after is not None, f"cancelled without being asked: {case}"
            figures.cancelled += 1
        else:
            assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == case.max_tokens, case
        verdict = verify(model, case.prompt, result, sampling=case.sampling)
        if not verdict.ok:
            figures.mismatches.append(f"{case.mode.value} {'sampled' if case.sampling.seed else 'greedy'} "
                                      f"prompt of {len(case.prompt)}: {verdict.describe()}")
        figures.requests += 1
        figures.tokens += len(result.token_ids)
        figures.drafted += result.stats.drafted
        figures.accepted += result.stats.accepted
        figures.rollbacks += result.stats.rollbacks
        figures.cached += result.stats.cached_tokens
        figures.ties += len(verdict.ties)
    return figures
