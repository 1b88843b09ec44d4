"""Conversions between the hyspec.v1 protobuf messages and the engine's types."""

from __future__ import annotations

from typing import Any

import grpc

from hyspec.types import (
    Chunk,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    RequestError,
    Result,
    SamplingParams,
    SpecMode,
    SpecParams,
    Stats,
)

# Generated from proto/ at build time (CMakeLists.txt).
from hyspec.v1 import hyspec_pb2 as pb2

DEFAULT_MAX_TOKENS = GenerationRequest().max_tokens

_SPEC_FROM_PROTO: dict[int, SpecMode | None] = {
    pb2.SPEC_MODE_UNSPECIFIED: None,
    pb2.SPEC_MODE_OFF: SpecMode.OFF,
    pb2.SPEC_MODE_DRAFT: SpecMode.DRAFT,
    pb2.SPEC_MODE_NGRAM: SpecMode.NGRAM,
    pb2.SPEC_MODE_AUTO: SpecMode.AUTO,
}
_SPEC_TO_PROTO: dict[SpecMode, int] = {mode: value for value, mode in _SPEC_FROM_PROTO.items() if mode}

_FINISH_TO_PROTO: dict[FinishReason, int] = {
    FinishReason.STOP: pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb2.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {value: reason for reason, value in _FINISH_TO_PROTO.items()}

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                    "presence_penalty", "penalty_last_n", "seed")


def _invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, message)


# ---- requests -------------------------------------------------------------------------------


def request_from_proto(msg: Any) -> GenerationRequest:
    """A GenerateRequest as the engine's GenerationRequest. Raises RequestError
    (INVALID_ARGUMENT) for what the proto layer can tell is wrong; the engine checks the rest."""
    request = GenerationRequest(request_id=msg.request_id)
    prompt = msg.WhichOneof("prompt")
    if prompt is None:
        raise _invalid("no prompt: set one of text, token_ids or chat")
    if prompt == "text":
        request.text = msg.text
    elif prompt == "token_ids":
        request.token_ids = list(msg.token_ids.ids)
    else:
        request.chat = [{"role": m.role, "content": m.content} for m in msg.chat.messages]

    if msg.max_tokens < 0:
        raise _invalid(f"max_tokens must not be negative (got {msg.max_tokens})")
    request.max_tokens = msg.max_tokens or DEFAULT_MAX_TOKENS

    # Only the fields the client set override the engine's defaults (proto3 `optional`).
    sampling = SamplingParams()
    for name in _SAMPLING_FIELDS:
        if msg.HasField(name):
            setattr(sampling, name, getattr(msg, name))
    request.sampling = sampling

    request.stop = list(msg.stop)
    request.stop_token_ids = list(msg.stop_token_ids)
    request.ignore_eos = msg.ignore_eos

    if msg.spec_mode not in _SPEC_FROM_PROTO:
        raise _invalid(f"unknown spec_mode {msg.spec_mode}")
    request.spec = SpecParams(
        mode=_SPEC_FROM_PROTO[msg.spec_mode],
        draft_min=msg.draft_min if msg.HasField("draft_min") else None,
        draft_max=msg.draft_max if msg.HasField("draft_max") else None,
    )
    return request


def request_to_proto(request: GenerationRequest) -> Any:
    """The engine's GenerationRequest as a GenerateRequest (for clients)."""
    msg = pb2.GenerateRequest(request_id=request.request_id, max_tokens=request.max_tokens,
                              stop=request.stop, stop_token_ids=request.stop_token_ids,
                              ignore_eos=request.ignore_eos)
    if request.text is not None:
        msg.text = request.text
    elif request.token_ids is not None:
        msg.token_ids.ids.extend(request.token_ids)
    elif request.chat is not None:
        msg.chat.SetInParent()  # an empty conversation is still "the chat prompt"
        for m in request.chat:
            msg.chat.messages.add(role=m.get("role", ""), content=m.get("content", ""))
    defaults = SamplingParams()
    for name in _SAMPLING_FIELDS:
        value = getattr(request.sampling, name)
        if value is not None and value != getattr(defaults, name):
            setattr(msg, name, value)
    if request.spec.mode is not None:
        msg.spec_mode = _SPEC_TO_PROTO[SpecMode(request.spec.mode)]
    if request.spec.draft_min is not None:
        msg.draft_min = request.spec.draft_min
    if request.spec.draft_max is not None:
        msg.draft_max = request.spec.draft_max
    return msg


