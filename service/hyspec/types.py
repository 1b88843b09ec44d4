"""The engine's request, event and result types: the narrow interface the CLI and gRPC use."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple


class SpecMode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"  # whichever configured drafter is expected to pay, step by step; none if none does
    DRAFT = "draft"
    NGRAM = "ngram"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token, stop string or stop token id
    LENGTH = "length"  # max_tokens reached or the context is full
    CANCELLED = "cancelled"  # cancelled by the client, a deadline or shutdown


class ErrorCode(str, enum.Enum):
    """Why a request was refused; the gRPC layer maps these to status codes of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class RequestError(Exception):
    """A request the engine will not run, with the status code a client should see."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None  # None: a random seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class SpecParams:
    """Per-request speculation; None fields take the server's defaults."""

    mode: SpecMode | None = None
    draft_min: int | None = None
    draft_max: int | None = None


@dataclass
class GenerationRequest:
    """Exactly one of text, token_ids or chat is the prompt."""

    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[dict[str, str]] | None = None
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    spec: SpecParams = field(default_factory=SpecParams)
    request_id: str = ""


@dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    rollbacks: int = 0
    replayed_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of decoded
    accepted_by_position: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    tokens_per_second: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """Tokens produced by one engine step (speculation emits several) and their text."""

    token_ids: list[int]
    text: str


class BatchShape(NamedTuple):
    """Where a generated token's logits came from: its sequence's segment of ``length``
    tokens at ``offset`` in a decode of ``total`` tokens (llama.cpp's logits depend a little
    on the batch shape; hyspec.exactness reproduces it)."""

    length: int
    offset: int
    total: int


@dataclass
class Trace:
    """How a request's tokens went through llama.cpp (diagnostics for hyspec.exactness): the
    prompt chunks in order (length = offset + 1 = the chunk), and for each generated token the
    shape of the decode whose logits chose it. Consecutive tokens of one decode have
    consecutive offsets."""

    prefill: list[BatchShape] = field(default_factory=list)
    tokens: list[BatchShape] = field(default_factory=list)

    def decodes(self, n_prompt: int, upto: int) -> Iterator[tuple[int, int, int, int]]:
        """The decodes that chose output tokens 1..``upto`` (token 0 came with the prompt), as
        ``(start, end, total, last)``: one fed history positions ``start..end - 1`` (the fed
        token(s) and the drafts it accepted) in a batch of ``total`` tokens and chose tokens up
        to ``last``."""
        j = 1
        while j <= upto:
            shape = self.tokens[j]
            last = j  # one decode's tokens: consecutive offsets in batches of one shape
            while (last + 1 <= upto and self.tokens[last + 1][::2] == shape[::2]
                   and self.tokens[last + 1].offset == self.tokens[last].offset + 1):
                last += 1
            start = n_prompt + j - 1 - shape.offset
            end = n_prompt + last
            yield start, end, max(shape.total, end - start), last
            j = last + 1

    def memory_chunks(self, n_prompt: int, n: int) -> list[BatchShape]:
        """How the memory of the first ``n`` history positions was computed, as prompt chunks
        (the form of ``prefill``): what a prefix cache entry made from this request holds, so
        that a request resuming from it is checked in the shapes that really computed it."""
        spans: list[tuple[int, int, int]] = []  # start, end, total
        for chunk in self.prefill:
            at = spans[-1][1] if spans else 0
            spans.append((at, at + chunk.length, chunk.total))
        for start, end, total, _ in self.decodes(n_prompt, len(self.tokens) - 1):
            while spans and spans[-1][0] >= start:  # positions decoded again (a replay) hold the later values
                spans.pop()
            if spans and spans[-1][1] > start:
                spans[-1] = (spans[-1][0], start, spans[-1][2])
            spans.append((start, end, total))
        return prefix_chunks([BatchShape(end - start, end - start - 1, total) for start, end, total in spans], n)


def prefix_chunks(chunks: list[BatchShape], n: int) -> list[BatchShape]:
    """The prompt chunks (``Trace.prefill`` form) that cover the first ``n`` positions."""
    kept: list[BatchShape] = []
    at = 0
    for chunk in chunks:
        if at >= n:
            break
        length = min(chunk.length, n - at)
        kept.append(BatchShape(length, length - 1, chunk.total))
        at += length
    return kept


@dataclass
class Result:
    """The terminal event of a request. ``trace`` only when the engine records it
    (EngineConfig.record_shapes)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: Stats
    trace: Trace | None = None

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
            "stats": self.stats.to_dict(),
        }
