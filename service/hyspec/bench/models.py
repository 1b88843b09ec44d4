"""The benchmark's models: random-weight GGUFs written once into the cache, and Gemma 3 270M.

Names are stable (arch, preset, seed, type), so a rerun reuses every file; a generator
change that alters weights needs the directory cleared (``--models-dir`` elsewhere).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hyspec.paths import cache_dir

log = logging.getLogger("hyspec.bench")


@dataclass(frozen=True)
class ModelSpec:
    """A model by role; ``gemma`` stands for the real Gemma 3 270M from its PyPI package."""

    arch: str = "lfm2"
    preset: str = "tiny"
    seed: int = 1
    dtype: str = "f16"
    # The token embedding's spread; 1.0 makes a random model echo its input until its output
    # repeats (a case for n-gram drafting). None: the generator's default.
    embed_std: float | None = None
    gemma: bool = False
    bundled: str | None = None  # a model shipped with hyspec (hyspec.models), by name

    @property
    def filename(self) -> str:
        if self.bundled:
            return f"{self.bundled}.gguf"
        if self.gemma:
            return "gemma-3-270m-q4_k_m.gguf"
        echo = "" if self.embed_std is None else f"-e{self.embed_std:g}"
        return f"{self.arch}-{self.preset.removeprefix('lfm2-')}-s{self.seed}{echo}-{self.dtype}.gguf"

    @property
    def label(self) -> str:
        if self.bundled:
            return f"{self.bundled} (trained) Q8_0"
        if self.gemma:
            return "Gemma 3 270M Q4_K_M"
        name = {"lfm2": "LFM2", "llama": "llama"}[self.arch]
        echo = "" if self.embed_std is None else " (echo)"
        return f"{name}-{self.preset.removeprefix('lfm2-').upper()} {self.dtype.upper()}{echo}"


GEMMA = ModelSpec(gemma=True)
KJV_TARGET = ModelSpec(bundled="kjv-target")
KJV_DRAFT = ModelSpec(bundled="kjv-draft")


def default_models_dir() -> Path:
    return cache_dir() / "models" / "bench"


def prepare(specs: list[ModelSpec], models_dir: Path) -> dict[ModelSpec, Path]:
    """The path of every model, writing the missing ones (the 1.2B F16 file takes ~30 s)."""
    from hyspec.modelgen import make_model

    paths: dict[ModelSpec, Path] = {}
    for spec in dict.fromkeys(specs):
        if spec.bundled:
            from hyspec.models import bundled

            paths[spec] = bundled()[spec.bundled]
            continue
        if spec.gemma:
            from hyspec.gemma import gemma_path

            paths[spec] = gemma_path(progress=sys.stderr.isatty())
            continue
        path = models_dir / spec.filename
        if not path.is_file():
            log.info("writing bench model %s (once)", path)
            t0 = time.perf_counter()
            extra = {} if spec.embed_std is None else {"embed_std": spec.embed_std}
            make_model(path, arch=spec.arch, preset=spec.preset, seed=spec.seed, dtype=spec.dtype,
                       progress=sys.stderr.isatty(), **extra)
            log.info("  %s written in %.0f s", path.name, time.perf_counter() - t0)
        paths[spec] = path
    return paths
