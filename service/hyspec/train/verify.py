"""Checks of exported GGUFs with llama.cpp itself (hyspec._native): tokenization, logits,
greedy text, and the draft's acceptance along the target's greedy text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hyspec._native import Context, Model
from hyspec.train.data import BOS_ID, PAD_ID
from hyspec.train.loop import replay
from hyspec.train.model import LFM2

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def tokenization_mismatches(path: Path, tokenizer: Tokenizer, texts: Sequence[str]) -> list[str]:
    """The texts llama.cpp tokenizes differently from ``tokenizer`` (BOS + the same ids expected)."""
    model = Model(str(path), vocab_only=True)
    try:
        bad = []
        for text in texts:
            if model.tokenize(text, add_special=True, parse_special=False) != [BOS_ID, *tokenizer.encode(text).ids]:
                bad.append(text)
        return bad
    finally:
        model.close()


@dataclass(frozen=True)
class LogitDiff:
    max_abs: float
    max_rel: float  # max_abs / the largest |logit|
    argmax_agree: float  # share of positions where llama.cpp's and torch's argmax are the same
    positions: int


def llama_logits(model: Model, tokens: Sequence[int], threads: int = 2) -> np.ndarray:
    """(len(tokens), n_vocab) logits of one sequence decoded as one batch."""
    n = len(tokens)
    with Context(model, n_ctx=max(256, n), n_batch=max(64, n), n_ubatch=max(64, n), n_threads=threads) as ctx:
        ctx.decode(list(tokens), list(range(n)), [0] * n, [True] * n)
        return ctx.logits_all()


@torch.no_grad()
def compare_logits(path: Path, model: LFM2, windows: np.ndarray) -> LogitDiff:
    """llama.cpp's logits of the GGUF at ``path`` against ``model``'s on each window."""
    gguf = Model(str(path))
    try:
        max_abs = max_rel = 0.0
        agree = positions = 0
        for w in windows:
            tokens = [int(t) for t in w if t != PAD_ID]
            ours = model(torch.tensor([tokens]))[0].numpy()
            theirs = llama_logits(gguf, tokens)
            diff = float(np.abs(ours - theirs).max())
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / float(np.abs(ours).max()))
            agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
            positions += len(tokens)
        return LogitDiff(max_abs, max_rel, agree / positions, positions)
    finally:
        gguf.close()


def greedy_llama(model: Model, prompt: Sequence[int], n: int, threads: int = 2) -> list[int]:
    """``n`` greedy tokens from llama.cpp after ``prompt`` (stops after an end-of-generation token)."""
    out: list[int] = []
    batch = max(64, len(prompt))
    with Context(model, n_ctx=len(prompt) + n + 8, n_batch=batch, n_ubatch=batch, n_threads=threads) as ctx:
        ctx.decode(list(prompt), list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        pos = len(prompt)
        for _ in range(n):
            token = int(np.argmax(ctx.logits(-1)))
            out.append(token)
            if model.is_eog(token):
                break
            ctx.decode([token], [pos], [0], [True])
            pos += 1
    return out


@dataclass(frozen=True)
class Acceptance:
    prompts: int
    positions: int  # generated target tokens compared
    agree: float  # the draft's greedy token is the target's, per position
    acceptance: float  # accepted / drafted with draft_max tokens a step
    draft_max: int


def acceptance(target: Path, draft: Path, prompts: Sequence[Sequence[int]], n: int = 64,
               draft_max: int = 8) -> Acceptance:
    """Greedy speculative decoding replayed with llama.cpp: the target's greedy continuation of
    each prompt, the draft's greedy prediction at every position of it (one batch), and then
    drafts of up to ``draft_max`` tokens accepted while they match."""
    t_model, d_model = Model(str(target)), Model(str(draft))
    try:
        rows: list[np.ndarray] = []
        for prompt in prompts:
            cont = greedy_llama(t_model, prompt, n)
            seq = list(prompt) + cont
            # Row i predicts seq[i + 1]: the rows for the generated tokens.
            logits = llama_logits(d_model, seq[:-1])[len(prompt) - 1 :]
            rows.append(np.argmax(logits, axis=-1) == np.asarray(cont))
        accepted, drafted = replay(rows, draft_max)
        positions = sum(len(r) for r in rows)
        agree = sum(int(r.sum()) for r in rows) / positions
        return Acceptance(len(prompts), positions, agree, accepted / drafted, draft_max)
    finally:
        t_model.close()
        d_model.close()
