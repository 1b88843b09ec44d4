"""hyspec as a service: a ``hyspec serve`` child and a gRPC client timing it end to end.

The client keeps one channel open (as a real client would) and sends each request on a
Generate stream, so tokens arrive as the server streams them; it times the first chunk and
the final result on its side of the wire.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc

from hyspec import convert
from hyspec.bench.records import Run
from hyspec.bench.system import ManagedProcess, end_process, tail
from hyspec.bench.worker import WorkerConfig
from hyspec.types import GenerationRequest, SpecMode, SpecParams
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc

log = logging.getLogger("hyspec.bench")

_READY = "hyspec: ready on "


class ServiceError(RuntimeError):
    pass


class HyspecService(ManagedProcess):
    """A running ``hyspec serve`` on a free loopback port. Use as a context manager."""

    def __init__(self, config: WorkerConfig, log_path: Path, *, env: dict[str, str] | None = None,
                 start_timeout: float = 600.0) -> None:
        argv = [sys.executable, "-m", "hyspec", "serve", "--model", config.model, "--slots", str(config.slots),
                "--ctx", str(config.ctx), "--threads", str(config.threads), "--batch", str(config.batch),
                "--draft-max", str(config.draft_max), "--spec", "off", "--port", "0", "--log-level", "warning"]
        if config.draft:
            argv += ["--draft", config.draft]
        if not config.adaptive_draft:
            argv.append("--fixed-draft")
        if config.rs_snapshots is not None:
            argv += ["--rs-snapshots", str(config.rs_snapshots)]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.address: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, name="hyspec-serve-stdout", daemon=True)
        self._reader.start()
        self._channel: grpc.Channel | None = None
        self._stub: pb2_grpc.GenerationStub | None = None

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # read to the end so the child never blocks on a full pipe
            if line.startswith(_READY):
                self.address = line[len(_READY):].strip()
                self._ready.set()
        self._ready.set()  # exited: wait_ready() sees no address

    def wait_ready(self) -> None:
        if not self._ready.wait(self.start_timeout) or self.address is None:
            raise ServiceError(f"hyspec serve did not become ready; its log ({self.log_path}) ends with:\n"
                               f"{tail(self.log_path)}")
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pb2_grpc.GenerationStub(self._channel)

    def complete(self, prompt: list[int], *, max_tokens: int, spec: str, draft_max: int) -> Run:
        assert self._stub is not None, "wait_ready() first"
        request = GenerationRequest(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                    spec=SpecParams(mode=SpecMode(spec), draft_max=draft_max))
        msg = convert.request_to_proto(request)
        msg.request_id = f"bench-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        first: float | None = None
        result = None
        for response in self._stub.Generate(iter([pb2.GenerateStreamRequest(request=msg)])):
            kind = response.WhichOneof("kind")
            if kind == "chunk" and first is None:
                first = time.perf_counter()
            elif kind == "complete":
                result = convert.result_from_proto(response.complete)
            elif kind == "error":
                raise ServiceError(f"hyspec serve: {response.error.message}")
        wall = time.perf_counter() - t0
        if result is None:
            raise ServiceError("hyspec serve ended the stream without a result")
        s = result.stats
        return Run(tokens=result.token_ids, tokens_per_second=s.tokens_per_second,
                   ttft_ms=((first or t0 + wall) - t0) * 1000.0, drafted=s.drafted, accepted=s.accepted,
                   rollbacks=s.rollbacks, replayed=s.replayed_tokens, wall_s=wall)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the graceful shutdown
            end_process(self.proc)
        self._reader.join(timeout=5)
        self._log.close()

