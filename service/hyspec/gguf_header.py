"""Reading key/value pairs from a GGUF file's header without loading the file.

llama.cpp's metadata API leaves out arrays (such as LFM2's per-layer
``lfm2.attention.head_count_kv``), and gguf.GGUFReader maps the whole file and builds a numpy
view per vocabulary string (~10 s on a 128k vocabulary). This reads the header in order, with
each value's GGUF type (so the entries can be written again), stopping once it has what was
asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGUF_MAGIC, GGUFValueType

_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class KeyValue:
    """One GGUF metadata entry (``sub_type``: the element type of an array). Strings inside
    arrays stay bytes, as a writer stores them; a lone string value is decoded."""

    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> bytes:
    return f.read(_read(f, "<Q"))


def _value(f: BinaryIO, vtype: GGUFValueType, keep: bool) -> tuple[Any, GGUFValueType | None]:
    """The value (None when not kept: skipped as fast as the format allows) and its array's
    element type."""
    if vtype == GGUFValueType.STRING:
        raw = _string(f)
        return (raw.decode("utf-8", "replace") if keep else None), None
    if vtype == GGUFValueType.ARRAY:
        item = GGUFValueType(_read(f, "<I"))
        count = _read(f, "<Q")
        if item == GGUFValueType.STRING:
            strings = [_string(f) for _ in range(count)]
            return (strings if keep else None), item
        fmt = "<" + _FORMATS[item]
        data = f.read(struct.calcsize(fmt) * count)
        return (list(struct.unpack(f"<{count}{fmt[1:]}", data)) if keep else None), item
    if vtype not in _FORMATS:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return _read(f, "<" + _FORMATS[vtype]), None


def read_entries(path: Path | str, wanted: Callable[[str], bool], *, stop_after: int | None = None) -> list[KeyValue]:
    """The entries whose key ``wanted`` accepts, in file order (at most ``stop_after``)."""
    found: list[KeyValue] = []
    with open(path, "rb") as f:
        if _read(f, "<I") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        _version, _n_tensors, n_kv = _read(f, "<I"), _read(f, "<Q"), _read(f, "<Q")
        for _ in range(n_kv):
            key = _string(f).decode("utf-8", "replace")
            vtype = GGUFValueType(_read(f, "<I"))
            keep = wanted(key)
            value, sub_type = _value(f, vtype, keep)
            if keep:
                found.append(KeyValue(key, value, vtype, sub_type))
                if stop_after is not None and len(found) >= stop_after:
                    break
    return found


def read_keys(path: Path | str, wanted: set[str]) -> dict[str, Any]:
    """The values of the ``wanted`` keys that the file has (scalar arrays as lists)."""
    return {kv.key: kv.value for kv in read_entries(path, wanted.__contains__, stop_after=len(wanted))}
