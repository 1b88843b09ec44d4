"""The recipe of the bundled pair: shapes, schedules, and the run from corpus to GGUF files.

``train_pair`` fetches the corpus, trains the tokenizer, trains the target, distils the draft
from it, evaluates both on the held-out chapters, exports both as GGUF, checks the files with
llama.cpp (tokenization, logits against PyTorch, greedy acceptance) and writes
``manifest.json`` next to them: everything hyspec.models and docs/models.md report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyspec.modelgen import ModelShape
from hyspec.train import corpus, verify
from hyspec.train import tokenizer as bpe
from hyspec.train.data import BOS_ID, PAD_ID, Batches, eval_windows, tokenize_chapters
from hyspec.train.export import export_gguf
from hyspec.train.loop import Schedule, agreement, held_out_loss, train
from hyspec.train.model import LFM2, Config

log = logging.getLogger("hyspec.train")

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Recipe:
    name: str
    seq_len: int
    chat_fraction: float
    target: ModelShape
    draft: ModelShape
    target_schedule: Schedule
    draft_schedule: Schedule
    vocab_size: int = bpe.VOCAB_SIZE
    max_chapters: int | None = None  # only the first chapters of each split (quick runs)


# Target: 10 blocks, attention at 2, 5, 8 (LFM2's rhythm), 13.5M parameters. Draft: 4 blocks,
# attention at 2, 2.5M parameters, about a fifth of the target's multiply-adds per token
# (2.5M against 13.5M, the tied output layer included). Steps sized for about half an hour
# on 2 idle cores (docs/models.md: 52 minutes on shared ones).
FULL = Recipe(
    name="full",
    seq_len=512,
    chat_fraction=0.1,
    target=ModelShape(n_layer=10, n_embd=320, n_ff=896, n_head=5, n_head_kv=1, n_ctx=512, attn_layers=(2, 5, 8)),
    draft=ModelShape(n_layer=4, n_embd=192, n_ff=512, n_head=3, n_head_kv=1, n_ctx=512, attn_layers=(2,)),
    target_schedule=Schedule(steps=420, batch=6, lr=1.5e-3, warmup=30),
    draft_schedule=Schedule(steps=360, batch=6, lr=2e-3, warmup=30, distill=0.7),
)

# Seconds, for tests and smoke runs: the same pipeline on toy shapes and a slice of the corpus.
QUICK = Recipe(
    name="quick",
    seq_len=64,
    chat_fraction=0.1,
    target=ModelShape(n_layer=3, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, n_ctx=64, attn_layers=(1,)),
    draft=ModelShape(n_layer=2, n_embd=32, n_ff=64, n_head=1, n_head_kv=1, n_ctx=64, attn_layers=(1,)),
    target_schedule=Schedule(steps=30, batch=8, lr=3e-3, warmup=5, eval_points=2),
    draft_schedule=Schedule(steps=30, batch=8, lr=3e-3, warmup=5, eval_points=2, distill=0.7),
    vocab_size=512,
    max_chapters=40,
)

RECIPES = {r.name: r for r in (FULL, QUICK)}

# Held-out prompts: the first words of these held-out verses (greedy samples, acceptance).
N_PROMPTS = 24
PROMPT_WORDS = 6


def _sha256(path: Path) -> str:
    return corpus.sha256_file(path)


def _macs_per_token(model: LFM2) -> int:
    """Multiply-adds of one decoded token: every weight once (the tied output layer too), the
    embedding lookup free."""
    return model.n_params()


def _prompts(held_out: list[corpus.Chapter], n: int) -> list[str]:
    verses = [v for chapter in held_out for v in chapter.verses if len(v.split()) > PROMPT_WORDS + 4]
    step = max(1, len(verses) // n)
    return [" ".join(v.split()[:PROMPT_WORDS]) for v in verses[::step][:n]]


def train_pair(
    out: Path,
    *,
    recipe: Recipe = FULL,
    seed: int = 0,
    threads: int = 2,
    dtype: str = "q8_0",
    corpus_dir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train and write the pair into ``out``: ``kjv-target.<dtype>.gguf``,
    ``kjv-draft.<dtype>.gguf`` and ``manifest.json``; returns the manifest."""
    t_start, cpu_start = time.perf_counter(), time.process_time()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    train_chapters, held_chapters = corpus.load(corpus_dir)
    if recipe.max_chapters is not None:
        train_chapters = train_chapters[: recipe.max_chapters]
        held_chapters = held_chapters[: max(2, recipe.max_chapters // 10)]
    progress(f"corpus: {len(train_chapters)} training chapters, {len(held_chapters)} held out")

    tok = bpe.train_bpe((c.text for c in train_chapters), recipe.vocab_size)
    train_text = tokenize_chapters(train_chapters, tok)
    held_text = tokenize_chapters(held_chapters, tok)
    held = eval_windows(held_text, recipe.seq_len)
    held_curve = held[::4]  # the loss curve's points: a quarter of the held-out windows
    batches = Batches(train_text, tok, recipe.seq_len, recipe.chat_fraction)
    progress(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_text.stream)} training tokens, "
             f"{int((held[:, 1:] != PAD_ID).sum())} held-out tokens")
    t_data = time.perf_counter()

    torch.manual_seed(seed)
    target = LFM2(Config(tok.get_vocab_size(), recipe.target))
    progress(f"target: {target.n_params():,} parameters")
    target_curve = train(target, batches, recipe.target_schedule, np.random.default_rng([seed, 1]), held_curve,
                         progress=lambda s: progress(f"target {s}"))
    t_target = time.perf_counter()

    torch.manual_seed(seed + 1)
    draft = LFM2(Config(tok.get_vocab_size(), recipe.draft))
    progress(f"draft: {draft.n_params():,} parameters, distilled from the target")
    draft_curve = train(draft, batches, recipe.draft_schedule, np.random.default_rng([seed, 2]), held_curve,
                        teacher=target, progress=lambda s: progress(f"draft {s}"))
    t_draft = time.perf_counter()

    losses = {"target": held_out_loss(target, held), "draft": held_out_loss(draft, held)}
    agree = agreement(target, draft, held)
    progress(f"held-out perplexity: target {math.exp(losses['target']):.2f}, draft {math.exp(losses['draft']):.2f}; "
             f"greedy agreement on held-out text {agree.agree:.3f}")

    files = {role: out / f"kjv-{role}.{dtype}.gguf" for role in ("target", "draft")}
    models = {"target": target, "draft": draft}
    shapes = {"target": recipe.target, "draft": recipe.draft}
    schedules = {"target": recipe.target_schedule, "draft": recipe.draft_schedule}
    curves = {"target": target_curve, "draft": draft_curve}
    description = f"hyspec train: recipe {recipe.name}, seed {seed}, KJV Bible (Debian bible-kjv-text 4.38)"
    check_windows = held[:: max(1, len(held) // 4)][:4]
    prompts_text = _prompts(held_chapters, N_PROMPTS)
    prompts = [[BOS_ID, *tok.encode(p).ids] for p in prompts_text]
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hyspec-train-") as tmp:
        for role, model in models.items():
            f32 = export_gguf(model, tok, Path(tmp) / f"{role}.f32.gguf", dtype="f32", name=f"kjv-{role}",
                              description=description)
            export_gguf(model, tok, files[role], dtype=dtype, name=f"kjv-{role}", description=description)
            diff32 = verify.compare_logits(f32, model, check_windows)
            diff = verify.compare_logits(files[role], model, check_windows)
            progress(f"{role}: llama.cpp vs torch logits, f32 max abs {diff32.max_abs:.2e} "
                     f"(rel {diff32.max_rel:.1e}), {dtype} max abs {diff.max_abs:.2e} "
                     f"(argmax agree {diff.argmax_agree:.3f})")
            entries.append({
                "name": f"kjv-{role}",
                "role": role,
                "file": files[role].name,
                "sha256": _sha256(files[role]),
                "dtype": dtype,
                "params": model.n_params(),
                "macs_per_token": _macs_per_token(model),
                "shape": dataclasses.asdict(shapes[role]),
                "schedule": dataclasses.asdict(schedules[role]),
                "curve": [dataclasses.asdict(p) for p in curves[role]],
                "held_out_loss": losses[role],
                "held_out_ppl": math.exp(losses[role]),
                "logits_vs_torch": {"f32": dataclasses.asdict(diff32), dtype: dataclasses.asdict(diff)},
            })
    bad = verify.tokenization_mismatches(files["target"], tok, [c.text for c in held_chapters])
    accept = verify.acceptance(files["target"], files["draft"], prompts)
    progress(f"llama.cpp greedy acceptance along the target's text: {accept.acceptance:.3f} "
             f"(agreement {accept.agree:.3f}, {accept.positions} positions); "
             f"tokenization mismatches on held-out chapters: {len(bad)}")
    samples = _samples(files, tok, prompts_text[:6])
    t_end = time.perf_counter()

    manifest: dict[str, Any] = {
        "recipe": recipe.name,
        "seed": seed,
        "threads": threads,
        # libgomp's: "passive" keeps a busy machine from stalling torch's threads (README).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
        "corpus": {
            "packages": corpus.PACKAGES,
            "text_sha256": corpus.TEXT_SHA256,
            "held_out": f"every {corpus.HOLD_OUT_EVERY}th chapter ({len(held_chapters)} chapters)",
            "held_out_chapters": [c.name for c in held_chapters],
        },
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "ggml_pre": bpe.GGML_PRE,
            "sha256": hashlib.sha256(tok.to_str().encode()).hexdigest(),
            "held_out_mismatches": len(bad),
        },
        "seq_len": recipe.seq_len,
        "chat_fraction": recipe.chat_fraction,
        "models": entries,
        "agreement_held_out_text": dataclasses.asdict(agree),
        "acceptance_llama_cpp": dataclasses.asdict(accept),
        "wall_seconds": {
            "data": round(t_data - t_start, 1),
            "target": round(t_target - t_data, 1),
            "draft": round(t_draft - t_target, 1),
            "evaluate_export_verify": round(t_end - t_draft, 1),
            "total": round(t_end - t_start, 1),
            # Below threads * total when something else had the cores too.
            "cpu_total": round(time.process_time() - cpu_start, 1),
        },
        "samples": samples,
        "checks": _checks(files, tok, held_chapters, models),
    }
    path = out / MANIFEST
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp_path.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp_path, path)
    progress(f"wrote {files['target']}, {files['draft']}, {path} in {t_end - t_start:.0f} s")
    return manifest


