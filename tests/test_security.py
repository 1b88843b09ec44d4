"""TLS, mTLS and bearer tokens (issue 11): who may call the server, and what never leaks."""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hyspec.client import channel as client_channel
from hyspec.client import generate_remote
from hyspec.engine import Engine, EngineConfig
from hyspec.security import Security, TokenStore, bearer_token, is_loopback
from hyspec.types import ErrorCode, GenerationRequest, RequestError
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
from serving import TIMEOUT, StreamClient, ThreadServer, running, spawn_server, status_of, stop_process

TOKENS = ("s3cret-token-alpha", "s3cret-token-beta")
WRONG = "s3cret-token-gamma"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


# ---- certificates ---------------------------------------------------------------------------------


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
          ca: bool, server: bool = False) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (server and client certificates), rogue (an unrelated CA and a client of its own)."""
    d = tmp_path_factory.mktemp("pki")
    for ca_name, leaves in (("ca", (("server", True), ("client", False))), ("rogue", (("rogue-client", False),))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, ca_key, None, ca=True)
        _write(d, ca_name, ca_cert, ca_key)
        for leaf, is_server in leaves:
            key = ec.generate_private_key(ec.SECP256R1())
            _write(d, leaf, _cert(leaf, key, (ca_cert.subject, ca_key), ca=False, server=is_server), key)
    return d


# ---- servers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_lfm2: Path) -> Iterator[Engine]:
    with Engine(EngineConfig(model=tiny_lfm2, slots=2, ctx=256, threads=2, max_queue=4)) as e:
        yield e


@pytest.fixture()
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# operators\n{TOKENS[0]}\n\n  {TOKENS[1]}  \n")
    return path


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


REQUEST = pb2.GenerateRequest(text="x", max_tokens=2, ignore_eos=True)


def test_tls_and_mtls(engine: Engine, pki: Path) -> None:
    with running(engine, security=Security(tls_cert=pki / "server.crt", tls_key=pki / "server.key")) as tls:
        with client_channel(tls.address, root_ca=pki / "ca.crt") as chan:
            assert len(pb2_grpc.GenerationStub(chan).Complete(REQUEST, timeout=TIMEOUT).token_ids) == 2
        with grpc.insecure_channel(tls.address) as plain:
            assert status_of(lambda: pb2_grpc.GenerationStub(plain).Complete(REQUEST, timeout=5)) \
                == grpc.StatusCode.UNAVAILABLE
        with client_channel(tls.address, root_ca=pki / "rogue.crt") as untrusted:
            assert status_of(lambda: pb2_grpc.GenerationStub(untrusted).Complete(REQUEST, timeout=5)) \
                == grpc.StatusCode.UNAVAILABLE

    mtls_security = Security(tls_cert=pki / "server.crt", tls_key=pki / "server.key", tls_client_ca=pki / "ca.crt")
    with running(engine, security=mtls_security) as mtls:
        with client_channel(mtls.address, root_ca=pki / "ca.crt", client_cert=pki / "client.crt",
                            client_key=pki / "client.key") as chan:
            assert len(pb2_grpc.GenerationStub(chan).Complete(REQUEST, timeout=TIMEOUT).token_ids) == 2
        for cert in (None, "rogue-client"):
            kwargs = {} if cert is None else {"client_cert": pki / f"{cert}.crt", "client_key": pki / f"{cert}.key"}
            with client_channel(mtls.address, root_ca=pki / "ca.crt", **kwargs) as chan:
                assert status_of(lambda c=chan: pb2_grpc.GenerationStub(c).Complete(REQUEST, timeout=5)) \
                    == grpc.StatusCode.UNAVAILABLE, cert


def test_security_settings_are_checked(pki: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        Security(tls_cert=pki / "server.crt")
    with pytest.raises(ValueError, match="needs --tls-cert"):
        Security(tls_client_ca=pki / "ca.crt")
    with pytest.raises(ValueError, match="--tls-key"):
        Security(tls_cert=pki / "server.crt", tls_key=pki / "missing.key").server_credentials()
    with pytest.raises(ValueError, match="--auth-token-file"):
        TokenStore(pki / "missing-tokens")


def test_tokens(engine: Engine, token_file: Path, pki: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    security = Security(tls_cert=pki / "server.crt", tls_key=pki / "server.key", auth_token_file=token_file)
    with running(engine, security=security) as s:
        with client_channel(s.address, root_ca=pki / "ca.crt") as chan:
            stub = pb2_grpc.GenerationStub(chan)
            # Health answers without a token (Kubernetes probes).
            health = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            # Everything else needs one: the service and reflection.
            for metadata in (None, _auth(WRONG), [("authorization", TOKENS[0])], _auth("")):
                assert status_of(lambda m=metadata: stub.Complete(REQUEST, timeout=TIMEOUT, metadata=m)) \
                    == UNAUTHENTICATED
            assert status_of(lambda: stub.Tokenize(pb2.TokenizeRequest(text="x"), timeout=TIMEOUT)) \
                == UNAUTHENTICATED
            stream = StreamClient(stub, metadata=_auth(WRONG))
            stream.send(request_id="a", text="x", max_tokens=2)
            stream.half_close()
            assert status_of(lambda: list(stream)) == UNAUTHENTICATED
            reflect = reflection_pb2_grpc.ServerReflectionStub(chan)
            listing = reflection_pb2.ServerReflectionRequest(list_services="")
            assert status_of(lambda: list(reflect.ServerReflectionInfo(iter([listing]), timeout=TIMEOUT))) \
                == UNAUTHENTICATED
            services = list(reflect.ServerReflectionInfo(iter([listing]), timeout=TIMEOUT, metadata=_auth(TOKENS[1])))
            assert "hyspec.v1.Generation" in {s.name for s in services[0].list_services_response.service}
            for token in TOKENS:
                assert len(stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth(token)).token_ids) == 2
            assert stub.Complete(REQUEST, timeout=TIMEOUT, metadata=[("authorization", f"bearer  {TOKENS[0]}")])
            # The client library sends one too.
            request = GenerationRequest(text="x", max_tokens=2, ignore_eos=True)
            assert generate_remote(s.address, request, root_ca=pki / "ca.crt", token=TOKENS[1]).token_ids
            with pytest.raises(RequestError) as err:
                generate_remote(s.address, request, root_ca=pki / "ca.crt", token=WRONG)
            assert err.value.code is ErrorCode.INTERNAL and "UNAUTHENTICATED" in err.value.message

            # Reloading (what SIGHUP does): the new file is in force at once.
            token_file.write_text("s3cret-token-delta\n")
            assert s.server.reload_tokens()
            assert status_of(lambda: stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth(TOKENS[0]))) \
                == UNAUTHENTICATED
            assert stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth("s3cret-token-delta")).token_ids
            token_file.unlink()  # a failed reload keeps the tokens in force
            assert not s.server.reload_tokens()
            assert stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth("s3cret-token-delta")).token_ids
        exposition = s.server.metrics.exposition().decode()
        for method, refused in (("Complete", 5), ("Generate", 2), ("Tokenize", 1)):
            assert f'hyspec_requests_total{{method="{method}",status="UNAUTHENTICATED"}} {refused}.0' in exposition
    logged = caplog.text + "".join(str(r.args) + str(r.__dict__) for r in caplog.records)
    assert "loaded 2 bearer token(s)" in caplog.text
    for secret in (*TOKENS, WRONG, "s3cret-token-delta"):
        assert secret not in logged


def test_tokens_are_compared_in_constant_time(token_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = TokenStore(token_file)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for candidate, accepted in ((TOKENS[0], True), (TOKENS[1], True), (WRONG, False), (TOKENS[0][:-1], False),
                                (TOKENS[0] + "x", False), ("", False)):
        compared.clear()
        assert store.accepts(candidate) is accepted
        # Every configured token is compared, whichever matches, and only fixed-size digests
        # are: neither where a match is nor the tokens' lengths show in the time taken.
        assert len(compared) == len(TOKENS)
        assert {len(a) for a, _ in compared} == {len(b) for _, b in compared} == {32}


def test_bearer_header_parsing() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("Authorization", "BEARER abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x-other", "Bearer abc")]) is None
    assert bearer_token(None) is None


def test_sighup_reloads_the_token_file(tiny_lfm2: Path, token_file: Path) -> None:
    proc, address = spawn_server(tiny_lfm2, "--auth-token-file", str(token_file), ctx=256)
    try:
        with grpc.insecure_channel(address) as chan:
            stub = pb2_grpc.GenerationStub(chan)
            assert stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth(TOKENS[0])).token_ids
            token_file.write_text("s3cret-token-epsilon\n")
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    assert stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth("s3cret-token-epsilon")).token_ids
                    break
                except grpc.RpcError as e:
                    assert e.code() == UNAUTHENTICATED and time.monotonic() < deadline
                    time.sleep(0.05)
            assert status_of(lambda: stub.Complete(REQUEST, timeout=TIMEOUT, metadata=_auth(TOKENS[0]))) \
                == UNAUTHENTICATED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        out, err = proc.communicate()
        assert "loaded 1 bearer token(s)" in err
        for secret in (*TOKENS, "s3cret-token-epsilon"):
            assert secret not in out + err
    finally:
        stop_process(proc)


def test_exposed_without_tls_or_tokens_warns(engine: Engine, token_file: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("192.168.1.10")

    def warnings(**kwargs: Any) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyspec.server"):
            s = ThreadServer(engine, port=0, grace=1.0, **kwargs)
            s.stop()
        return [r.getMessage() for r in caplog.records if r.name == "hyspec.server" and r.levelno == logging.WARNING]

    (open_to_all,) = warnings(host="0.0.0.0")
    assert "TLS" in open_to_all and "bearer tokens" in open_to_all
    (plaintext,) = warnings(host="0.0.0.0", security=Security(auth_token_file=token_file))
    assert "TLS" in plaintext and "bearer tokens" not in plaintext
    assert warnings(host="127.0.0.1") == []
