"""Limits on every input (issue 11, items 1-9): each a `hyspec serve` flag with an environment
twin and a default; each refusal has its status, and none of them costs the server much."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hyspec.cli import LIMIT_FLAGS, build_parser
from hyspec.engine import Engine, EngineConfig
from hyspec.limits import Limits
from hyspec.output import OutputStream
from hyspec.types import ErrorCode, FinishReason, GenerationRequest, RequestError
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import TIMEOUT, StreamClient, ThreadServer, running, status_of

CTX = 512
SMALL = Limits(max_request_id_bytes=16, max_prompt_bytes=64, max_stops=2, max_stop_bytes=8,
               stream_buffer_bytes=2048, max_streams=3, max_message_bytes=4096)
INVALID, OUT_OF_RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


@pytest.fixture(scope="module")
def engine(tiny_lfm2_echo: Path) -> Iterator[Engine]:
    """The echo model repeats itself: repetition penalties change what it writes."""
    with Engine(EngineConfig(model=tiny_lfm2_echo, slots=2, ctx=CTX, threads=2, max_queue=2)) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ThreadServer]:
    with running(engine, limits=SMALL) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: ThreadServer) -> Iterator[Any]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb2_grpc.GenerationStub(channel)


def _complete(stub: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 4)
    return stub.Complete(pb2.GenerateRequest(**kwargs), timeout=TIMEOUT)


def _refusal(stub: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        _complete(stub, **kwargs)
    return err.value.code(), err.value.details() or ""


# 1 ------------------------------------------------------------------------------------------------


def test_penalty_last_n_is_bounded_by_the_context(engine: Engine, stub: Any) -> None:
    start = time.monotonic()
    code, message = _refusal(stub, text="x", repeat_penalty=1.1, penalty_last_n=2**31 - 1)
    assert code == INVALID and f"{CTX}" in message and time.monotonic() - start < 2.0
    assert _refusal(stub, text="x", repeat_penalty=1.1, penalty_last_n=-2)[0] == INVALID
    penalized = {"text": "a b a b a b", "max_tokens": 12, "ignore_eos": True, "repeat_penalty": 1.5}
    whole = _complete(stub, penalty_last_n=CTX, **penalized)
    # -1 is "the whole context" (llama.cpp alone would read it as 0: no penalty at all).
    assert list(_complete(stub, penalty_last_n=-1, **penalized).token_ids) == list(whole.token_ids)
    off = engine.generate(GenerationRequest(text="a b a b a b", max_tokens=12, ignore_eos=True))
    assert list(whole.token_ids) != off.token_ids


# 2 ------------------------------------------------------------------------------------------------


def test_request_id_length_is_bounded(stub: Any) -> None:
    assert _refusal(stub, request_id="x" * 17, text="x")[0] == INVALID
    assert _refusal(stub, request_id="é" * 9, text="x")[0] == INVALID  # 18 bytes
    assert _complete(stub, request_id="é" * 8, text="x").request_id == "é" * 8
    stream = StreamClient(stub)
    stream.send(request_id="y" * 1000, text="x", max_tokens=2)
    stream.half_close()
    (msg,) = list(stream)
    assert msg.error.code == INVALID.value[0] and "--max-request-id-bytes" in msg.error.message
    assert msg.request_id == "y" * 16  # echoed, cut to the limit


def test_a_client_that_does_not_read_fails_its_request_not_the_server(server: ThreadServer, stub: Any) -> None:
    """Chunks wait in the stream's buffer while the client does not read; past
    --stream-buffer-bytes the request fails with RESOURCE_EXHAUSTED and its slot is freed."""
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.address, options=small_window) as channel:
        stream = StreamClient(pb2_grpc.GenerationStub(channel))
        stream.send(request_id="r" * 16, text="x", max_tokens=CTX - 8, ignore_eos=True)
        time.sleep(1.5)  # not reading: the transport window fills, then the server's buffer
        # Both slots are free again (the request was stopped), while the stream stays unread.
        for _ in range(2):
            assert len(_complete(stub, text="x", max_tokens=2, ignore_eos=True).token_ids) == 2
        messages = []
        stream.half_close()
        for msg in stream:
            messages.append(msg)
    assert stream.call.code() == grpc.StatusCode.OK
    final = messages[-1]
    assert final.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], final
    assert "--stream-buffer-bytes" in final.error.message
    streamed = sum(len(m.chunk.token_ids) for m in messages if m.WhichOneof("kind") == "chunk")
    assert 0 < streamed < CTX - 8


# 5 ------------------------------------------------------------------------------------------------


def test_cancelled_requests_do_not_count_as_queued(tiny_lfm2: Path) -> None:
    with Engine(EngineConfig(model=tiny_lfm2, slots=1, ctx=CTX, threads=2, max_queue=1)) as engine:
        for _ in range(3):
            live = [engine.submit(GenerationRequest(text="x", max_tokens=CTX - 8, ignore_eos=True)) for _ in range(2)]
            with pytest.raises(RequestError) as full:
                engine.submit(GenerationRequest(text="x", max_tokens=2))
            assert full.value.code is ErrorCode.RESOURCE_EXHAUSTED
            for handle in live:
                handle.cancel()
            # At once, before the worker has even seen the cancels.
            after = engine.submit(GenerationRequest(text="x", max_tokens=2, ignore_eos=True))
            assert after.result().finish_reason is FinishReason.LENGTH
            assert all(h.result().finish_reason is FinishReason.CANCELLED for h in live)


# 6 ------------------------------------------------------------------------------------------------


def test_prompt_size_is_bounded_before_tokenizing(stub: Any) -> None:
    assert _refusal(stub, text="x" * 65)[0] == OUT_OF_RANGE
    assert _refusal(stub, text="é" * 33)[0] == OUT_OF_RANGE  # 66 bytes
    assert len(_complete(stub, text="x" * 64).token_ids) > 0
    chat = pb2.Chat(messages=[pb2.ChatMessage(role="user", content="x" * 40)] * 2)
    code, message = _refusal(stub, chat=chat)
    assert code == OUT_OF_RANGE and "--max-prompt-bytes" in message
    assert status_of(lambda: stub.Tokenize(pb2.TokenizeRequest(text="x" * 65), timeout=TIMEOUT)) == OUT_OF_RANGE
    assert _refusal(stub, token_ids=pb2.TokenIds(ids=[5] * (CTX + 1)))[0] == OUT_OF_RANGE
    # Larger than --max-message-bytes: gRPC itself refuses it.
    assert _refusal(stub, text="x", stop_token_ids=[1] * 5000)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_tokenizing_runs_off_the_event_loop(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a Tokenize (or a Complete's prompt) is being tokenized, health still answers.

    The tokenizer is held at a gate until a health check has answered: were tokenizing on the
    event loop, that check could not be served and would run into its deadline."""
    inside, release = threading.Event(), threading.Event()
    tokenize = engine.tokenize

    def gated(text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        inside.set()
        release.wait(TIMEOUT)
        return tokenize(text, add_special=add_special, parse_special=parse_special)

    monkeypatch.setattr(engine, "tokenize", gated)
    big = Limits(max_prompt_bytes=4 << 20, max_message_bytes=8 << 20)
    with running(engine, limits=big) as s:
        text = "The quick brown fox jumps over the lazy dog. " * 70000
        with grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            calls = ((lambda: stub.Tokenize.future(pb2.TokenizeRequest(text=text), timeout=TIMEOUT),
                      grpc.StatusCode.OK),
                     # Tokenized, then refused: 700k tokens do not fit the context.
                     (lambda: stub.Complete.future(pb2.GenerateRequest(text=text, max_tokens=1), timeout=TIMEOUT),
                      OUT_OF_RANGE))
            for call, status in calls:
                inside.clear()
                release.clear()
                future = call()
                try:
                    assert inside.wait(TIMEOUT), "the request never reached the tokenizer"
                    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING
                    assert not future.done()
                finally:
                    release.set()
                assert future.code() == status, future.details()
            assert len(stub.Tokenize(pb2.TokenizeRequest(text=text), timeout=TIMEOUT).token_ids) > 600000


# 7 ------------------------------------------------------------------------------------------------


def test_stop_strings_are_bounded(stub: Any) -> None:
    code, message = _refusal(stub, text="x", stop=["a", "b", "c"])
    assert code == INVALID and "--max-stops" in message
    code, message = _refusal(stub, text="x", stop=["123456789"])
    assert code == INVALID and "--max-stop-bytes" in message
    assert _refusal(stub, text="x", stop_token_ids=[1, 2, 3])[0] == INVALID
    assert _complete(stub, text="x", stop=["12345678", "z"], stop_token_ids=[1, 2]).finish_reason


class _Pieces:
    """A model stand-in whose token t is the text pieces[t]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def is_eog(self, token: int) -> bool:
        return False

    def token_to_piece(self, token: int) -> bytes:
        return self.pieces[token].encode()


def test_stop_strings_match_in_time_independent_of_their_count() -> None:
    """300k stop strings used to cost 0.34 s per token; matching is now one automaton step per
    character, however many there are."""
    pieces = [f"word{i} " for i in range(500)]
    many = [f"stop{i:06d}" for i in range(300_000)] + ["word499"]

    def run(stops: list[str]) -> tuple[float, OutputStream]:
        out = OutputStream(_Pieces(pieces), max_tokens=1000, stop=stops, stop_token_ids=[],  # type: ignore[arg-type]
                           ignore_eos=True)
        start = time.perf_counter()
        for token in range(500):
            if out.push(token) is not None:
                break
        return time.perf_counter() - start, out

    # Best of three: the machine is shared, and one preemption is longer than the whole loop.
    (one_time, one), (many_time, crowd) = (min((run(stops) for _ in range(3)), key=lambda r: r[0])
                                           for stops in (["word499"], many))
    assert one.text == crowd.text == "".join(pieces[:499])
    assert many_time < max(10 * one_time, 0.05), (one_time, many_time)


# 9 ------------------------------------------------------------------------------------------------


def test_open_streams_are_bounded(server: ThreadServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb2_grpc.GenerationStub(channel)
        held = [StreamClient(stub) for _ in range(SMALL.max_streams)]
        deadline = time.monotonic() + TIMEOUT
        while len(server.server._rt.streams) < SMALL.max_streams:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = StreamClient(stub)
        extra.half_close()
        with pytest.raises(grpc.RpcError) as err:
            list(extra)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in (err.value.details() or "")
        for stream in held:
            stream.half_close()
            assert list(stream) == []


def test_concurrent_calls_per_connection_are_bounded(engine: Engine) -> None:
    with running(engine, limits=Limits(max_streams_per_connection=2)) as s:
        request = pb2.GenerateRequest(text="x", max_tokens=2)
        own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each (grpc shares them otherwise)
        with grpc.insecure_channel(s.address, options=own) as crowded, \
                grpc.insecure_channel(s.address, options=own) as other:
            stub = pb2_grpc.GenerationStub(crowded)
            held = [StreamClient(stub) for _ in range(2)]
            for stream in held:  # both streams are open once they answer a request
                stream.send(request_id="r", text="x", max_tokens=1)
                assert any(m.WhichOneof("kind") == "complete" for m in stream.call)
            # A third call on that connection waits for one of the two to end.
            assert status_of(lambda: stub.Complete(request, timeout=1.0)) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert pb2_grpc.GenerationStub(other).Complete(request, timeout=TIMEOUT).token_ids  # others are served
            waiting = stub.Complete.future(request, timeout=TIMEOUT)
            time.sleep(0.2)
            assert not waiting.done()
            held[0].half_close()
            assert list(held[0].call) == []
            assert waiting.result().token_ids
            held[1].half_close()
            assert list(held[1].call) == []


# flags ---------------------------------------------------------------------------------------------


def test_every_limit_is_a_flag_with_an_env_twin_and_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    defaults = parser.parse_args(["serve"])
    assert {name: getattr(defaults, name) for name in LIMIT_FLAGS} == vars(Limits())
    for i, name in enumerate(LIMIT_FLAGS):
        monkeypatch.setenv("HYSPEC_" + name.upper(), str(1000 + i))
    from_env = parser.parse_args(["serve"])
    assert {name: getattr(from_env, name) for name in LIMIT_FLAGS} == \
        {name: 1000 + i for i, name in enumerate(LIMIT_FLAGS)}
    flag = parser.parse_args(["serve", "--max-prompt-bytes", "7"])
    assert flag.max_prompt_bytes == 7 and flag.max_stops == 1000 + list(LIMIT_FLAGS).index("max_stops")


def test_a_bad_limit_is_a_one_line_error() -> None:
    env = {**os.environ, "HYSPEC_MAX_STOPS": "0"}
    proc = subprocess.run([sys.executable, "-m", "hyspec", "serve", "--max-prompt-bytes", "-3"], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--max-prompt-bytes" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hyspec", "serve"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 2 and "HYSPEC_MAX_STOPS" in proc.stderr


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_stops"):
        Limits(max_stops=0)
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_message_bytes=-1)