# ---- results --------------------------------------------------------------------------------


def chunk_to_proto(chunk: Chunk) -> Any:
    return pb2.Chunk(token_ids=chunk.token_ids, text=chunk.text)


_STATS_FIELDS = frozenset(pb2.Stats.DESCRIPTOR.fields_by_name)


def stats_to_proto(stats: Stats) -> Any:
    # Only the fields the proto knows: an engine counter added later must not break the server.
    return pb2.Stats(**{k: v for k, v in stats.to_dict().items() if k in _STATS_FIELDS})


def result_to_proto(result: Result, request_id: str) -> Any:
    return pb2.GenerateResponse(request_id=request_id, text=result.text, token_ids=result.token_ids,
                                finish_reason=_FINISH_TO_PROTO[result.finish_reason],
                                stats=stats_to_proto(result.stats))


def result_from_proto(msg: Any) -> Result:
    s = msg.stats
    stats = Stats(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, drafted=s.drafted,
                  accepted=s.accepted, verify_steps=s.verify_steps, rollbacks=s.rollbacks,
                  replayed_tokens=s.replayed_tokens, cached_tokens=s.cached_tokens,
                  accepted_by_position=list(s.accepted_by_position),
                  ttft_ms=s.ttft_ms, tokens_per_second=s.tokens_per_second)
    if msg.finish_reason not in _FINISH_FROM_PROTO:
        raise ValueError(f"response without a finish reason ({msg.finish_reason})")
    return Result(text=msg.text, token_ids=list(msg.token_ids),
                  finish_reason=_FINISH_FROM_PROTO[msg.finish_reason], stats=stats)


# ---- errors and model info ------------------------------------------------------------------


def status_code(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status of an engine error code (they share their names)."""
    return grpc.StatusCode[code.value]


def error_to_proto(code: grpc.StatusCode, message: str) -> Any:
    return pb2.Error(code=code.value[0], message=message)


_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_from_number(number: int) -> grpc.StatusCode:
    """The gRPC status with this number (Error.code), UNKNOWN for numbers grpc does not know."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_code(code: grpc.StatusCode) -> ErrorCode:
    """The engine error code closest to a gRPC status (for clients raising RequestError)."""
    try:
        return ErrorCode[code.name]
    except KeyError:
        return ErrorCode.INTERNAL


def model_info_to_proto(info: dict[str, Any], max_queue: int | None) -> Any:
    def describe(model: dict[str, Any] | None) -> Any:
        if model is None:
            return None
        return pb2.ModelDescription(path=str(model.get("path", "")), arch=model.get("arch", ""),
                                    is_hybrid=bool(model.get("is_hybrid")),
                                    is_recurrent=bool(model.get("is_recurrent")),
                                    n_vocab=model.get("n_vocab", 0), n_ctx_train=model.get("n_ctx_train", 0),
                                    gpu_layers=model.get("gpu_layers", 0))

    msg = pb2.ModelInfo(target=describe(info.get("target")), draft=describe(info.get("draft")),
                        ctx=info.get("ctx", 0), slots=info.get("slots", 0),
                        spec_modes=[_SPEC_TO_PROTO[SpecMode(m)] for m in info.get("spec_modes", [])],
                        rollback=str(info.get("rollback", "")), version=str(info.get("version", "")))
    if info.get("default_spec"):
        msg.default_spec = _SPEC_TO_PROTO[SpecMode(info["default_spec"])]
    if max_queue is not None:
        msg.max_queue = max_queue
    return msg
