"""Exactness under concurrency: randomized mixes of requests on several busy slots, every
speculation mode and rollback method, the prefix cache, hybrid and attention targets
(tests/concurrency.py).

The soak runs the same check for minutes: `make soak` (pytest -m soak) before a release."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from concurrency import LLAMA_BPE, Figures, draw_cases, run_round
from hyspec.engine import Engine, EngineConfig
from hyspec.types import SpecMode

BATCH = 64  # n_batch = n_ubatch: prompts up to 2x this long are split across steps
CONFIGS = {
    # name: (target fixture, draft fixture, rs_snapshots)
    "hybrid-ring": ("tiny_lfm2", "tiny_lfm2_q8", None),
    "hybrid-checkpoint": ("tiny_lfm2", "tiny_lfm2_q8", 0),
    "attention": ("tiny_llama", "tiny_llama_q8", None),
    "trained-pair": ("trained_target", "trained_draft", None),  # the bundled pair: peaked logits
}
MODES = [SpecMode.OFF, SpecMode.DRAFT, SpecMode.NGRAM, SpecMode.AUTO]


@pytest.fixture(params=list(CONFIGS), scope="module")
def loaded(request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine, Path]]:
    target_name, draft_name, rs = CONFIGS[request.param]
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    config = EngineConfig(model=target, draft=draft, slots=4, ctx=512, batch=BATCH, threads=2, draft_max=4,
                          adaptive_draft=False, rs_snapshots=rs, max_queue=64, record_shapes=True)
    with Engine(config) as engine:
        expected = {"hybrid-checkpoint": "checkpoint", "attention": "seq_rm"}.get(request.param, "ring")
        assert engine.info()["rollback"] == expected
        yield request.param, engine, target


def _rounds(loaded: tuple[str, Engine, Path], seeds: range, per_round: int) -> Figures:
    name, engine, target = loaded
    vocab = (100, engine.model.n_vocab - 1, engine.model.bos) if name == "trained-pair" else LLAMA_BPE
    total = Figures()
    for seed in seeds:
        rng = random.Random(f"{name}-{seed}")
        total.add(run_round(engine, target, draw_cases(rng, MODES, per_round, long_prompt=BATCH, vocab=vocab)))
    print(f"{name}: {total.summary()}")
    return total


def test_concurrent_requests_equal_their_plain_runs(loaded: tuple[str, Engine, Path]) -> None:
    figures = _rounds(loaded, range(3), per_round=8)
    assert not figures.mismatches, "\n".join(figures.mismatches)
    assert figures.rollbacks > 0 and figures.accepted > 0 and figures.cached > 0, figures.summary()


def test_snapshot_ring_under_churn(tiny_lfm2: Path, tiny_lfm2_q8: Path) -> None:
    """Short requests coming and going scramble the recurrent cells, the condition under which
    llama.cpp's snapshot ring restored stale states (1-2% of such requests differed before the
    scheduler checked each decode's shape, with margins up to 19 logits)."""
    config = EngineConfig(model=tiny_lfm2, draft=tiny_lfm2_q8, slots=4, ctx=512, batch=BATCH, threads=2,
                          draft_max=4, adaptive_draft=False, max_queue=64, record_shapes=True)
    total = Figures()
    with Engine(config) as engine:
        assert engine.info()["rollback"] == "ring"
        for seed in range(8):
            cases = draw_cases(random.Random(f"churn-{seed}"), [SpecMode.DRAFT, SpecMode.OFF, SpecMode.NGRAM], 24,
                               long_prompt=BATCH)
            for case in cases:
                case.max_tokens, case.cancel_after = min(case.max_tokens, 6), None
            total.add(run_round(engine, tiny_lfm2, cases))
    print(f"ring churn: {total.summary()}")
    assert not total.mismatches, "\n".join(total.mismatches)
    assert total.rollbacks > 50


@pytest.mark.soak
def test_soak(loaded: tuple[str, Engine, Path]) -> None:
    """The same, for minutes: HYSPEC_SOAK_ROUNDS rounds (default 40) of 8 requests per target,
    from seed HYSPEC_SOAK_FIRST_SEED (default 100; another explores other mixes)."""
    first = int(os.environ.get("HYSPEC_SOAK_FIRST_SEED", "100"))
    figures = _rounds(loaded, range(first, first + int(os.environ.get("HYSPEC_SOAK_ROUNDS", "40"))), per_round=8)
    assert not figures.mismatches, "\n".join(figures.mismatches)
