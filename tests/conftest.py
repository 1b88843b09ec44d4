"""Shared fixtures: small models made by the project's own generator, and the real Gemma 3 270M."""

from __future__ import annotations

import os
from pathlib import Path

# Several llama.cpp contexts (and server subprocesses) share two cores here: OpenMP threads
# that spin while waiting starve each other (a 10x slowdown was seen). Set before libgomp loads.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest
from hyspec.gemma import gemma_path
from hyspec.modelgen import make_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model(model_dir: Path, name: str, **kwargs: object) -> Path:
    path = model_dir / f"{name}.gguf"
    if not path.exists():
        make_model(path, progress=False, **kwargs)  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="session")
def tiny_lfm2(model_dir: Path) -> Path:
    """Tiny hybrid LFM2 (short-conv + attention), random weights, seed 1."""
    return _model(model_dir, "lfm2-s1", arch="lfm2", preset="tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_lfm2_other(model_dir: Path) -> Path:
    """Same shape, different seed: a draft that almost never agrees."""
    return _model(model_dir, "lfm2-s2", arch="lfm2", preset="tiny", seed=2)


@pytest.fixture(scope="session")
def tiny_lfm2_echo(model_dir: Path) -> Path:
    """A hybrid whose large embedding makes it echo its input: repetitive output, where
    n-gram lookup has something to find."""
    return _model(model_dir, "lfm2-echo", arch="lfm2", preset="tiny", seed=2, embed_std=1.0)


@pytest.fixture(scope="session")
def tiny_lfm2_q8(model_dir: Path) -> Path:
    """The seed-1 model quantized to Q8_0: a draft that agrees often, not always."""
    return _model(model_dir, "lfm2-s1-q8", arch="lfm2", preset="tiny", seed=1, dtype="q8_0")


@pytest.fixture(scope="session")
def tiny_llama(model_dir: Path) -> Path:
    """Tiny pure-attention llama, random weights, seed 1."""
    return _model(model_dir, "llama-s1", arch="llama", preset="tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_llama_q8(model_dir: Path) -> Path:
    return _model(model_dir, "llama-s1-q8", arch="llama", preset="tiny", seed=1, dtype="q8_0")


@pytest.fixture(scope="session")
def trained_target() -> Path:
    """The bundled LFM2 target trained on the KJV Bible (hyspec.models)."""
    from hyspec import models

    return models.target()


@pytest.fixture(scope="session")
def trained_draft() -> Path:
    from hyspec import models

    return models.draft()


@pytest.fixture(scope="session")
def gemma() -> Path:
    """The real Gemma 3 270M (Q4_K_M) from its PyPI package."""
    return gemma_path(progress=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many near-ties the exactness checks forgave, per test (hyspec.exactness)."""
    from exactness import CHECKED, FORGIVEN

    if not CHECKED:
        return
    total, positions = sum(FORGIVEN.values()), sum(CHECKED.values())
    terminalreporter.write_sep("-", f"exactness: {total} near-tie(s) forgiven in {positions} checked positions")
    for test, n in sorted(FORGIVEN.items()):
        if n:
            terminalreporter.write_line(f"{n:4d} near-tie(s) of {CHECKED[test]:5d} positions  {test}")
