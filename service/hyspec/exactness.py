"""Tie-aware comparison of a speculative output with the plain one (REFERENCE section 5).

A speculative run verifies several positions in one batch, and llama.cpp's logits depend a
little on the batch's shape, so two greedy runs of one model may part ways where the target
was at a near-tie, and only there. At the first position where the outputs differ this
recomputes the plain run's own logits (the prompt in one batch, then one token per decode,
as a one-slot plain run does) and the same position decoded in one batch. The difference is
a near-tie when both tokens are the plain run's top two and their margin is below
``TIE_EPSILON`` or within twice what the batch shape moved it (the measured noise at that
very position). Anything else is a bug. The tests and ``hyspec bench`` share this code.
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


def _decode_logits(model_path: Path, prompt: list[int], outputs: list[int], batched: bool,
                   n_threads: int) -> np.ndarray:
    """Logits after ``prompt + outputs``: the prompt in n_batch chunks, then the outputs one
    per decode (as plain decoding does) or in one batch."""
    from hyspec._native import Context, Model

    n_batch = 512
    tokens = prompt + outputs
    ctx = Context(Model(str(model_path)), n_ctx=max(256, len(tokens) + 16), n_batch=n_batch, n_ubatch=n_batch,
                  n_threads=n_threads)

    def chunks(seq: list[int], size: int) -> list[list[int]]:
        return [seq[i:i + size] for i in range(0, len(seq), size)]

    pos = 0
    for part in chunks(prompt, n_batch) + chunks(outputs, n_batch if batched else 1):
        ctx.decode(part, range(pos, pos + len(part)), [0] * len(part), [False] * (len(part) - 1) + [True])
        pos += len(part)
    return ctx.logits(-1)


@dataclass(frozen=True)
class Comparison:
    """How two outputs for one prompt relate."""

    same: bool  # token for token equal
    tie: bool = False  # they differ, first at a true near-tie of the target
    index: int | None = None  # the first differing position
    margin: float | None = None  # the plain run's logit margin between the two tokens there
    noise: float | None = None  # how much the batch shape moved that margin
    top: tuple[int, ...] = ()  # the plain run's two best tokens there
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
        return (f"{kind} at token {self.index} ({self.tokens[0]} vs {self.tokens[1]}, margin "
                f"{self.margin:.4f}, batch-shape noise {self.noise:.4f}, top {list(self.top)})")


def compare(model_path: Path, prompt: list[int], a: list[int], b: list[int],
            epsilon: float = TIE_EPSILON, n_threads: int = 2) -> Comparison:
    """Compare a plain greedy output ``a`` with another greedy output ``b`` of the target at
    ``model_path`` for ``prompt``: equal, or first different at a near-tie."""
    first = first_difference(a, b)
    if first is None:
        return Comparison(same=True)
    if first >= min(len(a), len(b)):
        return Comparison(same=False, index=first)
    plain = _decode_logits(model_path, prompt, a[:first], batched=False, n_threads=n_threads)
    batch = _decode_logits(model_path, prompt, a[:first], batched=True, n_threads=n_threads)
    ta, tb = a[first], b[first]
    margin = float(plain[ta] - plain[tb])
    noise = abs(margin - float(batch[ta] - batch[tb]))
    top = [int(t) for t in np.argsort(plain)[::-1][:2]]
    tie = ta in top and tb in top and margin < max(epsilon, 2.0 * noise)
    return Comparison(same=False, tie=tie, index=first, margin=margin, noise=noise, top=tuple(top),
                      tokens=(ta, tb))


def assert_same_or_tie(model_path: Path, prompt: list[int], plain: list[int], spec: list[int],
                       epsilon: float = TIE_EPSILON) -> None:
    """Equal outputs, or a first difference at a true near-tie of the plain run's logits."""
    result = compare(model_path, prompt, plain, spec, epsilon)
    if result.ok:
        return
    if result.tokens is None:
        raise AssertionError(f"outputs differ in length only: {len(plain)} vs {len(spec)} tokens")
    raise AssertionError(f"speculative output differs from plain: {result.describe()}: not a near-tie")
