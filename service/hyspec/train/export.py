"""A trained model to GGUF, with hyspec's own writer (hyspec.modelgen.write_model)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hyspec.modelgen import CHAT_TEMPLATE, write_model
from hyspec.train.tokenizer import gguf_metadata

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from hyspec.train.model import LFM2


def export_gguf(
    model: LFM2, tokenizer: Tokenizer, out: Path, *, dtype: str, name: str, description: str
) -> Path:
    """Write ``model`` as an ``lfm2`` GGUF of ``dtype`` (norms and conv kernels stay F32), with the
    tokenizer's metadata and the ChatML template; returns ``out``."""
    return write_model(
        out,
        arch="lfm2",
        shape=model.config.shape,
        weights=model.state_dict_gguf(),
        tokenizer=gguf_metadata(tokenizer),
        dtype=dtype,
        name=name,
        description=description,
        chat_template=CHAT_TEMPLATE,
    )
