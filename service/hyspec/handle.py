"""The caller's side of one request: events to iterate (blocking or async) and cancel()."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from hyspec.types import Chunk, RequestError, Result

Event = Chunk | Result | RequestError


class RequestHandle:
    """Receives a request's events from the engine's worker thread: Chunks, then exactly one
    terminal event: a Result, or a RequestError when the engine failed the request (INTERNAL),
    which iterating or result() raises. Iterate it (``for`` or ``async for``, when made with a
    loop) or call result(). After cancel() the Result says CANCELLED and chunks not yet consumed
    are dropped."""

    def __init__(self, request_id: str, on_cancel: Callable[[RequestHandle], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._on_cancel = on_cancel
        self._loop = loop
        self._sync_queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async_queue: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._cancelled = threading.Event()
        self._done = False
        self.finished = False  # the terminal event was emitted (set on the worker thread)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Thread-safe and idempotent; the worker frees the slot at its next step."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._on_cancel(self)

    def emit(self, event: Event) -> None:
        """Called by the worker thread."""
        if isinstance(event, Chunk) and self.cancelled:
            return
        if not isinstance(event, Chunk):
            self.finished = True
        if self._loop is None:
            self._sync_queue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)  # type: ignore[union-attr]
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

    def fail(self, error: RequestError) -> None:
        """End the request with an error instead of a Result (called by the worker thread); no-op
        once the request has ended."""
        if not self.finished:
            self.emit(error)

    def _accept(self, event: Event) -> Chunk | Result | None:
        if isinstance(event, RequestError):
            self._done = True
            raise event
        if isinstance(event, Result):
            self._done = True
            return event
        return None if self.cancelled else event

    def __iter__(self) -> Iterator[Chunk | Result]:
        if self._loop is not None:
            raise TypeError("this handle was made for asyncio: use 'async for'")
        while not self._done:
            event = self._accept(self._sync_queue.get())
            if event is not None:
                yield event

    async def __aiter__(self) -> AsyncIterator[Chunk | Result]:
        if self._async_queue is None:
            raise TypeError("this handle was made without a loop: use 'for'")
        while not self._done:
            event = self._accept(await self._async_queue.get())
            if event is not None:
                yield event

    def result(self) -> Result:
        """Block until the request ends; the final Result (raises the RequestError of a failed request)."""
        final = None
        for event in self:
            if isinstance(event, Result):
                final = event
        assert final is not None
        return final
