"""A bounded load test (issue 11): a real `hyspec serve` on loopback gets more streams than it
has slots plus queue, with cancels, deadlines and killed clients. Every accepted request
finishes with the tokens it gets alone (or the plain run's, where they differ at a near-tie),
every refused one is refused promptly, and the
server's memory and open streams come back to their baseline."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from exactness import assert_plain
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import KILLED_CLIENT, TIMEOUT, spawn_server, stop_process

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time", "def main():", "a b a b a b"]
TOKENS = 16
CLIENTS = 16  # concurrent, against 2 slots + 2 queued
ROUNDS = 3
# Seconds: a refusal takes milliseconds; the margin is for a 2-core machine shared with other work.
REFUSED_WITHIN = 2.0


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as response:
        lines = response.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines
            if line.startswith(("hyspec_streams_open ", "hyspec_slots_busy ", "hyspec_queue_length "))}


def _settled(port: int) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT
    while any((gauges := _gauges(port)).values()):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)
    return gauges


class _Client:
    """One simulated client's scripted behaviour; records what it saw."""

    def __init__(self, address: str, expected: dict[str, list[int]]) -> None:
        self.address = address
        self.expected = expected
        self.outcomes: Counter[str] = Counter()
        self.slow_refusals: list[float] = []
        self.slowest_refusal = 0.0
        self.differing: list[tuple[str, list[int]]] = []
        self.lock = threading.Lock()

    def _note(self, outcome: str, started: float | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if started is not None:
                took = time.monotonic() - started
                self.slowest_refusal = max(self.slowest_refusal, took)
                if took > REFUSED_WITHIN:
                    self.slow_refusals.append(took)

    def _check(self, prompt: str, tokens: list[int]) -> None:
        """The tokens the request gets alone, or (checked later, tie-aware) the plain run's:
        concurrent batches may differ from a lone request's only at true near-ties."""
        if tokens != self.expected[prompt]:
            with self.lock:
                self.differing.append((prompt, tokens))

    def run(self, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            [self._complete, self._stream, self._deadline, self._abandon][i % 4](stub, prompt)

    def _complete(self, stub: Any, prompt: str) -> None:
        """Retries a refused request a few times, as a polite client would."""
        for _ in range(4):
            started = time.monotonic()
            try:
                done = stub.Complete(pb2.GenerateRequest(text=prompt, max_tokens=TOKENS, ignore_eos=True),
                                     timeout=TIMEOUT)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                self._note("refused", started)
                time.sleep(0.05)
                continue
            self._check(prompt, list(done.token_ids))
            self._note("finished")
            return

    def _stream(self, stub: Any, prompt: str) -> None:
        """Two requests on one stream; the second is cancelled at its first chunk."""
        outgoing: list[Any] = [pb2.GenerateStreamRequest(request=pb2.GenerateRequest(
            request_id=rid, text=prompt, max_tokens=TOKENS if rid == "keep" else 200, ignore_eos=True))
            for rid in ("keep", "drop")]
        cancel = threading.Event()
        sent = threading.Event()

        def requests() -> Any:
            yield from outgoing
            cancel.wait(TIMEOUT)
            yield pb2.GenerateStreamRequest(cancel=pb2.CancelRequest(request_id="drop"))
            sent.set()

        started = time.monotonic()
        ended: dict[str, Any] = {}
        call = stub.Generate(requests(), timeout=TIMEOUT)
        for msg in call:
            kind = msg.WhichOneof("kind")
            if kind == "chunk" and msg.request_id == "drop":
                cancel.set()
            elif kind == "error":
                assert msg.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], msg
                self._note("refused", started)
            if kind != "chunk":
                ended[msg.request_id] = msg
                if msg.request_id == "drop":
                    cancel.set()
        assert call.code() == grpc.StatusCode.OK and set(ended) == {"keep", "drop"}
        for rid, msg in ended.items():
            if msg.WhichOneof("kind") == "error":
                continue
            if rid == "keep":
                self._check(prompt, list(msg.complete.token_ids))
                self._note("finished")
            else:
                assert msg.complete.finish_reason in (pb2.FINISH_REASON_CANCELLED, pb2.FINISH_REASON_LENGTH)
                self._note("cancelled")

    def _deadline(self, stub: Any, prompt: str) -> None:
        started = time.monotonic()
        try:
            stub.Complete(pb2.GenerateRequest(text=prompt, max_tokens=200, ignore_eos=True), timeout=0.2)
            self._note("finished")
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED), e
            self._note("deadline" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "refused",
                       started if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None)

    def _abandon(self, stub: Any, prompt: str) -> None:
        """Starts a long request and cancels the RPC (a client going away mid-generation)."""
        future = stub.Complete.future(pb2.GenerateRequest(text=prompt, max_tokens=200, ignore_eos=True),
                                      timeout=TIMEOUT)
        time.sleep(0.1)
        if future.cancel():
            self._note("abandoned")
        else:
            code = future.code()
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), code
            self._note("finished" if code == grpc.StatusCode.OK else "refused")


