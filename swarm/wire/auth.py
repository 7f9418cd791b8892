"""Authenticated calls in a private swarm: a client interceptor that puts the member's certificate and
a fresh signature on every call, and a server interceptor that refuses any call without a valid one
(UNAUTHENTICATED), before its handler runs (swarm.core.auth holds the checks)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import grpc

from swarm.core.auth import AuthError, CallProof, Verifier
from swarm.core.keys import SigningKey, b64, unb64

logger = logging.getLogger(__name__)

CERT_KEY = "swarm-cert"
CALL_KEY = "swarm-call"
# a refused streaming call: how long and how many messages the server reads before answering (see _drain)
DENY_DRAIN_S = 1.0
DENY_DRAIN_MESSAGES = 8


class MemberCredentials:
    """A member's key and its current certificate (replaced when renewed, from another thread), and
    the run's CA when its gRPC is over TLS (swarm.wire.tls)."""

    def __init__(self, key: SigningKey, certificate: str = "", tls_ca: bytes | None = None) -> None:
        self.key = key
        self.tls_ca = tls_ca
        self._certificate = certificate
        self._lock = threading.Lock()

    @property
    def certificate(self) -> str:
        with self._lock:
            return self._certificate

    @certificate.setter
    def certificate(self, text: str) -> None:
        with self._lock:
            self._certificate = text

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        proof = CallProof.make(self.key, self.certificate, method)
        call = json.dumps({"ts": proof.ts, "nonce": b64(proof.nonce), "sig": b64(proof.signature)})
        return ((CERT_KEY, proof.cert), (CALL_KEY, call))


def _method(details) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else method


class _Signer:
    """Puts the member's credentials on a call's metadata."""

    def __init__(self, credentials: MemberCredentials) -> None:
        self.credentials = credentials

    def _details(self, details):
        metadata = [*(details.metadata or ()), *self.credentials.metadata(_method(details))]
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryAuth(_Signer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamAuth(_Signer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryAuth(_Signer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamAuth(_Signer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def client_auth(credentials: MemberCredentials) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that sign every call of a channel with the member's credentials: one per call
    shape, because grpc.aio files an interceptor under the first shape it implements only (an
    if/elif in grpc.aio's channel): one class implementing all four signed unary-unary calls alone,
    and streams (GetState, GetLedger, GetPartialGradient, ForwardStream, BackwardStream) went out
    without a proof."""
    return [cls(credentials) for cls in (_UnaryUnaryAuth, _UnaryStreamAuth, _StreamUnaryAuth, _StreamStreamAuth)]


def proof_of(metadata) -> CallProof:
    values = dict(metadata or ())
    if CERT_KEY not in values or CALL_KEY not in values:
        raise AuthError("no membership certificate on the call (this is a private swarm)")
    try:
        call = json.loads(values[CALL_KEY])
        return CallProof(str(values[CERT_KEY]), float(call["ts"]), unb64(call["nonce"]), unb64(call["sig"]))
    except (ValueError, KeyError, TypeError) as e:
        raise AuthError(f"malformed call signature: {e}") from None


def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield b""  # pragma: no cover - abort raises

    async def unary_in(requests, context):
        await _drain(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming_in(requests, context):
        await _drain(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield b""  # pragma: no cover - abort raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming_in)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_in)
    return grpc.unary_unary_rpc_method_handler(unary)


async def _drain(requests) -> None:
    """Read what a refused client is still sending, a little of it and briefly: a status sent while the
    client's request stream is open can reach it as INTERNAL (the stream reset) instead of UNAUTHENTICATED."""
    try:
        async with asyncio.timeout(DENY_DRAIN_S):
            count = 0
            async for _ in requests:
                count += 1
                if count >= DENY_DRAIN_MESSAGES:
                    return
    except (TimeoutError, grpc.RpcError):
        return


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry a valid member's proof."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        try:
            self.verifier.check_call(proof_of(handler_call_details.invocation_metadata), _method(handler_call_details))
        except AuthError as e:
            self.refused += 1
            logger.debug("refused %s: %s", _method(handler_call_details), e)
            return _deny(handler, str(e))
        return handler
