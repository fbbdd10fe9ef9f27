"""TLS for every gRPC port and bearer-token auth for trainers and workers.

- TLS: a service given a certificate and key serves TLS only; given a CA file, its own
  outgoing channels (scheduler -> workers and history, workers -> scheduler and history)
  verify peers against that CA. One certificate for the whole deployment is the usual
  setup in a cluster: set ``tls_server_name`` to the name it was issued for, since
  workers are reached by pod IP. TLS authenticates servers only (no client
  certificates are asked for): callers are authenticated by their bearer tokens.
- Auth: the scheduler's RolloutService (the trainer-facing API) accepts a call only with
  ``authorization: Bearer <token>`` naming one of its trainer tokens, and its
  RegistryService (workers registering, beating, leaving: on the same port) only with
  one of its worker tokens; anything else is UNAUTHENTICATED before the method runs,
  so a rejected step leaves no trace (no step, no history) and no worker is added or
  removed. Health checks stay open (Kubernetes probes); the internal services
  (WorkerService, HistoryService) are fenced by the NetworkPolicy instead.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials to serve with, or None (plaintext) when no certificate is set."""
        if not (self.cert_file or self.key_file):
            return None
        if not (self.cert_file and self.key_file):
            raise ValueError("--tls-cert-file and --tls-key-file (TLS_CERT_FILE, TLS_KEY_FILE) must be set together")
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        return grpc.ssl_server_credentials([pair])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for outgoing channels, or None (plaintext) when no CA is set."""
        return grpc.ssl_channel_credentials(Path(self.ca_file).read_bytes()) if self.ca_file else None

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name and self.ca_file else []


class TLSSettings(BaseSettings):
    """TLS fields every service's settings share (``RHYMERL_<SERVICE>_TLS_*``)."""

    tls_cert_file: str = Field("", description="PEM certificate to serve with (with --tls-key-file); empty: "
                                               "plaintext.")
    tls_key_file: str = Field("", description="PEM private key of the certificate (--tls-cert-file).")
    tls_ca_file: str = Field("", description="PEM CA that signed the other services' certificates; empty: plaintext "
                                             "outgoing channels.")
    tls_server_name: str = Field("", description="The name in the services' certificate (peers are reached by IP); "
                                                 "empty: the address.")
    # Kubernetes probes cannot speak TLS.
    health_port: int = Field(0, ge=0, le=65535, description="With TLS: a plaintext port serving only grpc.health.v1; 0: none.")

    @model_validator(mode="after")
    def _tls_files(self) -> "TLSSettings":
        prefix = self.model_config.get("env_prefix", "")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"--tls-cert-file and --tls-key-file ({prefix}TLS_CERT_FILE, {prefix}TLS_KEY_FILE) "
                             "must be set together")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')} ({prefix}{name.upper()}): no such file: {path}")
        return self

    def tls(self) -> TLSConfig:
        return TLSConfig(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Rejects calls to ``services`` that lack a valid bearer token with UNAUTHENTICATED.

    Args:
        tokens: the accepted tokens (compared in constant time).
        services: full service names to protect, e.g. "rhymerl.v1.RolloutService".
    """

    def __init__(self, tokens: Iterable[str], services: Iterable[str]):
        self._tokens = [t.encode() for t in tokens if t]
        if not self._tokens:
            raise ValueError("BearerTokenAuth needs at least one non-empty token")
        self._prefixes = tuple(f"/{s}/" for s in services)

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, given = value.partition(" ")
                if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
                    return False
                given = given.strip(" ").encode()
                return any(hmac.compare_digest(given, token) for token in self._tokens)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(self._prefixes)
                or self._authorized(handler_call_details.invocation_metadata)):
            return handler
        return _denied(handler, handler_call_details.method)


def _denied(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only aborts UNAUTHENTICATED."""
    message = f"{method}: missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.stream_stream_rpc_method_handler(stream)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token`` to a BearerTokenAuth (none for an empty one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def parse_tokens(value: str) -> list[str]:
    """Comma- or newline-separated tokens (a Secret may hold either)."""
    return [t.strip() for t in value.replace("\n", ",").split(",") if t.strip()]
