"""Helpers shared by the tests that talk to a real server: an in-process server on its own
event loop, a Generate stream fed from the test, a `hyspec serve` subprocess, status codes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hyspec.server import HyspecServer
from hyspec.v1 import hyspec_pb2 as pb2

TIMEOUT = 30.0  # generous per-call timeout: a hang fails instead of stalling the suite


# A client that starts a long request on a stream, prints "streaming" at its first chunk and then
# neither reads nor half-closes: kill it to see the server notice.
KILLED_CLIENT = """
import sys
import time

import grpc

from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc

def requests():
    yield pb2.GenerateStreamRequest(request=pb2.GenerateRequest(
        request_id="victim", text="x", max_tokens=int(sys.argv[2]), ignore_eos=True))
    time.sleep(3600)  # never half-closes

channel = grpc.insecure_channel(sys.argv[1])
for msg in pb2_grpc.GenerationStub(channel).Generate(requests()):
    print("streaming", flush=True)
    time.sleep(3600)  # stops reading, holds the slot
"""


class ThreadServer:
    """A HyspecServer on its own event loop in a background thread."""

    def __init__(self, source: Any, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-server", daemon=True)
        self.thread.start()
        kwargs.setdefault("host", "127.0.0.1")

        async def start() -> HyspecServer:
            server = HyspecServer(source, announce=False, **kwargs)
            await server.start()
            return server

        try:
            self.server = self.call(start())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            raise

    def call(self, coro: Any, timeout: float = TIMEOUT) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return self.server.address

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        async def ready() -> None:
            await asyncio.wait_for(self.server.ready.wait(), timeout)

        self.call(ready(), timeout + 1)

    def stop(self, grace: float = 0.0) -> None:
        async def stop() -> None:
            await self.server.shutdown(grace)

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def running(source: Any, **kwargs: Any) -> Iterator[ThreadServer]:
    """A ready ThreadServer (a free TCP port and 1 s grace unless ``kwargs`` say otherwise),
    stopped on exit."""
    kwargs.setdefault("port", 0)
    kwargs.setdefault("grace", 1.0)
    s = ThreadServer(source, **kwargs)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


class StreamClient:
    """A Generate stream whose requests are fed from the test while responses are read."""

    def __init__(self, stub: Any, timeout: float = TIMEOUT, **kwargs: Any) -> None:
        self._outgoing: queue.Queue[Any] = queue.Queue()
        self.call = stub.Generate(self._requests(), timeout=timeout, **kwargs)

    def _requests(self) -> Iterator[Any]:
        while (msg := self._outgoing.get()) is not None:
            yield msg

    def send(self, **kwargs: Any) -> None:
        self._outgoing.put(pb2.GenerateStreamRequest(request=pb2.GenerateRequest(**kwargs)))

    def cancel(self, request_id: str) -> None:
        self._outgoing.put(pb2.GenerateStreamRequest(cancel=pb2.CancelRequest(request_id=request_id)))

    def half_close(self) -> None:
        self._outgoing.put(None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.call)


def status_of(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status code the call fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def wait_served(stub: Any, budget: float = 3.0) -> float:
    """Seconds until a short Complete is served on a one-slot, no-queue server."""
    start = time.monotonic()
    while True:
        try:
            stub.Complete(pb2.GenerateRequest(text="again", max_tokens=2), timeout=TIMEOUT)
            return time.monotonic() - start
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() - start > budget:
                raise
            time.sleep(0.02)


def spawn_server(model: Path, *args: str, ctx: int = 1024, env: dict[str, str] | None = None,
                 ready: bool = True, launcher: tuple[str, ...] = ("-m", "hyspec"),
                 printed: list[str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """`hyspec serve` on a free port in a subprocess (2 slots, queue 4 unless ``args`` say
    otherwise); returns it and its address once it printed "ready" (``ready=False``: once it
    printed where it listens). ``launcher``: what python runs instead of ``-m hyspec``;
    ``printed`` collects the lines it printed until then."""
    cmd = [sys.executable, *launcher, "serve", "--model", str(model), "--slots", "2", "--ctx", str(ctx),
           "--threads", "2", "--port", "0", "--max-queue", "4", "--log-level", "info", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    assert proc.stdout is not None
    deadline = time.monotonic() + TIMEOUT
    marker = "hyspec: ready on " if ready else "hyspec: serving "
    for line in proc.stdout:
        if printed is not None:
            printed.append(line)
        if line.startswith(marker):
            if ready:
                return proc, line.split()[-1]
            return proc, line.split(" on ", 1)[1].split()[0].rstrip(",")
        assert time.monotonic() < deadline
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")


def stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
