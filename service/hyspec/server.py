"""The gRPC server: hyspec.v1.Generation, grpc.health.v1 and reflection on grpc.aio.

The engine runs requests on its own worker thread; its handles deliver events to this event
loop (call_soon_threadsafe). Nothing here blocks the loop: model loading and warm-up run in
executor threads, and so does everything that tokenizes (admitting a request, Tokenize,
Detokenize). Every client-supplied size is bounded (hyspec.limits) before it costs anything,
and every failure ends with a defined gRPC status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hyspec import convert
from hyspec.limits import Limits, utf8_prefix
from hyspec.logs import printable
from hyspec.metrics import Metrics
from hyspec.security import AuthInterceptor, Security, TokenStore, is_loopback
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
# Once every Generation RPC has ended, what other calls (an open health Watch never ends by
# itself) get before the server cancels them.
_STOP_GRACE = 0.2
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port in use is an error, not silently shared with another server
    ("grpc.keepalive_time_ms", 30_000),  # ping idle clients so a vanished one frees its slots
    ("grpc.keepalive_timeout_ms", 10_000),
]
# Threads that admit requests (tokenizing, building samplers) and serve Tokenize/Detokenize.
_ADMIT_THREADS = 2
# How `hyspec generate` reaches a server (printed at start-up).
GENERATE_HINT = "hyspec generate --server {address} --prompt 'Hello' --max-tokens 16"

T = TypeVar("T")


class _Phase(enum.Enum):
    LOADING = "loading"  # model loading / warm-up: UNAVAILABLE
    SERVING = "serving"
    DRAINING = "draining"  # shutting down: UNAVAILABLE for new requests


class StartError(RuntimeError):
    """The server could not start (address in use, unix socket held by a live server, ...)."""


class _Status(Exception):
    """Ends an RPC (or one request of a stream) with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, error: RequestError) -> _Status:
        return cls(convert.status_code(error.code), error.message)


