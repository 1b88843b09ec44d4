"""The gRPC server: hyspec.v1.Generation, grpc.health.v1 and reflection on grpc.aio.

The engine runs requests on its own worker thread; its handles deliver events to this event
loop (call_soon_threadsafe), so nothing here blocks the loop except model loading and
warm-up, which run in executor threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NoReturn, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hyspec import convert
from hyspec.types import Chunk, ErrorCode, FinishReason, GenerationRequest, RequestError, Result
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc

if TYPE_CHECKING:
    from hyspec.engine import Engine, EngineConfig
    from hyspec.handle import RequestHandle

log = logging.getLogger("hyspec.server")

SERVICE_NAME = "hyspec.v1.Generation"
# Given an Engine, the caller owns it; given a factory, the server builds (in a thread, while
# already answering UNAVAILABLE) and closes it.
EngineSource = Union["Engine", Callable[[], "Engine"]]

# After the grace period, how long streams get to flush their last messages before the
# gRPC server cancels whatever is still open.
_FLUSH_SECONDS = 5.0
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port in use is an error, not silently shared with another server
    ("grpc.keepalive_time_ms", 30_000),  # ping idle clients so a vanished one frees its slots
    ("grpc.keepalive_timeout_ms", 10_000),
]
# How `hyspec generate` reaches a server (printed at start-up).
GENERATE_HINT = "hyspec generate --server {address} --prompt 'Hello' --max-tokens 16"


class _Phase(enum.Enum):
    LOADING = "loading"  # model loading / warm-up: UNAVAILABLE
    SERVING = "serving"
    DRAINING = "draining"  # shutting down: UNAVAILABLE for new requests


class _Runtime:
    """What every RPC shares: the engine, the phase, admission and the live engine requests."""

    def __init__(self, max_queue: int | None) -> None:
        self.engine: Engine | None = None
        self.phase = _Phase.LOADING
        self.max_queue = max_queue
        self.slots = 0
        self.handles: set[RequestHandle] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.streams: set[_Stream] = set()
        self._ids = itertools.count(1)

    def check_ready(self) -> Engine:
        if self.phase is _Phase.LOADING or self.engine is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "the server is loading the model; retry shortly")
        if self.phase is _Phase.DRAINING:
            raise RequestError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        return self.engine

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit a request to the engine (raises RequestError); pair with release()."""
        engine = self.check_ready()
        # The engine bounds its queue itself; this optional server-side bound only matters
        # when serve() was given a max_queue smaller than the engine's.
        if self.max_queue is not None and len(self.handles) >= self.slots + self.max_queue:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"all {self.slots} slot(s) busy and "
                               f"{self.max_queue} request(s) waiting; retry later")
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        handle = engine.submit(request, loop=asyncio.get_running_loop())
        self.handles.add(handle)
        self.idle.clear()
        return handle

    def release(self, handle: RequestHandle) -> None:
        self.handles.discard(handle)
        if not self.handles:
            self.idle.set()


def _log_result(request_id: str, result: Result) -> None:
    s = result.stats
    acceptance = f"{s.accepted}/{s.drafted} drafts accepted ({100.0 * s.accepted / s.drafted:.0f}%)" \
        if s.drafted else "no drafts"
    log.info("request %s %s: %d prompt + %d generated tokens, %s, %.1f tok/s, ttft %.0f ms",
             request_id, result.finish_reason.value, s.prompt_tokens, s.completion_tokens, acceptance,
             s.tokens_per_second, s.ttft_ms)


async def _drive(rt: _Runtime, handle: RequestHandle, request_id: str,
                 on_chunk: Callable[[Chunk], None] | None = None) -> Result:
    """An admitted request's events until its Result. If the caller is cancelled first (RPC
    cancelled, deadline passed, stream broken), the engine request is cancelled too, which
    frees its slot at the worker's next step."""
    result: Result | None = None
    try:
        async for event in handle:
            if isinstance(event, Result):
                result = event
            elif on_chunk is not None:
                on_chunk(event)
    finally:
        if result is None:
            handle.cancel()
            log.info("request %s abandoned by its client (cancelled, deadline passed or disconnected)",
                     request_id)
        rt.release(handle)
    if result is None:
        raise RuntimeError(f"request {request_id} ended without a result")
    _log_result(request_id, result)
    return result


