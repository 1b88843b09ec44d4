"""Logging: text or JSON lines, client-chosen strings escaped, llama.cpp's own log passed on.

Request log lines carry their fields as ``extra`` (request_id, method, status, tokens,
timings); the JSON formatter writes them as keys, the text formatter leaves them in the
message. Neither ever holds a prompt, an output or a token.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The request fields a JSON line carries when a log call passes them as ``extra``.
FIELDS = ("request_id", "method", "status", "prompt_tokens", "completion_tokens", "drafted", "accepted",
          "rollbacks", "ttft_ms", "duration_ms", "tokens_per_second", "finish_reason", "peer", "cached_tokens",
          "cache_mb", "cache_hit_rate")

LLAMA_LOG = logging.getLogger("hyspec.llama")
_OURS = "_hyspec_handler"
# llama.cpp's levels (0 debug .. 3 error) as Python's: its INFO is a page per model load, so it
# shows with --log-level debug.
_LLAMA_TO_PYTHON = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.WARNING, 3: logging.ERROR}


def printable(text: str, limit: int = 256) -> str:
    """``text`` safe for a one-line log: control and other non-printable characters escaped
    (a newline cannot forge a log line), cut to ``limit`` characters."""
    cut = text[:limit]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return cut + ("..." if len(text) > limit else "")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the request fields given."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=True, default=str)


def configure(level: str, fmt: str = "text", *, stream: Any = None) -> None:
    """Root logging for a command: ``level`` (debug/info/warning/error) and ``fmt`` (text or
    json) to stderr, replacing the handler an earlier call installed; llama.cpp's log follows
    the level."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _OURS, False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    bridge_llama_log(level)


def _forward(level: int, message: str) -> None:
    LLAMA_LOG.log(_LLAMA_TO_PYTHON.get(level, logging.INFO), "%s", message)


def bridge_llama_log(level: str) -> None:
    """Send llama.cpp's log messages to the ``hyspec.llama`` logger: all of them at ``debug``
    (llama.cpp's info and debug lines as DEBUG), warnings and errors otherwise."""
    from hyspec import _native

    threshold = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}.get(level.lower(), "warn")
    _native.set_log_handler(_forward)
    _native.set_log_level(threshold)
