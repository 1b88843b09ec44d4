"""Tie-aware exactness for the tests: hyspec.exactness (shared with `hyspec bench`), plus a
count of the near-ties each test forgave, printed at the end of the session (conftest.py)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from hyspec.exactness import TIE_EPSILON, Verdict, check
from hyspec.types import Result, SamplingParams

__all__ = ["TIE_EPSILON", "FORGIVEN", "assert_plain", "check", "verify"]

# test node id -> near-ties forgiven (and positions checked), for the session's report.
FORGIVEN: Counter[str] = Counter()
CHECKED: Counter[str] = Counter()


def _test_id() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def verify(model: Path, prompt: list[int], output: list[int] | Result, sampling: SamplingParams | None = None,
           allow_ties: bool = True) -> Verdict:
    """hyspec.exactness.check of one output (with the batch shapes a Result recorded), its
    near-ties counted for the session's report."""
    tokens, trace = (output.token_ids, output.trace) if isinstance(output, Result) else (output, None)
    verdict = check(model, prompt, tokens, sampling=sampling, trace=trace, allow_ties=allow_ties)
    FORGIVEN[_test_id()] += len(verdict.ties)
    CHECKED[_test_id()] += verdict.checked
    return verdict


def assert_plain(model: Path, prompt: list[int], *outputs: list[int] | Result, sampling: SamplingParams | None = None,
                 allow_ties: bool = True) -> list[Verdict]:
    """Each output is what the plain run of ``model`` gives for ``prompt``; differences only at
    true near-ties (none when ``allow_ties`` is False: one slot on an F32 model)."""
    verdicts = [verify(model, prompt, output, sampling, allow_ties) for output in outputs]
    for verdict in verdicts:
        assert verdict.ok, f"output is not the plain run's: {verdict.describe()}"
    return verdicts