def _samples(files: dict[str, Path], tok: Any, prompts: list[str], n: int = 40) -> list[dict[str, str]]:
    """Greedy continuations by llama.cpp of each model, as text."""
    from hyspec._native import Model

    out: list[dict[str, str]] = []
    loaded = {role: Model(str(path)) for role, path in files.items()}
    try:
        for prompt in prompts:
            row = {"prompt": prompt}
            for role, model in loaded.items():
                ids = model.tokenize(prompt)
                row[role] = model.detokenize(verify.greedy_llama(model, ids, n))
            out.append(row)
    finally:
        for model in loaded.values():
            model.close()
    return out


@torch.no_grad()
def _checks(files: dict[str, Path], tok: Any, held_chapters: list[corpus.Chapter],
            models: dict[str, LFM2]) -> dict[str, Any]:
    """What the test suite checks the bundled files against without torch or tokenizers: the
    tokenizer's ids of a held-out text, the models' greedy tokens (llama.cpp) and PyTorch's top
    logits on a held-out prompt."""
    from hyspec._native import Model

    text = held_chapters[0].text.split("\n")[0] + "\n" + held_chapters[-1].text.split("\n")[-1]
    prompt = [BOS_ID, *tok.encode(held_chapters[1].verses[0]).ids][:24]
    greedy: dict[str, list[int]] = {}
    top: dict[str, list[list[list[float]]]] = {}
    for role, path in files.items():
        model = Model(str(path))
        try:
            greedy[role] = verify.greedy_llama(model, prompt, 32)
        finally:
            model.close()
        logits = models[role](torch.tensor([prompt]))[0]
        values, ids = logits.topk(8, dim=-1)
        top[role] = [[[int(i), round(float(v), 4)] for i, v in zip(ri, rv, strict=True)]
                     for ri, rv in zip(ids, values, strict=True)]
    return {
        "text": text,
        "text_ids": tok.encode(text).ids,
        "prompt_ids": prompt,
        "greedy_ids": greedy,
        "torch_top_logits": top,
    }