class Malformed:
    """A request message that did not parse (corrupt protobuf, a string field with bad UTF-8):
    handlers answer it with INVALID_ARGUMENT instead of grpc's UNKNOWN."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"malformed {type_name} message: {error}"


def _parser(cls: Any) -> Callable[[bytes], Any]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, or anything else the parser raises
            return Malformed(name, e)

    return parse


class _Runtime:
    """What every RPC shares: the engine, the phase, admission, limits, metrics and the live
    engine requests."""

    def __init__(self, max_queue: int | None, limits: Limits) -> None:
        self.engine: Engine | None = None
        self.phase = _Phase.LOADING
        self.max_queue = max_queue
        self.limits = limits
        self.slots = 0
        self.ctx = 0  # tokens per slot
        self.handles: set[RequestHandle] = set()
        self.pending = 0  # requests being admitted on the pool
        self.idle = asyncio.Event()
        self.idle.set()
        self.streams: set[_Stream] = set()
        self.active = 0  # Generation RPCs in progress
        self.quiet = asyncio.Event()
        self.quiet.set()
        self.pool = concurrent.futures.ThreadPoolExecutor(_ADMIT_THREADS, thread_name_prefix="hyspec-admit")
        self.metrics = Metrics(self.gauges)
        self._ids = itertools.count(1)

    def gauges(self) -> dict[str, float]:
        """Live values for the metrics (read from the metrics thread: lengths only)."""
        scheduler = getattr(self.engine, "scheduler", None)
        slots = getattr(scheduler, "slots", None)
        waiting = getattr(scheduler, "waiting", None)
        return {"hyspec_slots_busy": len(slots) if slots is not None else 0,
                "hyspec_queue_length": len(waiting) if waiting is not None else 0,
                "hyspec_streams_open": len(self.streams),
                "hyspec_ready": 1.0 if self.phase is _Phase.SERVING else 0.0}

    def check_ready(self) -> Engine:
        if self.phase is _Phase.LOADING or self.engine is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "the server is loading the model; retry shortly")
        if self.phase is _Phase.DRAINING:
            raise RequestError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        return self.engine

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the admission threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit a request to the engine (raises RequestError); pair with release(). The engine
        tokenizes and builds the sampler on the admission threads."""
        engine = self.check_ready()
        # The engine bounds its queue itself; this optional server-side bound only matters
        # when serve() was given a max_queue smaller than the engine's.
        live = sum(not h.cancelled for h in self.handles) + self.pending
        if self.max_queue is not None and live >= self.slots + self.max_queue:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"all {self.slots} slot(s) busy and "
                               f"{self.max_queue} request(s) waiting; retry later")
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, functools.partial(engine.submit, request, loop=loop))
        self.pending += 1
        self.idle.clear()
        try:
            handle = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller went away while the engine admitted the request: cancel it once admitted.
            future.add_done_callback(_cancel_admitted)
            raise
        finally:
            self.pending -= 1
            self._update_idle()
        self.handles.add(handle)
        self.idle.clear()
        return handle

    def release(self, handle: RequestHandle) -> None:
        self.handles.discard(handle)
        self._update_idle()

    def _update_idle(self) -> None:
        if not self.handles and not self.pending:
            self.idle.set()

    def rpc_started(self) -> None:
        self.active += 1
        self.quiet.clear()

    def rpc_ended(self) -> None:
        self.active -= 1
        if not self.active:
            self.quiet.set()

    def record(self, method: str, request_id: str, code: grpc.StatusCode, started: float, *,
               result: Result | None = None, message: str = "", peer: str = "") -> None:
        """Metrics and one log line for a request that ended (never its prompt or output)."""
        seconds = time.perf_counter() - started
        self.metrics.request(method, code.name, seconds)
        fields: dict[str, Any] = {"request_id": request_id[:256], "method": method, "status": code.name,
                                  "duration_ms": round(seconds * 1000.0, 1)}
        if peer:
            fields["peer"] = peer
        rid = printable(request_id)
        level = logging.INFO if method in ("Generate", "Complete") else logging.DEBUG
        if result is not None:
            self.metrics.result(result)
            s = result.stats
            fields.update(finish_reason=result.finish_reason.value, prompt_tokens=s.prompt_tokens,
                          completion_tokens=s.completion_tokens, drafted=s.drafted, accepted=s.accepted,
                          rollbacks=s.rollbacks, ttft_ms=round(s.ttft_ms, 1),
                          tokens_per_second=round(s.tokens_per_second, 1), cached_tokens=s.cached_tokens)
            acceptance = f"{s.accepted}/{s.drafted} drafts accepted ({100.0 * s.accepted / s.drafted:.0f}%)" \
                if s.drafted else "no drafts"
            summary = getattr(self.engine, "cache_summary", None)  # test engines may have none
            cache = summary() if summary is not None else None
            if cache is not None:
                fields.update(cache_mb=cache["mb"], cache_hit_rate=cache["hit_rate"])
            where = f", {s.cached_tokens} prompt tokens cached (cache {cache['mb']:.1f} MB, {cache['entries']} " \
                f"entries, hit rate {100.0 * cache['hit_rate']:.0f}%)" if cache is not None else ""
            log.log(level, "request %s %s: %d prompt + %d generated tokens, %s, %.1f tok/s, ttft %.0f ms%s", rid,
                    result.finish_reason.value, s.prompt_tokens, s.completion_tokens, acceptance,
                    s.tokens_per_second, s.ttft_ms, where, extra=fields)
        else:
            log.log(level, "request %s (%s) ended %s: %s", rid, method, code.name, printable(message, 512),
                    extra=fields)