def test_load(tiny_lfm2: Path) -> None:
    printed: list[str] = []
    proc, address = spawn_server(tiny_lfm2, "--max-queue", "2", "--metrics-port", "0", "--log-format", "json",
                                 "--grace", "2", ctx=256, printed=printed)
    logs: list[str] = []
    drain = threading.Thread(target=lambda: logs.extend(proc.stderr or []), daemon=True)
    drain.start()
    killed: list[subprocess.Popen[str]] = []
    try:
        (metrics_line,) = [line for line in printed if "/metrics" in line]
        metrics_port = int(metrics_line.rsplit(":", 1)[1].split("/")[0])
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            expected = {p: list(stub.Complete(pb2.GenerateRequest(text=p, max_tokens=TOKENS, ignore_eos=True),
                                              timeout=TIMEOUT).token_ids) for p in PROMPTS}
            prompt_ids = {p: list(stub.Tokenize(pb2.TokenizeRequest(text=p), timeout=TIMEOUT).token_ids)
                          for p in PROMPTS}
        client = _Client(address, expected)
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client.run, range(CLIENTS)))  # a first round: the allocator's working set
        baseline = (_rss_kb(proc.pid), _settled(metrics_port))

        for _ in range(ROUNDS):
            victims = [subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, address, "200"],
                                        stdout=subprocess.PIPE, text=True) for _ in range(2)]
            killed += victims
            with ThreadPoolExecutor(CLIENTS) as pool:
                results = pool.map(client.run, range(CLIENTS))
                for victim in victims:  # killed once streaming, or once refused (it then ends by itself)
                    assert victim.stdout is not None
                    victim.stdout.readline()
                    victim.kill()
                list(results)
        after = (_rss_kb(proc.pid), _settled(metrics_port))
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            again = pb2_grpc.GenerationStub(channel).Complete(
                pb2.GenerateRequest(text=PROMPTS[1], max_tokens=TOKENS, ignore_eos=True), timeout=TIMEOUT)
            assert_plain(tiny_lfm2, prompt_ids[PROMPTS[1]], list(again.token_ids))

        outcomes = client.outcomes
        total = sum(outcomes.values()) + len(killed)
        print(f"\nload test: {total} requests over {ROUNDS + 1} rounds of {CLIENTS} clients (+{len(killed)} killed "
              f"clients): {dict(outcomes)}; slowest refusal {client.slowest_refusal * 1000:.0f} ms; "
              f"RSS {baseline[0] / 1024:.1f} MB before, {after[0] / 1024:.1f} MB after; "
              f"open streams {baseline[1]['hyspec_streams_open']:.0f} before, "
              f"{after[1]['hyspec_streams_open']:.0f} after")
        assert outcomes["refused"] > 0 and outcomes["finished"] > 0 and outcomes["deadline"] > 0
        for prompt, tokens in client.differing:
            assert_plain(tiny_lfm2, prompt_ids[prompt], tokens)
        print(f"load test: {len(client.differing)} output(s) differed from the lone run at a near-tie")
        assert client.slow_refusals == []
        assert after[1] == baseline[1] == {"hyspec_streams_open": 0.0, "hyspec_slots_busy": 0.0,
                                           "hyspec_queue_length": 0.0}
        assert after[0] - baseline[0] < 30 * 1024, (baseline[0], after[0])
    finally:
        for victim in killed:
            stop_process(victim)
        stop_process(proc)
        drain.join(TIMEOUT)
    lines = [json.loads(line) for line in logs if line.startswith("{")]
    assert len(lines) == len([line for line in logs if line.strip()])  # --log-format json: nothing else
    statuses = Counter(line.get("status") for line in lines if line.get("method") in ("Complete", "Generate"))
    assert statuses["OK"] > 0 and statuses["RESOURCE_EXHAUSTED"] > 0 and statuses["CANCELLED"] > 0