async def _abort(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    await context.abort(convert.status_code(error.code), error.message)
    raise AssertionError("unreachable: abort raises")


_END = object()  # ends a stream's writer


class _Stream:
    """One Generate stream: many requests multiplexed by request_id, one writer."""

    def __init__(self, rt: _Runtime, context: grpc.aio.ServicerContext) -> None:
        self.rt = rt
        self.context = context
        # Every outgoing message goes through this queue: grpc allows one write at a time.
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.handles: dict[str, RequestHandle] = {}
        self.dropping: set[str] = set()  # cancelled ids: their chunks still queued are not sent
        self.half_closed = False
        self.draining = False

    async def run(self, requests: AsyncIterator[Any]) -> bool:
        """Serve until half-close (or drain) with nothing live; True if the client half-closed."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                msg = await self.out.get()
                if msg is _END:
                    break
                if msg.WhichOneof("kind") == "chunk":
                    if msg.request_id in self.dropping:
                        continue
                else:  # a terminal message: its id may be reused from now on
                    self.dropping.discard(msg.request_id)
                await self.context.write(msg)
        finally:
            # Normal end: nothing is live. Broken stream (this task cancelled by grpc) or a
            # failed write: cancel whatever is, which cancels the engine requests.
            pending = [reader, *self.tasks.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return self.half_closed

    def on_drain(self) -> None:
        self.draining = True
        self._maybe_end()

    def _maybe_end(self) -> None:
        if not self.tasks and (self.half_closed or self.draining):
            self.out.put_nowait(_END)

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "request":
                    self._start(msg.request)
                elif kind == "cancel":
                    self._cancel(msg.cancel.request_id)
                else:
                    log.debug("ignoring an empty GenerateStreamRequest")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client's side broke; grpc cancels the RPC too
            log.debug("Generate stream read failed: %r", e)
            self.out.put_nowait(_END)
            return
        self.half_closed = True
        self._maybe_end()

    def _error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.out.put_nowait(pb2.GenerateStreamResponse(request_id=request_id,
                                                        error=convert.error_to_proto(code, message)))

    def _start(self, msg: Any) -> None:
        rid = msg.request_id
        if not rid:
            self._error(rid, grpc.StatusCode.INVALID_ARGUMENT, "request_id is required on a Generate stream")
            return
        if rid in self.tasks:
            self._error(rid, grpc.StatusCode.INVALID_ARGUMENT,
                        f"request_id {rid!r} is already live on this stream")
            return
        try:
            handle = self.rt.submit(convert.request_from_proto(msg))
        except RequestError as e:
            self._error(rid, convert.status_code(e.code), e.message)
            return
        except Exception as e:  # an engine bug fails this request, not the stream
            log.exception("request %s could not be submitted", rid)
            self._error(rid, grpc.StatusCode.INTERNAL, f"internal error: {e}")
            return
        self.handles[rid] = handle
        self.tasks[rid] = asyncio.create_task(self._run(rid, handle))

    def _cancel(self, rid: str) -> None:
        handle = self.handles.get(rid)
        if handle is None:
            return  # unknown or already finished: ignored
        self.dropping.add(rid)
        handle.cancel()

    async def _run(self, rid: str, handle: RequestHandle) -> None:
        def on_chunk(chunk: Chunk) -> None:
            msg = pb2.GenerateStreamResponse(request_id=rid, chunk=convert.chunk_to_proto(chunk))
            self.out.put_nowait(msg)

        try:
            result = await _drive(self.rt, handle, rid, on_chunk)
            self.out.put_nowait(pb2.GenerateStreamResponse(request_id=rid,
                                                           complete=convert.result_to_proto(result, rid)))
        except RequestError as e:
            self._error(rid, convert.status_code(e.code), e.message)
        except Exception as e:  # an engine failure ends this request, not the stream
            log.exception("request %s failed", rid)
            self._error(rid, grpc.StatusCode.INTERNAL, f"internal error: {e}")
        finally:
            del self.tasks[rid]
            del self.handles[rid]
            self._maybe_end()


class GenerationService(pb2_grpc.GenerationServicer):
    """hyspec.v1.Generation over the runtime's engine."""

    def __init__(self, rt: _Runtime) -> None:
        self.rt = rt

    async def Generate(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        try:
            self.rt.check_ready()
        except RequestError as e:
            await _abort(context, e)
        stream = _Stream(self.rt, context)
        self.rt.streams.add(stream)
        try:
            half_closed = await stream.run(request_iterator)
        finally:
            self.rt.streams.discard(stream)
        if not half_closed and stream.draining:
            await _abort(context, RequestError(ErrorCode.UNAVAILABLE, "the server is shutting down"))

    async def Complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            greq = convert.request_from_proto(request)
            handle = self.rt.submit(greq)
        except RequestError as e:
            await _abort(context, e)
        # A cancelled RPC or a passed deadline cancels this coroutine, and _drive the request.
        try:
            result = await _drive(self.rt, handle, greq.request_id)
        except RequestError as e:
            await _abort(context, e)
        except Exception as e:
            log.exception("request %s failed", greq.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e}")
        if result.finish_reason is FinishReason.CANCELLED:
            await context.abort(grpc.StatusCode.CANCELLED, "the server cancelled the request (shutting down)")
        return convert.result_to_proto(result, greq.request_id)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            engine = self.rt.check_ready()
            add_special = request.add_special if request.HasField("add_special") else True
            ids = engine.tokenize(request.text, add_special=add_special, parse_special=request.parse_special)
        except RequestError as e:
            await _abort(context, e)
        return pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            text = self.rt.check_ready().detokenize(list(request.token_ids))
        except RequestError as e:
            await _abort(context, e)
        return pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            engine = self.rt.check_ready()
        except RequestError as e:
            await _abort(context, e)
        config = getattr(engine, "config", None)
        max_queue = getattr(config, "max_queue", None)
        if self.rt.max_queue is not None:
            max_queue = self.rt.max_queue if max_queue is None else min(max_queue, self.rt.max_queue)
        return convert.model_info_to_proto(engine.info(), max_queue)


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class HyspecServer:
    """A started grpc.aio server around an engine. Use start(), then shutdown() (what SIGTERM
    does) and wait_closed(); serve() does all of it."""

    def __init__(self, engine: EngineSource, *, host: str = "127.0.0.1", port: int | None = 50051,
                 unix: str | None = None, max_queue: int | None = None, grace: float = 30.0,
                 warmup: bool = True, announce: bool = True) -> None:
        if port is None and unix is None:
            raise ValueError("give a TCP port, a unix socket path or both")
        self._source = engine
        self._host, self._port, self._unix = host, port, unix
        self.grace = grace
        self._warmup = warmup
        self._announce = announce
        self._rt = _Runtime(max_queue)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._bring_up_task: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._failure: BaseException | None = None
        self.port: int | None = None  # the bound TCP port (useful with port=0)
        self.ready = asyncio.Event()

    @property
    def address(self) -> str:
        """A target clients can dial: host:port, or unix:PATH without TCP."""
        if self.port is not None:
            # A wildcard bind is dialled on loopback.
            host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
            return f"{_format_host(host)}:{self.port}"
        return f"unix:{self._unix}"

    async def start(self) -> None:
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        pb2_grpc.add_GenerationServicer_to_server(GenerationService(self._rt), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._port is not None:
            self.port = server.add_insecure_port(f"{_format_host(self._host)}:{self._port}")
        if self._unix is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.stat(self._unix).st_mode):
                    os.unlink(self._unix)  # a stale socket of an earlier run
            server.add_insecure_port(f"unix:{self._unix}")
        await server.start()
        self._server = server
        if self._announce:
            self._print_usage()
        self._bring_up_task = asyncio.create_task(self._bring_up())

    def _print_usage(self) -> None:
        where = []
        if self.port is not None:
            where.append(f"{_format_host(self._host)}:{self.port}")
        if self._unix is not None:
            where.append(f"unix:{self._unix}")
        grpcurl = f"-plaintext {self.address}" if self.port is not None else f"-plaintext -unix {self._unix}"
        lines = [
            f"hyspec: serving {SERVICE_NAME} on {', '.join(where)} "
            "(UNAVAILABLE until the model is loaded and warmed up)",
            "  call it with grpcurl:",
            f"""    grpcurl {grpcurl} -d '{{"text": "Hello", "max_tokens": 16}}' """
            "hyspec.v1.Generation/Complete",
            f"    grpcurl {grpcurl} list hyspec.v1.Generation",
            f"    grpcurl {grpcurl} grpc.health.v1.Health/Check",
            "  or with hyspec:",
            f"    {GENERATE_HINT.format(address=self.address)}",
        ]
        print("\n".join(lines), flush=True)

    async def _bring_up(self) -> None:
        try:
            if hasattr(self._source, "submit"):
                engine = self._source
            else:
                engine = await asyncio.to_thread(self._source)  # type: ignore[arg-type]
            info = engine.info()
            self._rt.slots = int(info.get("slots", 1))
            self._rt.engine = engine
            if self._warmup:
                await asyncio.to_thread(engine.warmup)
        except Exception as e:
            log.exception("the engine failed to start")
            self._failure = e
            self.shutdown(grace=0)  # not awaited: the drain must not be cancelled along with this task
            return
        if self._rt.phase is not _Phase.LOADING:
            return  # shutdown began meanwhile
        self._rt.phase = _Phase.SERVING
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        target = info.get("target") or {}
        log.info("ready: %s (%s), %s slot(s) x %s tokens, speculation %s", target.get("path"),
                 target.get("arch"), info.get("slots"), info.get("ctx"), info.get("default_spec"))
        if self._announce:
            print(f"hyspec: ready on {self.address}", flush=True)

    def shutdown(self, grace: float | None = None) -> asyncio.Task[None]:
        """Start draining (idempotent): health NOT_SERVING, new requests UNAVAILABLE, live
        requests get ``grace`` seconds (default: the server's) to finish, then are cancelled;
        then the server stops. Await the returned task or wait_closed()."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._drain(self.grace if grace is None else grace))
        return self._shutdown_task

    def cancel_all(self) -> None:
        """Cancel every live request now (a second SIGINT/SIGTERM)."""
        for handle in list(self._rt.handles):
            handle.cancel()

    async def _drain(self, grace: float) -> None:
        rt = self._rt
        rt.phase = _Phase.DRAINING
        await self._health.enter_graceful_shutdown()
        for stream in list(rt.streams):
            stream.on_drain()
        if rt.handles:
            log.info("draining: %d request(s) live, %.1f s grace", len(rt.handles), grace)
        try:
            if not rt.idle.is_set():
                await asyncio.wait_for(rt.idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("grace period over: cancelling %d request(s)", len(rt.handles))
            self.cancel_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rt.idle.wait(), _FLUSH_SECONDS)
        if self._server is not None:
            # Streams write their last messages and end; anything still open after this is cancelled.
            await self._server.stop(_FLUSH_SECONDS)
        if self._bring_up_task is not None and not self._bring_up_task.done():
            self._bring_up_task.cancel()  # still loading: the engine it may yet build is not served
        owned = rt.engine is not None and rt.engine is not self._source
        if owned:
            assert rt.engine is not None
            await asyncio.to_thread(rt.engine.close, 0)
        if self._unix is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix)
        log.info("server stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        """Wait until the server has stopped; raises if the engine failed to start."""
        await self._closed.wait()
        if self._failure is not None:
            raise RuntimeError(f"the engine failed to start: {self._failure}") from self._failure


async def serve(engine: EngineSource, host: str = "127.0.0.1", port: int | None = 50051,
                unix: str | None = None, max_queue: int | None = None, grace: float = 30.0, *,
                warmup: bool = True, handle_signals: bool = True, announce: bool = True,
                on_started: Callable[[HyspecServer], None] | None = None) -> None:
    """Serve hyspec.v1.Generation (plus grpc.health.v1 and reflection) until shut down.

    engine:   an Engine (the caller owns and closes it) or a zero-argument factory returning
              one; the factory runs in a thread after the port is bound, so clients get
              UNAVAILABLE (health NOT_SERVING) while the model loads, and the server closes
              the engine at shutdown.
    host, port: TCP address; port 0 picks a free port, port None serves only on ``unix``.
    unix:     also (or only) listen on this unix socket path (clients dial ``unix:PATH``).
    max_queue: optional server-side bound: refuse with RESOURCE_EXHAUSTED once
              slots + max_queue requests are admitted. None leaves it to the engine's own
              bound (EngineConfig.max_queue), which is the usual way.
    grace:    seconds in-flight requests get to finish at shutdown before they are cancelled.
    warmup:   run engine.warmup() before reporting SERVING.
    handle_signals: SIGTERM/SIGINT start the graceful shutdown; a second one cancels the
              in-flight requests at once. Needs the main thread.
    announce: print how to call the server (grpcurl, ``hyspec generate --server``) to stdout.
    on_started: called with the HyspecServer once the port is bound (e.g. to read .port).

    Returns after a clean shutdown; raises RuntimeError if the engine failed to load or warm up.
    """
    server = HyspecServer(engine, host=host, port=port, unix=unix, max_queue=max_queue, grace=grace,
                          warmup=warmup, announce=announce)
    await server.start()
    if on_started is not None:
        on_started(server)
    if handle_signals:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if server._shutdown_task is None:
                log.info("%s: shutting down (grace %.1f s; again to cancel requests now)",
                         signal.Signals(signum).name, grace)
                server.shutdown()
            else:
                log.warning("%s again: cancelling in-flight requests", signal.Signals(signum).name)
                server.cancel_all()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
    await server.wait_closed()


def run_server(config: EngineConfig, *, host: str = "127.0.0.1", port: int | None = 50051,
               unix: str | None = None, max_queue: int | None = None, grace: float = 30.0) -> int:
    """Blocking entry point for ``hyspec serve``: build the Engine from ``config`` (in the
    background, while already answering UNAVAILABLE), warm it up, serve until SIGTERM/SIGINT,
    drain for up to ``grace`` seconds and return the process exit code (0 after a clean
    shutdown, 1 if the model failed to load or warm up).

    max_queue, when given, replaces config.max_queue (the engine's wait-queue bound: with
    every slot busy and that many waiting, new requests get RESOURCE_EXHAUSTED).
    Configures INFO logging to stderr unless the caller configured logging already.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if max_queue is not None:
        config = dataclasses.replace(config, max_queue=max_queue)

    def build() -> Engine:
        from hyspec.engine import Engine  # the native extension loads only when serving

        return Engine(config)

    try:
        asyncio.run(serve(build, host=host, port=port, unix=unix, grace=grace))
    except RuntimeError as e:
        print(f"hyspec: {e}", file=sys.stderr)
        return 1
    return 0
