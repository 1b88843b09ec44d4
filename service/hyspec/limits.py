"""Bounds on what one client may ask of the server (docs/operations.md has the table).

Every limit is a `hyspec serve` flag with an environment twin; the defaults are generous for
ordinary use and keep one client from hurting the others. The request checks here run on the
event loop before anything costly (tokenizing, building lists from repeated fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyspec.types import ErrorCode, RequestError

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Limits:
    """Server-side limits; ``hyspec serve --help`` lists each with its flag."""

    # Longest request_id, in UTF-8 bytes (ids are copied into every chunk of their request).
    max_request_id_bytes: int = 256
    # Largest text prompt (or Tokenize text) in UTF-8 bytes, and largest chat prompt (its encoded
    # size), checked before tokenizing.
    max_prompt_bytes: int = MIB
    # Most stop strings and most stop token ids per request (each).
    max_stops: int = 16
    # Longest stop string, in UTF-8 bytes.
    max_stop_bytes: int = 256
    # Output a Generate stream may hold for a client that does not read; past it the request
    # whose chunk overflows fails with RESOURCE_EXHAUSTED (its slot is freed).
    stream_buffer_bytes: int = MIB
    # Generate streams open at once, over all connections.
    max_streams: int = 256
    # Concurrent RPCs per HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS); a client that
    # opens more waits in its own transport until one ends.
    max_streams_per_connection: int = 64
    # Largest request message gRPC accepts (larger: RESOURCE_EXHAUSTED from gRPC itself).
    max_message_bytes: int = 4 * MIB

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")

    def grpc_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_concurrent_streams", self.max_streams_per_connection),
                ("grpc.max_receive_message_length", self.max_message_bytes)]

    # -- requests ---------------------------------------------------------------------------

    def check_request_id(self, request_id: str) -> None:
        size = len(request_id.encode("utf-8", "surrogatepass"))
        if size > self.max_request_id_bytes:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"request_id is {size} bytes long; the server accepts at "
                               f"most {self.max_request_id_bytes} (--max-request-id-bytes)")

    def check_text(self, text: str, what: str = "the prompt") -> None:
        # A str's UTF-8 size is at most 4 bytes per character: most texts need no encoding.
        if len(text) * 4 > self.max_prompt_bytes:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > self.max_prompt_bytes:
                raise RequestError(ErrorCode.OUT_OF_RANGE, f"{what} is {size} bytes; the server accepts at most "
                                   f"{self.max_prompt_bytes} (--max-prompt-bytes)")

    def check_generate(self, msg: Any, n_ctx: int) -> None:
        """A hyspec.v1.GenerateRequest within the limits (raises RequestError). ``n_ctx``: the
        tokens a slot holds, which bounds a token-id prompt before it is copied."""
        self.check_request_id(msg.request_id)
        prompt = msg.WhichOneof("prompt")
        if prompt == "text":
            self.check_text(msg.text)
        elif prompt == "chat":
            size = msg.chat.ByteSize()
            if size > self.max_prompt_bytes:
                raise RequestError(ErrorCode.OUT_OF_RANGE, f"the chat prompt is {size} bytes; the server accepts at "
                                   f"most {self.max_prompt_bytes} (--max-prompt-bytes)")
        elif prompt == "token_ids" and len(msg.token_ids.ids) > n_ctx:
            raise RequestError(ErrorCode.OUT_OF_RANGE,
                               f"the prompt has {len(msg.token_ids.ids)} tokens; the context holds {n_ctx}")
        for field in ("stop", "stop_token_ids"):
            n = len(getattr(msg, field))
            if n > self.max_stops:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{n} {field}: the server accepts at most "
                                   f"{self.max_stops} (--max-stops)")
        for stop in msg.stop:
            size = len(stop.encode("utf-8", "surrogatepass"))
            if size > self.max_stop_bytes:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"a stop string of {size} bytes: the server accepts "
                                   f"at most {self.max_stop_bytes} (--max-stop-bytes)")


def utf8_prefix(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding fits in ``max_bytes``."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", "ignore")
