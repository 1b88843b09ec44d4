"""A small synchronous client: one request on a hyspec server, as the in-process engine gives it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TextIO

import grpc

from hyspec import convert
from hyspec.types import GenerationRequest, RequestError, Result
from hyspec.v1 import hyspec_pb2 as pb2
from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc


def channel(address: str, *, root_ca: Path | None = None, client_cert: Path | None = None,
            client_key: Path | None = None) -> grpc.Channel:
    """A channel to a hyspec server: plaintext, or TLS trusting ``root_ca`` (and presenting a
    client certificate for mTLS when ``client_cert`` and ``client_key`` are given)."""
    if root_ca is None:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(root_ca).read_bytes(),
        private_key=Path(client_key).read_bytes() if client_key else None,
        certificate_chain=Path(client_cert).read_bytes() if client_cert else None)
    return grpc.secure_channel(address, credentials)


def generate_remote(address: str, request: GenerationRequest, stream_to: TextIO | None = None, *,
                    timeout: float | None = None, root_ca: Path | None = None, token: str | None = None,
                    client_cert: Path | None = None, client_key: Path | None = None) -> Result:
    """Run ``request`` on the server at ``address`` ("host:port" or "unix:PATH") and return its
    Result, writing the text to ``stream_to`` as it arrives when given. ``root_ca``: connect
    with TLS (``client_cert``/``client_key`` for mTLS); ``token``: a bearer token to send.

    Uses a Generate stream (so text streams) carrying this one request. Raises RequestError
    with the server's code (INVALID_ARGUMENT, OUT_OF_RANGE, RESOURCE_EXHAUSTED, UNAVAILABLE;
    INTERNAL for anything else, the status name then leads the message).
    """
    msg = convert.request_to_proto(request)
    msg.request_id = request.request_id or f"client-{uuid.uuid4().hex[:12]}"
    result: Result | None = None
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with channel(address, root_ca=root_ca, client_cert=client_cert, client_key=client_key) as chan:
        stub = pb2_grpc.GenerationStub(chan)
        # One request, then half-close: the server finishes it and ends the stream.
        call = stub.Generate(iter([pb2.GenerateStreamRequest(request=msg)]), timeout=timeout, metadata=metadata)
        try:
            for response in call:
                kind = response.WhichOneof("kind")
                if kind == "chunk":
                    if stream_to is not None and response.chunk.text:
                        stream_to.write(response.chunk.text)
                        stream_to.flush()
                elif kind == "complete":
                    result = convert.result_from_proto(response.complete)
                elif kind == "error":
                    code = convert.status_from_number(response.error.code)
                    raise _request_error(code, response.error.message)
        except grpc.RpcError as e:
            raise _request_error(e.code(), e.details() or "") from None
        except BaseException:
            call.cancel()  # e.g. Ctrl-C: the server cancels the request and frees its slot
            raise
    if result is None:
        raise _request_error(grpc.StatusCode.INTERNAL, "the server ended the stream without a result")
    return result


def _request_error(code: grpc.StatusCode, message: str) -> RequestError:
    error = convert.error_code(code)
    if error.value != code.name:
        message = f"{code.name}: {message}"
    return RequestError(error, message)