def _cancel_admitted(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().cancel()


async def _drive(rt: _Runtime, handle: RequestHandle, request_id: str,
                 on_chunk: Callable[[Chunk], None] | None = None) -> Result:
    """An admitted request's events until its Result (raises the RequestError of a request the
    engine failed). If the caller is cancelled first (RPC cancelled, deadline passed, stream
    broken), the engine request is cancelled too, which frees its slot at the worker's next step."""
    result: Result | None = None
    failed = False
    try:
        async for event in handle:
            if isinstance(event, Result):
                result = event
            elif on_chunk is not None:
                on_chunk(event)
    except RequestError:
        failed = True
        raise
    finally:
        if result is None and not failed:
            handle.cancel()
            log.info("request %s abandoned by its client (cancelled, deadline passed or disconnected)",
                     printable(request_id))
        rt.release(handle)
    if result is None:
        raise RuntimeError(f"request {printable(request_id)} ended without a result")
    return result


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


def _ended_by_client(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """Why a handler was cancelled: its deadline passed, or the client cancelled or went away."""
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
        else grpc.StatusCode.CANCELLED


_END = object()  # ends a stream's writer


class _Stream:
    """One Generate stream: many requests multiplexed by request_id, one writer."""

    def __init__(self, rt: _Runtime, context: grpc.aio.ServicerContext) -> None:
        self.rt = rt
        self.context = context
        self.peer = context.peer() or ""
        # Every outgoing message goes through this queue (grpc allows one write at a time), with
        # its size when it is a chunk: the chunks waiting for a client are bounded.
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.buffered = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}  # live requests, being admitted or running
        self.handles: dict[str, RequestHandle] = {}
        self.dropping: set[str] = set()  # cancelled ids: their chunks still queued are not sent
        self.overflowed: set[str] = set()  # ids failed because the client did not read
        self.half_closed = False
        self.draining = False
        self.failure: _Status | None = None  # the stream itself ends with this status

    async def run(self, requests: AsyncIterator[Any]) -> bool:
        """Serve until half-close (or drain) with nothing live; True if the client half-closed."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                item = await self.out.get()
                if item is _END:
                    break
                msg, size = item
                self.buffered -= size
                if msg.WhichOneof("kind") == "chunk":
                    if msg.request_id in self.dropping:
                        continue
                else:  # a terminal message: its id may be reused from now on
                    self.dropping.discard(msg.request_id)
                await self.context.write(msg)
        finally:
            # Normal end: nothing is live. Broken or failed stream (this task cancelled by grpc, a
            # failed write, a malformed message): cancel whatever is, which cancels the engine requests.
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
                if isinstance(msg, Malformed):
                    self.failure = _Status(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"{msg.message}; the stream's live requests were cancelled")
                    self.out.put_nowait(_END)
                    return
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
            self.failure = _Status(grpc.StatusCode.INTERNAL, f"reading the stream failed: {e}")
            self.out.put_nowait(_END)
            return
        self.half_closed = True
        self._maybe_end()

    def _send(self, msg: Any, size: int = 0) -> None:
        self.buffered += size
        self.out.put_nowait((msg, size))

    def _error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._send(pb2.GenerateStreamResponse(request_id=request_id, error=convert.error_to_proto(code, message)))

    def _start(self, msg: Any) -> None:
        started = time.perf_counter()
        rid = msg.request_id
        try:
            if not rid:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required on a Generate stream")
            self.rt.limits.check_request_id(rid)
            if rid in self.tasks:
                # ALREADY_EXISTS, not INVALID_ARGUMENT: this refusal is not the live request's end.
                raise _Status(grpc.StatusCode.ALREADY_EXISTS, "this request_id is already live on this stream; "
                              "the live request goes on")
            self.rt.check_ready()
            self.rt.limits.check_generate(msg, self.rt.ctx)
            request = convert.request_from_proto(msg)
        except (RequestError, _Status) as e:
            status = e if isinstance(e, _Status) else _Status.of(e)
            self._error(utf8_prefix(rid, self.rt.limits.max_request_id_bytes), status.code, status.message)
            self.rt.record("Generate", rid, status.code, started, message=status.message, peer=self.peer)
            return
        self.tasks[rid] = asyncio.create_task(self._run(rid, request, started))

    def _cancel(self, rid: str) -> None:
        if rid not in self.tasks:
            return  # unknown or already finished: ignored
        self.dropping.add(rid)
        handle = self.handles.get(rid)
        if handle is not None:
            handle.cancel()  # still being admitted: _run cancels it once admitted

    def _on_chunk(self, rid: str, chunk: Chunk) -> None:
        if rid in self.overflowed:
            return
        msg = pb2.GenerateStreamResponse(request_id=rid, chunk=convert.chunk_to_proto(chunk))
        size = msg.ByteSize()
        if self.buffered + size > self.rt.limits.stream_buffer_bytes:
            # The client is not reading: this request fails, its slot is freed, its chunks dropped.
            self.overflowed.add(rid)
            self.dropping.add(rid)
            self.handles[rid].cancel()
            return
        self._send(msg, size)

    async def _run(self, rid: str, request: GenerationRequest, started: float) -> None:
        code, result, message = grpc.StatusCode.OK, None, ""
        try:
            handle = await self.rt.submit(request)
            self.handles[rid] = handle
            if rid in self.dropping:
                handle.cancel()  # cancelled while being admitted
            result = await _drive(self.rt, handle, rid, functools.partial(self._on_chunk, rid))
            if rid in self.overflowed:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                message = (f"more than {self.rt.limits.stream_buffer_bytes} bytes of output were waiting for the "
                           "client to read them (--stream-buffer-bytes); the request was stopped")
                self._error(rid, code, message)
            else:
                self._send(pb2.GenerateStreamResponse(request_id=rid, complete=convert.result_to_proto(result, rid)))
        except RequestError as e:
            code, message = convert.status_code(e.code), e.message
            self._error(rid, code, message)
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.CANCELLED, "the stream ended"
            raise
        except Exception as e:  # an engine failure ends this request, not the stream
            log.exception("request %s failed", printable(rid))
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {e}"
            self._error(rid, code, message)
        finally:
            del self.tasks[rid]
            self.handles.pop(rid, None)
            self.overflowed.discard(rid)
            self.rt.record("Generate", rid, code, started, result=result if code is grpc.StatusCode.OK else None,
                           message=message, peer=self.peer)
            self._maybe_end()


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _unary(method: str) -> Callable[[Handler], Handler]:
    """A unary Generation RPC: malformed messages, RequestError/_Status, client cancellation
    and bugs each end with their status; every call is counted and logged."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(self: GenerationService, request: Any, context: grpc.aio.ServicerContext) -> Any:
            rt = self.rt
            started = time.perf_counter()
            code, message, outcome = grpc.StatusCode.OK, "", {}
            rt.rpc_started()
            try:
                if isinstance(request, Malformed):
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                response = await fn(self, request, context, outcome)
            except (RequestError, _Status) as e:
                status = e if isinstance(e, _Status) else _Status.of(e)
                code, message = status.code, status.message
            except asyncio.CancelledError:
                code, message = _ended_by_client(context), "ended by the client"
                raise
            except Exception as e:
                log.exception("%s failed", method)
                code, message = grpc.StatusCode.INTERNAL, f"internal error: {e}"
            finally:
                rt.rpc_ended()
                rt.record(method, outcome.get("request_id", ""), code, started, result=outcome.get("result"),
                          message=message, peer=context.peer() or "")
            if code is not grpc.StatusCode.OK:
                await _abort(context, code, message)
            return response

        return handler  # type: ignore[return-value]

    return wrap


class GenerationService(pb2_grpc.GenerationServicer):
    """hyspec.v1.Generation over the runtime's engine."""

    def __init__(self, rt: _Runtime) -> None:
        self.rt = rt

    async def Generate(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        rt = self.rt
        rt.rpc_started()
        try:
            refusal: _Status | None = None
            if len(rt.streams) >= rt.limits.max_streams:
                refusal = _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(rt.streams)} Generate streams are "
                                  "open, the most the server takes (--max-streams); retry later")
            else:
                try:
                    rt.check_ready()
                except RequestError as e:
                    refusal = _Status.of(e)
            if refusal is not None:
                rt.record("Generate", "", refusal.code, time.perf_counter(), message=refusal.message,
                          peer=context.peer() or "")
                await _abort(context, refusal.code, refusal.message)
            stream = _Stream(rt, context)
            rt.streams.add(stream)
            try:
                half_closed = await stream.run(request_iterator)
            finally:
                rt.streams.discard(stream)
            if stream.failure is not None:
                await _abort(context, stream.failure.code, stream.failure.message)
            if not half_closed and stream.draining:
                await _abort(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        finally:
            rt.rpc_ended()

    @_unary("Complete")
    async def Complete(self, request: Any, context: grpc.aio.ServicerContext,  # type: ignore[override]
                       outcome: dict[str, Any]) -> Any:
        rt = self.rt
        outcome["request_id"] = request.request_id
        rt.check_ready()
        rt.limits.check_generate(request, rt.ctx)
        greq = convert.request_from_proto(request)
        # A cancelled RPC or a passed deadline cancels this coroutine, and _drive the request.
        handle = await rt.submit(greq)
        outcome["request_id"] = greq.request_id
        result = await _drive(rt, handle, greq.request_id)
        if result.finish_reason is FinishReason.CANCELLED:
            raise _Status(grpc.StatusCode.CANCELLED, "the server cancelled the request (shutting down)")
        outcome["result"] = result
        return convert.result_to_proto(result, greq.request_id)

    @_unary("Tokenize")
    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext,  # type: ignore[override]
                       outcome: dict[str, Any]) -> Any:
        engine = self.rt.check_ready()
        self.rt.limits.check_text(request.text, "the text")
        add_special = request.add_special if request.HasField("add_special") else True

        def tokenize() -> Any:  # the response too: a few MB of text give a million ids
            return pb2.TokenizeResponse(token_ids=engine.tokenize(request.text, add_special=add_special,
                                                                  parse_special=request.parse_special))

        return await self.rt.run(tokenize)

    @_unary("Detokenize")
    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext,  # type: ignore[override]
                         outcome: dict[str, Any]) -> Any:
        engine = self.rt.check_ready()
        text = await self.rt.run(engine.detokenize, list(request.token_ids))
        return pb2.DetokenizeResponse(text=text)

    @_unary("GetModelInfo")
    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext,  # type: ignore[override]
                           outcome: dict[str, Any]) -> Any:
        engine = self.rt.check_ready()
        config = getattr(engine, "config", None)
        max_queue = getattr(config, "max_queue", None)
        if self.rt.max_queue is not None:
            max_queue = self.rt.max_queue if max_queue is None else min(max_queue, self.rt.max_queue)
        return convert.model_info_to_proto(engine.info(), max_queue)


