"""Fuzzing every request field through the real gRPC server (issue 11): whatever a client
sends gets a defined status, the server stays healthy, and afterwards a normal request gives
the same tokens as it did on the fresh server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hyspec.engine import Engine, EngineConfig
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import ThreadServer, running

CALL_TIMEOUT = 20.0
INT32 = st.integers(-(2**31), 2**31 - 1)
# What a request may end with: anything else (UNKNOWN, INTERNAL, a hang) is a bug.
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
NORMAL = pb2.GenerateRequest(request_id="normal", text="The capital of France is", max_tokens=16, ignore_eos=True)

# Protobuf strings are UTF-8: surrogates cannot be sent at all.
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
small_or_extreme = st.one_of(st.integers(-3, 8), st.sampled_from([0, -(2**31), 2**31 - 1, 64, 200]))


ids = st.one_of(st.integers(0, 200_000), INT32)
# Each field: a value a well-behaved client might send, and anything at all.
FIELDS: dict[str, tuple[Any, Any]] = {
    "request_id": (st.text("abcdefgh0123456789-", min_size=1, max_size=12),
                   st.one_of(texts, st.text("x", min_size=250, max_size=300))),
    "prompt": (st.one_of(st.tuples(st.just("text"), st.text("abc def.,", min_size=1, max_size=30)),
                         st.tuples(st.just("token_ids"), st.lists(st.integers(0, 5000), min_size=1, max_size=20))),
               st.one_of(st.none(), st.tuples(st.just("text"), texts), st.tuples(st.just("token_ids"),
                                                                                 st.lists(ids, max_size=40)),
                         st.tuples(st.just("chat"), st.lists(st.tuples(
                             st.one_of(st.sampled_from(["user", "system", "assistant"]), texts), texts),
                             max_size=4)))),
    "max_tokens": (st.integers(1, 8), st.one_of(st.integers(-3, 8), st.sampled_from([0, -(2**31), 2**31 - 1, 200]))),
    "temperature": (st.one_of(st.none(), st.floats(0, 2)), floats),
    "top_k": (st.one_of(st.none(), st.integers(0, 50)), INT32),
    "top_p": (st.one_of(st.none(), st.floats(0.05, 1)), floats),
    "min_p": (st.one_of(st.none(), st.floats(0, 1)), floats),
    "repeat_penalty": (st.one_of(st.none(), st.floats(0.5, 2)), floats),
    "frequency_penalty": (st.one_of(st.none(), st.floats(-1, 1)), floats),
    "presence_penalty": (st.one_of(st.none(), st.floats(-1, 1)), floats),
    "penalty_last_n": (st.one_of(st.none(), st.integers(-1, 64)), INT32),
    "seed": (st.one_of(st.none(), st.integers(0, 2**32 - 1)), st.integers(0, 2**32 - 1)),
    "stop": (st.lists(st.text("abc ", min_size=1, max_size=4), max_size=3),
             st.lists(st.one_of(texts, st.text("y", min_size=250, max_size=300)), max_size=18)),
    "stop_token_ids": (st.lists(st.integers(0, 5000), max_size=3), st.lists(ids, max_size=18)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "spec_mode": (st.sampled_from([0, 1, 3]), st.integers(-2, 6)),
    "draft_min": (st.one_of(st.none(), st.integers(0, 2)), INT32),
    "draft_max": (st.one_of(st.none(), st.integers(2, 8)), INT32),
}


@st.composite
def generate_requests(draw: Any) -> Any:
    """Mostly sane requests with a few fields (sometimes none, sometimes all) set to anything."""
    wild = draw(st.one_of(st.sets(st.sampled_from(sorted(FIELDS)), max_size=3), st.just(set(FIELDS))))
    value = {name: draw(FIELDS[name][name in wild]) for name in FIELDS}
    msg = pb2.GenerateRequest(request_id=value.pop("request_id"), max_tokens=value.pop("max_tokens"))
    prompt = value.pop("prompt")
    if prompt is not None and prompt[0] == "text":
        msg.text = prompt[1]
    elif prompt is not None and prompt[0] == "token_ids":
        msg.token_ids.ids.extend(prompt[1])
    elif prompt is not None:
        msg.chat.SetInParent()
        for role, content in prompt[1]:
            msg.chat.messages.add(role=role, content=content)
    msg.stop.extend(value.pop("stop"))
    msg.stop_token_ids.extend(value.pop("stop_token_ids"))
    for name, v in value.items():
        if v is not None:
            setattr(msg, name, v)
    return msg


actions = st.one_of(
    st.tuples(st.just("complete"), generate_requests()),
    st.tuples(st.just("stream"), generate_requests()),
    st.tuples(st.just("tokenize"), st.builds(pb2.TokenizeRequest, text=texts, add_special=st.booleans(),
                                             parse_special=st.booleans())),
    st.tuples(st.just("detokenize"), st.builds(pb2.DetokenizeRequest,
                                               token_ids=st.lists(st.one_of(st.integers(0, 200_000), INT32),
                                                                  max_size=40))),
    st.tuples(st.just("raw"), st.tuples(st.sampled_from(["Complete", "Generate", "Tokenize", "Detokenize"]),
                                        st.binary(max_size=120))),
)


@pytest.fixture(scope="module")
def server(tiny_lfm2: Path) -> Iterator[ThreadServer]:
    with Engine(EngineConfig(model=tiny_lfm2, slots=2, ctx=128, threads=2, max_queue=4)) as engine:
        with running(engine) as s:
            yield s


@pytest.fixture(scope="module")
def channel(server: ThreadServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as chan:
        yield chan


def _unary_status(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _stream(stub: Any, request: Any) -> grpc.StatusCode:
    """One request on a stream, then a cancel of a random id and half-close: exactly one
    terminal message for it, with a defined code, and the stream ends OK."""
    messages = [pb2.GenerateStreamRequest(request=request),
                pb2.GenerateStreamRequest(cancel=pb2.CancelRequest(request_id=request.request_id + "?"))]
    terminal = []
    for msg in stub.Generate(iter(messages), timeout=CALL_TIMEOUT):
        assert msg.WhichOneof("kind") in ("chunk", "complete", "error")
        if msg.WhichOneof("kind") != "chunk":
            terminal.append(msg)
    assert len(terminal) == 1, terminal
    if terminal[0].WhichOneof("kind") == "error":
        return grpc.StatusCode(next(c.value for c in grpc.StatusCode if c.value[0] == terminal[0].error.code))
    return grpc.StatusCode.OK


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(action=actions)
def _fuzz(channel: grpc.Channel, counter: list[int], action: tuple[str, Any]) -> None:
    kind, payload = action
    stub = pb2_grpc.GenerationStub(channel)
    if kind == "complete":
        status = _unary_status(lambda: stub.Complete(payload, timeout=CALL_TIMEOUT))
    elif kind == "stream":
        status = _stream(stub, payload)
    elif kind == "tokenize":
        status = _unary_status(lambda: stub.Tokenize(payload, timeout=CALL_TIMEOUT))
    elif kind == "detokenize":
        status = _unary_status(lambda: stub.Detokenize(payload, timeout=CALL_TIMEOUT))
    else:
        method, data = payload
        path = f"/hyspec.v1.Generation/{method}"
        if method == "Generate":
            call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            status = _unary_status(lambda: list(call(iter([data]), timeout=CALL_TIMEOUT)))
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            status = _unary_status(lambda: call(data, timeout=CALL_TIMEOUT))
    assert status in DEFINED, (kind, status)
    counter[0] += 1


def test_any_message_gets_a_defined_status_and_the_server_stays_exact(channel: grpc.Channel) -> None:
    stub = pb2_grpc.GenerationStub(channel)
    fresh = list(stub.Complete(NORMAL, timeout=CALL_TIMEOUT).token_ids)
    counter = [0]
    _fuzz(channel, counter)
    assert counter[0] >= 200
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert list(stub.Complete(NORMAL, timeout=CALL_TIMEOUT).token_ids) == fresh
    stream = list(stub.Generate(iter([pb2.GenerateStreamRequest(request=NORMAL)]), timeout=CALL_TIMEOUT))
    assert list(stream[-1].complete.token_ids) == fresh
