"""Prometheus metrics on --metrics-port and JSON log lines (issue 11)."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hyspec.engine import Engine, EngineConfig
from hyspec.logs import JsonFormatter, configure
from hyspec.server import StartError
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serving import TIMEOUT, StreamClient, ThreadServer, running, status_of

# Every metric the README documents, with its type.
METRICS = {
    "hyspec_requests": "counter", "hyspec_generated_tokens": "counter", "hyspec_prompt_tokens": "counter",
    "hyspec_draft_tokens": "counter", "hyspec_accepted_tokens": "counter", "hyspec_rollbacks": "counter",
    "hyspec_time_to_first_token_seconds": "histogram", "hyspec_time_per_output_token_seconds": "histogram",
    "hyspec_request_duration_seconds": "histogram", "hyspec_slots_busy": "gauge", "hyspec_queue_length": "gauge",
    "hyspec_streams_open": "gauge", "hyspec_ready": "gauge",
}


@pytest.fixture(scope="module")
def server(tiny_lfm2_echo: Path) -> Iterator[ThreadServer]:
    """One slot (a second request queues), n-gram drafting on a model that repeats itself; fixed
    drafts, so that the draft counters move whatever the cost policy makes of this machine's timing."""
    with Engine(EngineConfig(model=tiny_lfm2_echo, slots=1, ctx=512, threads=2, max_queue=2,
                             adaptive_draft=False)) as engine:
        with running(engine, metrics_port=0) as s:
            yield s


def _scrape(server: ThreadServer) -> dict[str, float]:
    """Every sample over HTTP, keyed by name{labels}."""
    port = server.server.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            le = sample.labels.get("le")
            key = sample.name + (f"{{{labels}}}" if labels else "") + (f"[le={le}]" if le else "")
            samples[key] = sample.value
    assert {name: types.get(name) for name in METRICS} == METRICS
    return samples


def _wait_for(server: ThreadServer, key: str, value: float) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT
    while (samples := _scrape(server)).get(key) != value:
        assert time.monotonic() < deadline, (key, samples.get(key))
        time.sleep(0.02)
    return samples


def test_metrics_count_what_the_clients_saw(server: ThreadServer) -> None:
    before = _scrape(server)
    assert before["hyspec_ready"] == 1.0 and before["hyspec_streams_open"] == 0.0
    results: list[Any] = []
    with grpc.insecure_channel(server.address) as channel:
        stub = pb2_grpc.GenerationStub(channel)
        results.append(stub.Complete(pb2.GenerateRequest(text="a b a b a b a b", max_tokens=24, ignore_eos=True,
                                                         spec_mode=pb2.SPEC_MODE_NGRAM), timeout=TIMEOUT))
        assert status_of(lambda: stub.Complete(pb2.GenerateRequest(max_tokens=2), timeout=TIMEOUT)) \
            == grpc.StatusCode.INVALID_ARGUMENT
        stream = StreamClient(stub)
        stream.send(request_id="long", text="x", max_tokens=400, ignore_eos=True)
        responses = iter(stream)
        assert next(responses).request_id == "long"
        stream.send(request_id="queued", text="y", max_tokens=3, ignore_eos=True)
        live = _wait_for(server, "hyspec_queue_length", 1.0)
        assert live["hyspec_slots_busy"] == 1.0 and live["hyspec_streams_open"] == 1.0
        stream.cancel("long")
        for msg in responses:
            if msg.WhichOneof("kind") == "complete":
                results.append(msg.complete)
                if len(results) == 3:
                    stream.half_close()
    after = _wait_for(server, "hyspec_streams_open", 0.0)
    assert after["hyspec_slots_busy"] == after["hyspec_queue_length"] == 0.0

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew('hyspec_requests_total{method="Complete",status="OK"}') == 1
    assert grew('hyspec_requests_total{method="Complete",status="INVALID_ARGUMENT"}') == 1
    assert grew('hyspec_requests_total{method="Generate",status="OK"}') == 2  # one of them cancelled
    stats = [r.stats for r in results]
    assert grew("hyspec_generated_tokens_total") == sum(s.completion_tokens for s in stats)
    assert grew("hyspec_prompt_tokens_total") == sum(s.prompt_tokens for s in stats)
    assert grew("hyspec_draft_tokens_total") == sum(s.drafted for s in stats) > 0
    assert grew("hyspec_accepted_tokens_total") == sum(s.accepted for s in stats)
    assert grew("hyspec_rollbacks_total") == sum(s.rollbacks for s in stats)
    assert grew("hyspec_time_to_first_token_seconds_count") == 3
    assert grew("hyspec_time_per_output_token_seconds_count") == 3
    assert grew("hyspec_request_duration_seconds_count") == 4
    ttft = sum(s.ttft_ms for s in stats) / 1000.0
    assert grew("hyspec_time_to_first_token_seconds_sum") == pytest.approx(ttft, rel=1e-6)
    assert grew("hyspec_request_duration_seconds_bucket[le=+Inf]") == 4


def test_json_log_lines(server: ThreadServer) -> None:
    out = io.StringIO()
    root = logging.getLogger()
    level = root.level
    configure("info", "json", stream=out)
    prompt, weird = "The secret prompt text", 'id "with" quotes\nand a newline'
    try:
        with grpc.insecure_channel(server.address) as channel:
            done = pb2_grpc.GenerationStub(channel).Complete(
                pb2.GenerateRequest(request_id=weird, text=prompt, max_tokens=6, ignore_eos=True), timeout=TIMEOUT)
    finally:
        for handler in [h for h in root.handlers if isinstance(h.formatter, JsonFormatter)]:
            root.removeHandler(handler)
        root.setLevel(level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]  # every line is one JSON object
    (line,) = [x for x in lines if x.get("request_id") == weird]
    assert line["method"] == "Complete" and line["status"] == "OK" and line["level"] == "info"
    assert line["prompt_tokens"] == done.stats.prompt_tokens and line["completion_tokens"] == 6
    assert line["ttft_ms"] > 0 and line["duration_ms"] > 0 and line["finish_reason"] == "length"
    assert "\n" not in line["message"] and line["logger"] == "hyspec.server"
    assert prompt not in out.getvalue() and done.text not in out.getvalue()


def test_a_taken_metrics_port_stops_the_start() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(StartError, match="cannot serve metrics"):
            ThreadServer(lambda: None, port=0, metrics_port=taken.getsockname()[1])
    finally:
        taken.close()
