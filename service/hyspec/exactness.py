"""Tie-aware comparison of two greedy outputs of the same target (REFERENCE section 5).

Two greedy runs of one model may part ways only where the target was at a near-tie: at the
first position where they differ, the top-2 logit margin of a fresh context over the prompt
and the common prefix must be below a small epsilon, and both tokens must be those two.
Anything else is a bug. The tests and ``hyspec bench`` share this one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TIE_EPSILON = 0.02


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length when one
    is a prefix of the other), None when they are equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def top2_margin(model_path: Path, tokens: list[int], n_threads: int = 2) -> tuple[float, list[int]]:
    """Margin between the two best next tokens after ``tokens``, and those two tokens, from a
    fresh context."""
    from hyspec._native import Context, Model

    model = Model(str(model_path))
    ctx = Context(model, n_ctx=max(256, len(tokens) + 16), n_batch=512, n_ubatch=512, n_threads=n_threads)
    for start in range(0, len(tokens), 512):
        part = tokens[start:start + 512]
        last = start + len(part) == len(tokens)
        ctx.decode(part, list(range(start, start + len(part))), [0] * len(part),
                   [False] * (len(part) - 1) + [last])
    logits = ctx.logits(-1)
    best = np.argsort(logits)[::-1][:2]
    return float(logits[best[0]] - logits[best[1]]), [int(t) for t in best]


@dataclass(frozen=True)
class Comparison:
    """How two outputs for one prompt relate."""

    same: bool  # token for token equal
    tie: bool = False  # they differ, first at a true near-tie of the target
    index: int | None = None  # the first differing position
    margin: float | None = None  # the target's top-2 margin there
    top: tuple[int, ...] = ()  # the target's two best tokens there
    tokens: tuple[int, int] | None = None  # the two outputs' tokens there (None: a length difference)

    @property
    def ok(self) -> bool:
        return self.same or self.tie

    def describe(self) -> str:
        if self.same:
            return "same"
        if self.tokens is None:
            return f"length differs after {self.index} tokens"
        kind = "near-tie" if self.tie else "DIFFERENT"
        return (f"{kind} at token {self.index} ({self.tokens[0]} vs {self.tokens[1]}, top-2 margin "
                f"{self.margin:.4f}, top {list(self.top)})")


def compare(model_path: Path, prompt: list[int], a: list[int], b: list[int],
            epsilon: float = TIE_EPSILON) -> Comparison:
    """Compare two greedy outputs of the target at ``model_path`` for ``prompt``: equal, or
    first different at a near-tie (margin < ``epsilon`` and both tokens among the top two)."""
    first = first_difference(a, b)
    if first is None:
        return Comparison(same=True)
    if first >= min(len(a), len(b)):
        return Comparison(same=False, index=first)
    margin, top = top2_margin(model_path, prompt + a[:first])
    tie = margin < epsilon and a[first] in top and b[first] in top
    return Comparison(same=False, tie=tie, index=first, margin=margin, top=tuple(top),
                      tokens=(a[first], b[first]))


def assert_same_or_tie(model_path: Path, prompt: list[int], plain: list[int], spec: list[int],
                       epsilon: float = TIE_EPSILON) -> None:
    """Equal outputs, or a first difference at a true near-tie of the plain run's logits."""
    result = compare(model_path, prompt, plain, spec, epsilon)
    if result.ok:
        return
    if result.tokens is None:
        raise AssertionError(f"outputs differ in length only: {len(plain)} vs {len(spec)} tokens")
    raise AssertionError(
        f"speculative output differs at token {result.index} ({spec[result.index]} vs {plain[result.index]}) "
        f"where the plain run's top-2 margin is {result.margin:.4f} (top {list(result.top)}): not a near-tie"
    )
