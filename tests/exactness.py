"""Tie-aware comparison of a speculative output with the plain one (REFERENCE section 5).

Where two greedy outputs first differ, the plain run must have been at a near-tie: the
target's top-2 logit margin at that position below a small epsilon, and the speculative
token must be one of those two. Anything else is a bug.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hyspec._native import Context, Model

TIE_EPSILON = 0.02


def top2_margin(model_path: Path, tokens: list[int]) -> tuple[float, list[int]]:
    """Margin between the two best next tokens after ``tokens``, and those two tokens, from a
    fresh context."""
    model = Model(str(model_path))
    ctx = Context(model, n_ctx=max(256, len(tokens) + 16), n_batch=512, n_ubatch=512, n_threads=2)
    for start in range(0, len(tokens), 512):
        part = tokens[start:start + 512]
        last = start + len(part) == len(tokens)
        ctx.decode(part, list(range(start, start + len(part))), [0] * len(part),
                   [False] * (len(part) - 1) + [last])
    logits = ctx.logits(-1)
    best = np.argsort(logits)[::-1][:2]
    return float(logits[best[0]] - logits[best[1]]), [int(t) for t in best]


def assert_same_or_tie(model_path: Path, prompt: list[int], plain: list[int], spec: list[int],
                       epsilon: float = TIE_EPSILON) -> None:
    """Equal outputs, or a first difference at a true near-tie of the plain run's logits."""
    if plain == spec:
        return
    n = min(len(plain), len(spec))
    first = next((i for i in range(n) if plain[i] != spec[i]), n)
    assert first < n, f"outputs differ in length only: {len(plain)} vs {len(spec)} tokens"
    margin, top = top2_margin(model_path, prompt + plain[:first])
    assert margin < epsilon and spec[first] in top, (
        f"speculative output differs at token {first} ({spec[first]} vs {plain[first]}) where the plain "
        f"run's top-2 margin is {margin:.4f} (top {top}): not a near-tie"
    )
