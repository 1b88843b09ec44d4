"""Failures inside the engine (issue 11, item 10): a failed decode fails only the requests in
it, with INTERNAL; a worker thread that dies fails every request with INTERNAL, turns health
NOT_SERVING and stops the server, whose process then exits non-zero."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hyspec import _native as N
from hyspec.engine import Engine, EngineConfig
from hyspec.types import ErrorCode, GenerationRequest, RequestError
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import TIMEOUT, StreamClient, running, spawn_server, status_of, stop_process

LONG = 400
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def _engine(model: Path) -> Engine:
    return Engine(EngineConfig(model=model, slots=1, ctx=512, threads=2, max_queue=4))


class _FailingDecode:
    """Stands in for the scheduler's context: the next decode raises, then the real context is back."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.real = engine, engine.scheduler.ctx
        self.failed = 0

    def decode(self, *args: Any) -> int:
        self.engine.scheduler.ctx = self.real
        self.failed += 1
        raise N.DecodeError("injected decode failure")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture()
def engine(tiny_lfm2: Path) -> Iterator[Engine]:
    with _engine(tiny_lfm2) as e:
        yield e


def _first_chunk(stream: StreamClient, request_id: str) -> Iterator[Any]:
    responses = iter(stream)
    for msg in responses:
        if msg.request_id == request_id and msg.WhichOneof("kind") == "chunk":
            return responses
    raise AssertionError(f"{request_id} never streamed")


def test_a_failed_decode_fails_only_its_requests(engine: Engine) -> None:
    queued = GenerationRequest(text="queued behind", max_tokens=12, ignore_eos=True)
    expected = engine.generate(queued).token_ids
    with running(engine) as s:
        with grpc.insecure_channel(s.address) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            stream = StreamClient(stub)
            stream.send(request_id="running", text="x", max_tokens=LONG, ignore_eos=True)
            responses = _first_chunk(stream, "running")
            stream.send(request_id="queued", text=queued.text, max_tokens=12, ignore_eos=True)
            time.sleep(0.05)  # in the engine's queue: the only slot is busy
            injected = _FailingDecode(engine)
            engine.scheduler.ctx = injected  # type: ignore[assignment]
            terminal: dict[str, Any] = {}
            for msg in responses:
                if msg.WhichOneof("kind") != "chunk":
                    terminal[msg.request_id] = msg
                    if len(terminal) == 2:
                        stream.half_close()
            assert injected.failed == 1
            assert terminal["running"].error.code == INTERNAL
            assert "injected decode failure" in terminal["running"].error.message
            # The request that was not in the failed decode runs as if nothing happened.
            assert list(terminal["queued"].complete.token_ids) == expected
            assert stream.call.code() == grpc.StatusCode.OK
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            again = stub.Complete(pb2.GenerateRequest(text=queued.text, max_tokens=12, ignore_eos=True),
                                  timeout=TIMEOUT)
            assert list(again.token_ids) == expected


def test_a_dead_worker_fails_everything_and_stops_the_server(engine: Engine) -> None:
    with running(engine) as s:
        with grpc.insecure_channel(s.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stream = StreamClient(pb2_grpc.GenerationStub(channel))
            stream.send(request_id="running", text="x", max_tokens=LONG, ignore_eos=True)
            responses = _first_chunk(stream, "running")
            stream.send(request_id="queued", text="y", max_tokens=4)
            time.sleep(0.05)

            def boom() -> None:
                raise RuntimeError("injected worker failure")

            engine.scheduler._admit = boom  # type: ignore[method-assign]  # raised outside a decode step
            terminal: dict[str, Any] = {}
            with pytest.raises(grpc.RpcError) as ended:  # the server stops: the open stream ends UNAVAILABLE
                for msg in responses:
                    if msg.WhichOneof("kind") != "chunk":
                        terminal[msg.request_id] = msg
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            stream.half_close()
            assert {rid: m.error.code for rid, m in terminal.items()} == {"running": INTERNAL, "queued": INTERNAL}
            assert "injected worker failure" in terminal["running"].error.message
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(RuntimeError, match="the engine failed: injected worker failure"):
            s.call(s.server.wait_closed())
    with pytest.raises(RequestError) as err:
        engine.submit(GenerationRequest(text="x", max_tokens=2))
    assert err.value.code is ErrorCode.UNAVAILABLE


_DYING_SERVER = textwrap.dedent("""
    import sys
    from hyspec.scheduler import Scheduler

    admit = Scheduler._admit
    admitted = [0]

    def failing_admit(self):
        admitted[0] += bool(self.waiting)
        if admitted[0] > 1:  # the warm-up runs; the first client request kills the worker
            raise RuntimeError("injected worker failure")
        admit(self)

    Scheduler._admit = failing_admit
    from hyspec.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_the_process_exits_non_zero_when_the_engine_dies(tiny_lfm2: Path) -> None:
    proc, address = spawn_server(tiny_lfm2, launcher=("-c", _DYING_SERVER))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            request = pb2.GenerateRequest(text="x", max_tokens=4)
            assert status_of(lambda: stub.Complete(request, timeout=TIMEOUT)) == grpc.StatusCode.INTERNAL
        assert proc.wait(TIMEOUT) == 1
        _, err = proc.communicate()
        assert "the engine failed: injected worker failure" in err
    finally:
        stop_process(proc)
