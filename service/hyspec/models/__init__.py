"""The models bundled with hyspec: an LFM2-architecture target and draft trained on the King
James Bible by ``hyspec train`` (recipe, figures and checksums: docs/models.md and this
directory's manifest.json).

    >>> from hyspec import models
    >>> models.target(), models.draft()  # paths of the GGUF files
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).resolve().parent
MANIFEST = MODELS_DIR / "manifest.json"


@dataclass(frozen=True)
class BundledModel:
    name: str  # kjv-target, kjv-draft
    role: str  # target or draft
    path: Path
    arch: str  # general.architecture, read from the file
    params: int  # weights in the file, counted from its tensors
    sha256: str  # as recorded when it was trained


@cache
def manifest() -> dict[str, Any]:
    """The training record written by ``hyspec train`` (recipe, losses, checks)."""
    return json.loads(MANIFEST.read_text())


def bundled() -> dict[str, Path]:
    """Paths of the bundled GGUF files by name."""
    return {entry["name"]: MODELS_DIR / entry["file"] for entry in manifest()["models"]}


def _by_role(role: str) -> Path:
    for entry in manifest()["models"]:
        if entry["role"] == role:
            return MODELS_DIR / entry["file"]
    raise LookupError(f"no bundled {role} model")


def target() -> Path:
    """The trained target (LFM2 architecture, 13.5M parameters)."""
    return _by_role("target")


def draft() -> Path:
    """The trained draft for ``target()``: same tokenizer, a fifth of its compute per token."""
    return _by_role("draft")


def _read_header(path: Path) -> tuple[str, int]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, sum(int(t.n_elements) for t in reader.tensors)


def describe() -> list[BundledModel]:
    """Each bundled model with its architecture and parameter count read from the file."""
    out = []
    for entry in manifest()["models"]:
        path = MODELS_DIR / entry["file"]
        arch, params = _read_header(path)
        out.append(BundledModel(entry["name"], entry["role"], path, arch, params, entry["sha256"]))
    return out
