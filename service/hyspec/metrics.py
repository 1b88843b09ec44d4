"""Prometheus metrics of one server (README, "Metrics"), served over HTTP on ``--metrics-port``.

Each server has its own registry, so several servers in one process (tests) do not mix.
Counters and histograms are updated on the event loop as requests end; the gauges are read
when Prometheus scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

from hyspec.types import Result

# Seconds: a few ms (a token on a tiny model) to minutes (a long generation).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metrics; ``gauges`` supplies the live values (slots busy, queue, streams)."""

    def __init__(self, gauges: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hyspec_requests", "Requests ended, by RPC method and gRPC status (a Generate "
                                "stream counts each of its requests)", ["method", "status"], registry=r)
        self.generated = Counter("hyspec_generated_tokens", "Tokens generated (completion tokens)", registry=r)
        self.prompt = Counter("hyspec_prompt_tokens", "Prompt tokens of requests that ended", registry=r)
        self.drafted = Counter("hyspec_draft_tokens", "Draft tokens proposed for verification", registry=r)
        self.accepted = Counter("hyspec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.rollbacks = Counter("hyspec_rollbacks", "Rejected drafts that rolled the target's state back",
                                 registry=r)
        self.ttft = Histogram("hyspec_time_to_first_token_seconds", "From a request's arrival at the engine to "
                              "its first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hyspec_time_per_output_token_seconds", "Per request: seconds per generated token "
                              "after the first", buckets=_TOKEN_BUCKETS, registry=r)
        self.duration = Histogram("hyspec_request_duration_seconds", "From a request's arrival at the server to "
                                  "its end (any status)", buckets=_LATENCY_BUCKETS, registry=r)
        self._gauges = gauges
        for name, doc in (("hyspec_slots_busy", "Slots running a request"),
                          ("hyspec_queue_length", "Admitted requests waiting for a slot"),
                          ("hyspec_streams_open", "Generate streams open"),
                          ("hyspec_ready", "1 while the server is SERVING (model loaded and warmed up)")):
            gauge = Gauge(name, doc, registry=r)
            gauge.set_function(self._reader(name))
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self.port: int | None = None

    def _reader(self, name: str) -> Callable[[], float]:
        return lambda: float(self._gauges().get(name, 0.0))

    def request(self, method: str, status: str, seconds: float | None = None) -> None:
        self.requests.labels(method=method, status=status).inc()
        if seconds is not None:
            self.duration.observe(seconds)

    def result(self, result: Result) -> None:
        s = result.stats
        self.generated.inc(s.completion_tokens)
        self.prompt.inc(s.prompt_tokens)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        self.rollbacks.inc(s.rollbacks)
        if s.completion_tokens > 0 and s.ttft_ms > 0:
            self.ttft.observe(s.ttft_ms / 1000.0)
        if s.completion_tokens > 1 and s.tokens_per_second > 0:
            self.tpot.observe(1.0 / s.tokens_per_second)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port) in a daemon thread; returns the port."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._http.server_port)
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._http_thread is not None:
            self._http_thread.join(5)
            self._http_thread = None
