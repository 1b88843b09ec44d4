"""The training loop, held-out evaluation, and how often a draft agrees with its target.

AdamW with a linear warm-up and a cosine decay, gradients clipped to norm 1, weight decay on
matrices only. A draft can be distilled: its loss is then a mix of the data's cross-entropy
and the KL divergence from the target's next-token distribution, which is what makes the
draft's greedy choices the target's. Everything is a function of the seed: the weights'
initialisation, the order of the windows, and (with a fixed thread count) the arithmetic.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hyspec.train.data import PAD_ID, Batches
from hyspec.train.model import LFM2

log = logging.getLogger("hyspec.train")


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int  # windows per step
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    distill: float = 0.0  # weight of the KL-from-teacher term (0: plain cross-entropy)
    eval_points: int = 6  # held-out evaluations spread over the run (the loss curve)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class CurvePoint:
    step: int
    tokens: int  # training tokens seen so far
    train_loss: float | None  # mean cross-entropy of the steps since the previous point (None at step 0)
    held_out_loss: float
    seconds: float


def _targets(windows: torch.Tensor) -> torch.Tensor:
    targets = windows[:, 1:].clone()
    targets[targets == PAD_ID] = -100
    return targets


@torch.no_grad()
def held_out_loss(model: LFM2, windows: np.ndarray, batch: int = 16) -> float:
    """Mean cross-entropy (nats per token) over every non-pad target of ``windows``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = torch.from_numpy(windows[i : i + batch])
        logits = model(w[:, :-1])
        targets = _targets(w)
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    model.train()
    return total / count


def train(
    model: LFM2,
    batches: Batches,
    schedule: Schedule,
    rng: np.random.Generator,
    held_out: np.ndarray,
    teacher: LFM2 | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CurvePoint]:
    """Train ``model`` in place; returns the loss curve (held-out loss before the first step too)."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": schedule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=schedule.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    if teacher is not None:
        teacher.eval()
    eval_at = {round(schedule.steps * k / schedule.eval_points) for k in range(1, schedule.eval_points + 1)}
    start = time.perf_counter()
    curve = [CurvePoint(0, 0, None, held_out_loss(model, held_out), 0.0)]
    losses: list[float] = []
    tokens = 0
    model.train()
    for step in range(1, schedule.steps + 1):
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step - 1)
        w = torch.from_numpy(batches.batch(rng, schedule.batch))
        targets = _targets(w)
        logits = model(w[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss = ce
        if teacher is not None and schedule.distill > 0:
            with torch.no_grad():
                teacher_logp = teacher(w[:, :-1]).log_softmax(-1)
            mask = (targets != -100).unsqueeze(-1)
            kl = (teacher_logp.exp() * (teacher_logp - logits.log_softmax(-1)) * mask).sum() / mask.sum()
            loss = (1 - schedule.distill) * ce + schedule.distill * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(ce.item())
        tokens += int((targets != -100).sum())
        if progress is not None and step % max(1, schedule.steps // 20) == 0 and step not in eval_at:
            elapsed = time.perf_counter() - start
            progress(f"step {step}/{schedule.steps}: train loss {np.mean(losses[-10:]):.3f}, "
                     f"{elapsed / step:.2f} s/step")
        if step in eval_at:
            point = CurvePoint(step, tokens, float(np.mean(losses)), held_out_loss(model, held_out),
                               time.perf_counter() - start)
            curve.append(point)
            losses = []
            if progress is not None:
                progress(f"step {step}/{schedule.steps}: train loss {point.train_loss:.3f}, held-out loss "
                         f"{point.held_out_loss:.3f} (ppl {math.exp(point.held_out_loss):.1f}), {point.seconds:.0f} s")
    model.eval()
    return curve


@dataclass(frozen=True)
class Agreement:
    positions: int
    agree: float  # share of positions where the draft's greedy token is the target's
    acceptance: float  # accepted / drafted when drafting `draft_max` tokens a step along the target's text
    draft_max: int


@torch.no_grad()
def agreement(target: LFM2, draft: LFM2, windows: np.ndarray, draft_max: int = 8, batch: int = 16) -> Agreement:
    """How the draft's greedy next token compares with the target's on ``windows``.

    ``acceptance`` replays speculative decoding along the text: from each position the draft
    proposes up to ``draft_max`` tokens, accepted while they equal the target's greedy choices
    (the draft stays on the target's path as long as it agrees), and the step after the first
    rejection starts at the target's own token. With the target's own greedy text as
    ``windows`` this is greedy speculative decoding's accepted / drafted.
    """
    target.eval()
    draft.eval()
    agree_rows: list[np.ndarray] = []
    for i in range(0, len(windows), batch):
        w = torch.from_numpy(windows[i : i + batch])
        same = (target(w[:, :-1]).argmax(-1) == draft(w[:, :-1]).argmax(-1)).numpy()
        valid = (w[:, 1:] != PAD_ID).numpy()
        agree_rows += [row[v] for row, v in zip(same, valid, strict=True)]
    accepted, drafted = replay(agree_rows, draft_max)
    positions = sum(len(r) for r in agree_rows)
    return Agreement(positions, float(sum(int(r.sum()) for r in agree_rows) / positions), accepted / drafted, draft_max)


def replay(agree_rows: list[np.ndarray], draft_max: int) -> tuple[int, int]:
    """(accepted, drafted) of greedy speculation along sequences where ``row[i]`` says whether
    the draft's token at position i is the target's: each step drafts up to ``draft_max``
    tokens, keeps them up to the first mismatch, and the target's own token follows."""
    accepted = drafted = 0
    for row in agree_rows:
        pos = 0
        while pos < len(row):
            k = min(draft_max, len(row) - pos)
            run = 0
            while run < k and row[pos + run]:
                run += 1
            accepted += run
            drafted += k
            pos += run + 1
    return accepted, drafted


@torch.no_grad()
def greedy(model: LFM2, prompt: list[int], n: int, stop: set[int] | None = None) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (full recompute: for short evaluation texts only)."""
    model.eval()
    out = list(prompt)
    for _ in range(n):
        token = int(model(torch.tensor([out]))[0, -1].argmax())
        out.append(token)
        if stop and token in stop:
            break
    return out[len(prompt) :]
