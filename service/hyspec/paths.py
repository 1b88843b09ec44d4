"""Where hyspec keeps what it prepares once: the llama.cpp tree, builds, models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$HYSPEC_CACHE``, by default ``~/.cache/hyspec`` (shared with scripts/llama_cpp.py)."""
    return Path(os.environ.get("HYSPEC_CACHE", Path.home() / ".cache" / "hyspec")).expanduser()


# llama.cpp commit of the pinned tree (must match scripts/llama_cpp.py).
LLAMA_CPP_PIN = "0c1e57098bba"


def llama_cpp_dir() -> Path:
    """The pinned llama.cpp source tree: ``$LLAMA_CPP_DIR``, else the one ``make`` caches."""
    if env := os.environ.get("LLAMA_CPP_DIR"):
        return Path(env).expanduser()
    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PIN}"
