"""Reading key/value pairs from a GGUF file's header without loading the file.

llama.cpp's metadata API leaves out arrays (such as LFM2's per-layer
``lfm2.attention.head_count_kv``), and gguf.GGUFReader maps the whole file and builds a numpy
view per vocabulary string (seconds on a 128k vocabulary). This reads the header in order,
stopping once it has what was asked for.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> bytes:
    return f.read(_read(f, "<Q"))


def _value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype == STRING:
        raw = _string(f)
        return raw.decode("utf-8", "replace") if keep else None
    if vtype == ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if item_type in _SCALARS and not keep:
            f.seek(struct.calcsize("<" + _SCALARS[item_type]) * count, 1)
            return None
        return [_value(f, item_type, keep) for _ in range(count)]
    if vtype not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return _read(f, "<" + _SCALARS[vtype])


def read_keys(path: Path | str, wanted: set[str]) -> dict[str, Any]:
    """The values of the ``wanted`` keys that the file has (arrays as lists, strings decoded)."""
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        _version, _n_tensors, n_kv = _read(f, "<I"), _read(f, "<Q"), _read(f, "<Q")
        for _ in range(n_kv):
            key = _string(f).decode("utf-8", "replace")
            value = _value(f, _read(f, "<I"), keep=key in wanted)
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found