def _generation_handler(service: GenerationService) -> grpc.GenericRpcHandler:
    """The service's method handlers, with parsers that turn a malformed message into Malformed."""

    def unary(fn: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_parser(request),
                                                   response_serializer=response.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Generate": grpc.stream_stream_rpc_method_handler(
            service.Generate, request_deserializer=_parser(pb2.GenerateStreamRequest),
            response_serializer=pb2.GenerateStreamResponse.SerializeToString),
        "Complete": unary(service.Complete, pb2.GenerateRequest, pb2.GenerateResponse),
        "Tokenize": unary(service.Tokenize, pb2.TokenizeRequest, pb2.TokenizeResponse),
        "Detokenize": unary(service.Detokenize, pb2.DetokenizeRequest, pb2.DetokenizeResponse),
        "GetModelInfo": unary(service.GetModelInfo, pb2.GetModelInfoRequest, pb2.ModelInfo),
    })


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _claim_unix_socket(path: str) -> None:
    """Remove a stale socket file left by an earlier run; refuse a path a live server listens
    on (or that is not a socket)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartError(f"--unix {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # nobody listens: a stale socket of an earlier run
        return
    except OSError as e:
        raise StartError(f"--unix {path}: cannot tell whether a server is listening there ({e})") from None
    finally:
        probe.close()
    raise StartError(f"another server is listening on unix:{path}; refusing to take its socket over")


class HyspecServer:
    """A started grpc.aio server around an engine. Use start(), then shutdown() (what SIGTERM
    does) and wait_closed(); serve() does all of it."""

    def __init__(self, engine: EngineSource, *, host: str = "127.0.0.1", port: int | None = 50051,
                 unix: str | None = None, max_queue: int | None = None, grace: float = 30.0,
                 warmup: bool = True, announce: bool = True, limits: Limits | None = None,
                 security: Security | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        if port is None and unix is None:
            raise ValueError("give a TCP port, a unix socket path or both")
        self._source = engine
        self._host, self._port, self._unix = host, port, unix
        self.grace = grace
        self._warmup = warmup
        self._announce = announce
        self._security = security or Security()
        self._tokens = TokenStore(self._security.auth_token_file) if self._security.auth_token_file else None
        self._metrics_port, self._metrics_host = metrics_port, metrics_host
        self._rt = _Runtime(max_queue, limits or Limits())
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._bring_up_task: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._failure: BaseException | None = None
        self._failure_what = "the engine failed to start"
        self._owns_unix = False
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

    @property
    def metrics(self) -> Metrics:
        return self._rt.metrics

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port (None: metrics not served over HTTP)."""
        return self._rt.metrics.port

    def reload_tokens(self) -> bool:
        """Re-read --auth-token-file (SIGHUP); False when there is none or it could not be read."""
        if self._tokens is None:
            log.info("SIGHUP: no --auth-token-file to reload")
            return False
        return self._tokens.reload()

    async def start(self) -> None:
        credentials = self._security.server_credentials()
        interceptors = []
        if self._tokens is not None:
            interceptors.append(AuthInterceptor(self._tokens, self._refused))
        server = grpc.aio.server(options=_SERVER_OPTIONS + self._rt.limits.grpc_options(), interceptors=interceptors)
        server.add_generic_rpc_handlers((_generation_handler(GenerationService(self._rt)),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._unix is not None:
            _claim_unix_socket(self._unix)
        try:
            if self._port is not None:
                address = f"{_format_host(self._host)}:{self._port}"
                self.port = server.add_secure_port(address, credentials) if credentials is not None \
                    else server.add_insecure_port(address)
            if self._unix is not None:
                server.add_insecure_port(f"unix:{self._unix}")
                self._owns_unix = True
        except RuntimeError as e:
            raise StartError(f"cannot listen: {e}") from None
        await server.start()
        if self._metrics_port is not None:
            try:
                self._rt.metrics.serve(self._metrics_host, self._metrics_port)
            except OSError as e:
                await server.stop(0)
                raise StartError(f"cannot serve metrics on {self._metrics_host}:{self._metrics_port}: {e}") from None
        self._server = server
        self._warn_if_exposed()
        if self._announce:
            self._print_usage()
        self._bring_up_task = asyncio.create_task(self._bring_up())

    def _refused(self, method: str) -> None:
        if method.startswith(f"/{SERVICE_NAME}/"):
            self._rt.metrics.request(method.rsplit("/", 1)[-1], grpc.StatusCode.UNAUTHENTICATED.name)

    def _warn_if_exposed(self) -> None:
        if self._port is None or is_loopback(self._host):
            return
        missing = [what for what, present in (("TLS (--tls-cert/--tls-key)", self._security.tls),
                                              ("bearer tokens (--auth-token-file)", self._tokens is not None))
                   if not present]
        if missing:
            log.warning("listening on %s, reachable from other machines, without %s: %s", self._host,
                        " and ".join(missing), "anyone who can connect can use the server"
                        if self._tokens is None else "requests and tokens travel in plaintext")

    def _print_usage(self) -> None:
        where = []
        if self.port is not None:
            where.append(f"{_format_host(self._host)}:{self.port}")
        if self._unix is not None:
            where.append(f"unix:{self._unix}")
        transport = "-insecure" if self._security.tls else "-plaintext"
        grpcurl = f"{transport} {self.address}" if self.port is not None else f"-plaintext -unix {self._unix}"
        if self._tokens is not None:
            grpcurl += " -H 'authorization: Bearer <token>'"
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
        if self.metrics_port is not None:
            lines.append(f"  metrics: http://{_format_host(self._metrics_host)}:{self.metrics_port}/metrics")
        print("\n".join(lines), flush=True)

    async def _bring_up(self) -> None:
        rt = self._rt
        try:
            if hasattr(self._source, "submit"):
                engine = self._source
            else:
                engine = await asyncio.to_thread(self._source)  # type: ignore[arg-type]
        except Exception as e:
            if rt.phase is _Phase.DRAINING:
                log.info("model loading stopped: the server is shutting down (%s)", e)
                return
            log.exception("the engine failed to start")
            self._failure = e
            self.shutdown(grace=0)  # not awaited: the drain must not be cancelled along with this task
            return
        if rt.phase is not _Phase.LOADING:  # shut down while loading
            if engine is not self._source:
                await asyncio.to_thread(engine.close, 0)
            return
        try:
            info = engine.info()
            rt.slots = int(info.get("slots", 1))
            rt.ctx = int(info.get("ctx", 0))
            rt.engine = engine
            self._watch(engine)
            if self._warmup:
                await asyncio.to_thread(engine.warmup)
        except Exception as e:
            log.exception("the engine failed to start")
            self._failure = e
            self.shutdown(grace=0)
            return
        if rt.phase is not _Phase.LOADING:
            return  # shutdown began meanwhile
        rt.phase = _Phase.SERVING
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        target = info.get("target") or {}
        log.info("ready: %s (%s), %s slot(s) x %s tokens, speculation %s", target.get("path"),
                 target.get("arch"), info.get("slots"), info.get("ctx"), info.get("default_spec"))
        if self._announce:
            print(f"hyspec: ready on {self.address}", flush=True)

    def _watch(self, engine: Any) -> None:
        """Stop the server if the engine's worker dies (every request then failed with INTERNAL)."""
        if not hasattr(engine, "on_failure"):
            return
        loop = asyncio.get_running_loop()

        def on_failure(error: BaseException) -> None:  # on the engine's worker thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: this server is gone already
                loop.call_soon_threadsafe(self._engine_died, error)

        engine.on_failure = on_failure
        if getattr(engine, "failure", None) is not None:
            self._engine_died(engine.failure)

    def _engine_died(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure, self._failure_what = error, "the engine failed"
        log.critical("the engine stopped (%r): health NOT_SERVING, shutting down", error)
        self.shutdown(grace=0)

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
        loading = rt.phase is _Phase.LOADING
        rt.phase = _Phase.DRAINING
        await self._health.enter_graceful_shutdown()
        if loading and self._bring_up_task is not None and not self._bring_up_task.done():
            from hyspec import _native

            _native.cancel_loads()  # a model still loading stops at its next step
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
            # Streams write their last messages and end; then whatever is still open (a health
            # Watch) is cancelled.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rt.quiet.wait(), _FLUSH_SECONDS)
            await self._server.stop(_STOP_GRACE)
        if self._bring_up_task is not None and not self._bring_up_task.done():
            # Still loading or warming up: it ends soon (loads are cancelled); a slower one is left behind.
            await asyncio.wait({self._bring_up_task}, timeout=_FLUSH_SECONDS)
            self._bring_up_task.cancel()
        engine = rt.engine
        if engine is not None and getattr(engine, "on_failure", None) is not None:
            engine.on_failure = None
        if engine is not None and engine is not self._source:
            await asyncio.to_thread(engine.close, 0)
        rt.pool.shutdown(wait=False, cancel_futures=True)
        rt.metrics.close()
        if self._unix is not None and self._owns_unix:
            with contextlib.suppress(OSError):
                os.unlink(self._unix)
        log.info("server stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        """Wait until the server has stopped; raises if the engine failed to start or died."""
        await self._closed.wait()
        if self._failure is not None:
            raise RuntimeError(f"{self._failure_what}: {self._failure}") from self._failure


async def serve(engine: EngineSource, host: str = "127.0.0.1", port: int | None = 50051,
                unix: str | None = None, max_queue: int | None = None, grace: float = 30.0, *,
                warmup: bool = True, handle_signals: bool = True, announce: bool = True,
                limits: Limits | None = None, security: Security | None = None,
                metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                on_started: Callable[[HyspecServer], None] | None = None) -> None:
    """Serve hyspec.v1.Generation (plus grpc.health.v1 and reflection) until shut down.

    engine:   an Engine (the caller owns and closes it) or a zero-argument factory returning
              one; the factory runs in a thread after the port is bound, so clients get
              UNAVAILABLE (health NOT_SERVING) while the model loads, and the server closes
              the engine at shutdown.
    host, port: TCP address; port 0 picks a free port, port None serves only on ``unix``.
    unix:     also (or only) listen on this unix socket path (clients dial ``unix:PATH``); a
              path another live server listens on is refused (StartError).
    max_queue: optional server-side bound: refuse with RESOURCE_EXHAUSTED once
              slots + max_queue requests are admitted. None leaves it to the engine's own
              bound (EngineConfig.max_queue), which is the usual way.
    grace:    seconds in-flight requests get to finish at shutdown before they are cancelled.
    warmup:   run engine.warmup() before reporting SERVING.
    handle_signals: SIGTERM/SIGINT start the graceful shutdown; a second one cancels the
              in-flight requests at once; SIGHUP re-reads the token file. Needs the main thread.
    announce: print how to call the server (grpcurl, ``hyspec generate --server``) to stdout.
    limits:   hyspec.limits.Limits (default: its defaults).
    security: TLS files and the bearer-token file (hyspec.security.Security; default: none).
    metrics_port: serve Prometheus metrics on http://metrics_host:metrics_port/metrics (0: a
              free port; None: not served).
    on_started: called with the HyspecServer once the port is bound (e.g. to read .port).

    Returns after a clean shutdown; raises RuntimeError if the engine failed to load, warm up
    or run, and StartError if the server could not listen.
    """
    server = HyspecServer(engine, host=host, port=port, unix=unix, max_queue=max_queue, grace=grace,
                          warmup=warmup, announce=announce, limits=limits, security=security,
                          metrics_port=metrics_port, metrics_host=metrics_host)
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
        loop.add_signal_handler(signal.SIGHUP, server.reload_tokens)
    await server.wait_closed()


def run_server(config: EngineConfig, *, host: str = "127.0.0.1", port: int | None = 50051,
               unix: str | None = None, max_queue: int | None = None, grace: float = 30.0,
               limits: Limits | None = None, security: Security | None = None,
               metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """Blocking entry point for ``hyspec serve``: build the Engine from ``config`` (in the
    background, while already answering UNAVAILABLE), warm it up, serve until SIGTERM/SIGINT,
    drain for up to ``grace`` seconds and return the process exit code: 0 after a clean
    shutdown, 1 if the server could not start, the model failed to load or warm up, or the
    engine died while serving (so that a supervisor restarts it).

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
        asyncio.run(serve(build, host=host, port=port, unix=unix, grace=grace, limits=limits, security=security,
                          metrics_port=metrics_port, metrics_host=metrics_host))
    except (RuntimeError, ValueError) as e:
        print(f"hyspec: {e}", file=sys.stderr)
        return 1
    return 0
