"""The bundled models (hyspec.models): an LFM2 target and draft trained on the KJV Bible, checked
against what their training recorded in manifest.json (no PyTorch needed)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hyspec import models
from hyspec._native import Context, Model
from hyspec.drafters.draft_model import check_same_vocab
from hyspec.train.corpus import sha256_file

REPO = Path(__file__).resolve().parents[1]
# Every distinct word of the King James Bible, lower case (from the training corpus).
KJV_WORDS = set((Path(__file__).parent / "data" / "kjv_words.txt").read_text().split())


@pytest.fixture(scope="module")
def loaded() -> Iterator[dict[str, Model]]:
    out = {m.role: Model(str(m.path)) for m in models.describe()}
    yield out
    for model in out.values():
        model.close()


def _greedy(model: Model, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    with Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2) as ctx:
        ctx.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        for _ in range(n):
            token = int(np.argmax(ctx.logits(-1)))
            out.append(token)
            if model.is_eog(token):
                break
            ctx.decode([token], [len(prompt) + len(out) - 1], [0], [True])
    return out


def test_bundled_files_are_the_trained_ones_and_listed() -> None:
    described = models.describe()
    assert [m.role for m in described] == ["target", "draft"]
    assert models.bundled() == {m.name: m.path for m in described}
    assert models.target() == described[0].path and models.draft() == described[1].path
    recorded = {e["name"]: e for e in models.manifest()["models"]}
    for m in described:
        assert m.arch == "lfm2"
        assert m.params == recorded[m.name]["params"]
        assert sha256_file(m.path) == m.sha256 == recorded[m.name]["sha256"]
    target, draft = (recorded[m.name] for m in described)
    assert 10_000_000 <= target["params"] <= 30_000_000
    assert draft["macs_per_token"] <= target["macs_per_token"] / 5


def test_hyspec_models_prints_one_line_per_model() -> None:
    done = subprocess.run([sys.executable, "-m", "hyspec", "models"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for line, m in zip(lines, models.describe(), strict=True):
        assert line.split("\t") == [m.name, str(m.path), "lfm2", str(m.params)]


def test_bundled_files_are_not_ignored_so_the_wheel_has_them() -> None:
    """scikit-build-core leaves git-ignored files out of the wheel, and *.gguf is ignored."""
    for path in [*models.bundled().values(), models.MANIFEST]:
        done = subprocess.run(["git", "check-ignore", "-q", str(path.relative_to(REPO))], cwd=REPO)
        assert done.returncode == 1, f"{path} is git-ignored: the wheel would leave it out"


def test_models_load_as_hybrid_lfm2_with_one_vocabulary(loaded: dict[str, Model]) -> None:
    target, draft = loaded["target"], loaded["draft"]
    for model in (target, draft):
        assert model.arch == "lfm2" and model.is_hybrid and not model.is_recurrent
        assert model.n_vocab == 4096 and model.bos == 1 and model.eos == 2
        assert model.token_to_piece(4, special=True) == b"<|im_end|>" and model.is_eog(4)
    check_same_vocab(target, draft)


def test_tokenization_is_the_trainers_and_round_trips(loaded: dict[str, Model]) -> None:
    checks = models.manifest()["checks"]
    target = loaded["target"]
    assert target.tokenize(checks["text"], add_special=False) == checks["text_ids"]
    assert target.detokenize(checks["text_ids"]) == checks["text"]
    assert models.manifest()["tokenizer"]["held_out_mismatches"] == 0


def test_llama_cpp_logits_match_the_torch_model(loaded: dict[str, Model]) -> None:
    """PyTorch's top-8 logits at each position of a held-out prompt, recorded at training time,
    against llama.cpp's on the Q8_0 files: same best token, values within quantization noise."""
    checks = models.manifest()["checks"]
    prompt = checks["prompt_ids"]
    for role, model in loaded.items():
        with Context(model, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2) as ctx:
            ctx.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [True] * len(prompt))
            logits = ctx.logits_all()
        top = checks["torch_top_logits"][role]
        ids = np.array([[i for i, _ in row] for row in top])
        ref = np.array([[v for _, v in row] for row in top])
        ours = np.take_along_axis(logits, ids, axis=1)
        assert np.abs(ours - ref).max() < 0.15, role  # Q8_0: ~0.04 seen, logits up to ~12
        agree = (logits.argmax(-1) == ids[:, 0]).mean()
        assert agree >= 0.9, (role, agree)


def test_greedy_text_is_deterministic_and_reads_like_the_bible(loaded: dict[str, Model]) -> None:
    checks = models.manifest()["checks"]
    for role, model in loaded.items():
        first = _greedy(model, checks["prompt_ids"], 32)
        assert first == _greedy(model, checks["prompt_ids"], 32) == checks["greedy_ids"][role], role
        words = re.findall(r"[A-Za-z]+", model.detokenize(first))
        assert len(words) >= 10
        assert sum(w.lower() in KJV_WORDS for w in words) >= 0.9 * len(words), (role, words)


def test_draft_agrees_with_the_target_often_not_always(loaded: dict[str, Model]) -> None:
    """Greedy speculation along the target's text: most drafted tokens accepted, some rejected."""
    target, draft = loaded["target"], loaded["draft"]
    prompt = target.tokenize("And it came to pass, when")
    cont = _greedy(target, prompt, 64)
    seq = prompt + cont
    with Context(draft, n_ctx=256, n_batch=128, n_ubatch=128, n_threads=2) as ctx:
        n = len(seq) - 1
        ctx.decode(seq[:-1], list(range(n)), [0] * n, [True] * n)
        guesses = ctx.logits_all().argmax(-1)[len(prompt) - 1 :]
    agree = float((guesses == np.array(cont)).mean())
    assert 0.5 <= agree < 1.0, agree


def test_chat_turn_ends_with_im_end(loaded: dict[str, Model]) -> None:
    target = loaded["target"]
    chat = target.apply_chat_template([{"role": "user", "content": "In the beginning God created the heaven "
                                        "and the earth."}], add_assistant=True)
    reply = _greedy(target, target.tokenize(chat, parse_special=True), 96)
    assert target.is_eog(reply[-1]), target.detokenize(reply)
    words = re.findall(r"[A-Za-z]+", target.detokenize(reply[:-1]))
    assert words and sum(w.lower() in KJV_WORDS for w in words) >= 0.9 * len(words)
