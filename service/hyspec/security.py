"""TLS/mTLS credentials and bearer tokens for the gRPC server.

Tokens live in a file, one per line (blank lines and ``#`` comments ignored), re-read on
SIGHUP. Clients send ``authorization: Bearer <token>``. A token is compared with every
configured one in constant time (SHA-256 digests, so their lengths do not leak either), and
tokens are never logged. grpc.health.v1 answers without a token, for probes; everything else
(hyspec.v1.Generation, reflection) needs one when tokens are configured.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("hyspec.security")

HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class Security:
    """What ``hyspec serve`` was given: TLS files and the token file (all optional)."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # client certificates required (mTLS) when given
    auth_token_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS with client certificates)")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the TCP port (None: plaintext). Raises ValueError for unreadable files."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        cert, key = _read(self.tls_cert, "--tls-cert"), _read(self.tls_key, "--tls-key")
        client_ca = _read(self.tls_client_ca, "--tls-client-ca") if self.tls_client_ca is not None else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)


def _read(path: Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenStore:
    """The accepted bearer tokens, loaded from a file and reloadable (thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._digests: tuple[bytes, ...] = ()
        self.reload(initial=True)

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self, initial: bool = False) -> bool:
        """Re-read the file. On the first load a bad file raises ValueError; later, it is logged
        and the tokens already loaded stay in force. True when the new tokens took effect."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            message = f"--auth-token-file {self.path}: {getattr(e, 'strerror', None) or e}"
            if initial:
                raise ValueError(message) from None
            log.error("%s; keeping the %d token(s) already loaded", message, len(self._digests))
            return False
        tokens = [line.strip() for line in lines]
        digests = tuple(_digest(t) for t in tokens if t and not t.startswith("#"))
        with self._lock:
            self._digests = digests
        if not digests:
            log.warning("--auth-token-file %s holds no token: every call but health checks is refused", self.path)
        else:
            log.info("loaded %d bearer token(s) from %s", len(digests), self.path)
        return True

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is one of the configured tokens, in time independent of which one
        matches and of where a wrong token differs."""
        given = _digest(token)
        with self._lock:
            digests = self._digests
        ok = False
        for digest in digests:
            ok |= hmac.compare_digest(given, digest)
        return ok


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, if there is one."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without an accepted token, except grpc.health.v1.

    ``on_refused(method)`` is told of every refusal (metrics); it never sees the token."""

    def __init__(self, tokens: TokenStore, on_refused: Callable[[str], None] | None = None) -> None:
        self.tokens = tokens
        self.on_refused = on_refused

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is not None and self.tokens.accepts(token):
            return handler
        if self.on_refused is not None:
            self.on_refused(method)
        message = "a bearer token is required (metadata 'authorization: Bearer <token>')" if token is None \
            else "the bearer token is not accepted"
        return _refusal(handler, message)


def _refusal(handler: Any, message: str) -> Any:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a name other than localhost, or a wildcard such as "" / "0.0.0.0"
