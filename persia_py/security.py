"""Transport security of every gRPC server and channel: mutual TLS and the job token.

:func:`persia_py.rpc.create_server` and :func:`persia_py.rpc.create_channel` are the only
callers; no other module opens a socket with gRPC. Both take the settings from
:class:`~persia_py.config.CommonConfig`:

* TLS (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``): servers listen with TLS
  only and require a client certificate signed by the CA; channels present the same
  certificate and check the server's against the CA. A plaintext client never gets past
  the handshake.
* The job token (``auth_token_file``, else ``$PERSIA_AUTH_TOKEN``; never a command-line
  flag, which any local user could read in the process list): channels attach it to
  every call as ``authorization: Bearer <token>``; a server interceptor checks it with a
  constant-time compare on the call's metadata, and answers UNAUTHENTICATED without
  reading the request's body (let alone parsing it) when it is missing or wrong.
"""

from __future__ import annotations

import collections
import hmac
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from persia_py.config import CommonConfig, ConfigError

ENV_AUTH_TOKEN = "PERSIA_AUTH_TOKEN"
TOKEN_METADATA_KEY = "authorization"
_TOKEN_PREFIX = "Bearer "
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class TransportSecurity:
    """What a server or channel needs: PEM bytes of the TLS files and the token, if any."""

    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @classmethod
    def from_common(
        cls, common: CommonConfig, environ: Mapping[str, str] | None = None
    ) -> TransportSecurity:
        """Read the TLS files and the token named by ``common`` (token: file, else env)."""
        environ = os.environ if environ is None else environ
        pem = {}
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(common, name)
            pem[name] = None if path is None else _read(name, path)
        if common.auth_token_file is not None:
            token = _check_token(_read("auth_token_file", common.auth_token_file).decode(
                errors="replace").strip(), f"auth_token_file {common.auth_token_file!r}")
        elif environ.get(ENV_AUTH_TOKEN):
            token = _check_token(environ[ENV_AUTH_TOKEN].strip(), ENV_AUTH_TOKEN)
        else:
            token = None
        return cls(cert=pem["tls_cert_file"], key=pem["tls_key_file"], ca=pem["tls_ca_file"],
                   token=token)

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.tls, "server_credentials without TLS files"
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        assert self.tls, "channel_credentials without TLS files"
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [] if self.token is None else [TokenServerInterceptor(self.token)]

    def client_interceptors(self) -> list[grpc.UnaryUnaryClientInterceptor]:
        return [] if self.token is None else [TokenClientInterceptor(self.token)]


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path!r}: {exc.strerror}") from None


def _check_token(token: str, source: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or (
        any(c.isspace() for c in token)
    ):
        raise ConfigError(
            f"{source}: the job token must be at least {MIN_TOKEN_CHARS} printable ASCII "
            f"characters without spaces (e.g. python -c 'import secrets; "
            f"print(secrets.token_hex(32))')"
        )
    return token


class TokenServerInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks the job token."""

    def __init__(self, token: str) -> None:
        self._expected = (_TOKEN_PREFIX + token).encode()

        def deny(message: str) -> grpc.RpcMethodHandler:
            def abort(requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            # A request-streaming handler that never reads its requests: gRPC reads a
            # message only when the handler asks for it, so an unauthenticated body is
            # neither received in full nor copied nor parsed (a unary handler would get
            # the whole body, up to max_message_bytes, copied twice before it could refuse).
            return grpc.stream_unary_rpc_method_handler(abort)

        self._missing = deny(f"no job token in the call's {TOKEN_METADATA_KEY!r} metadata")
        self._wrong = deny("wrong job token")

    def intercept_service(self, continuation, handler_call_details):
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        if presented is None:
            return self._missing
        if not hmac.compare_digest(presented, self._expected):
            return self._wrong
        return continuation(handler_call_details)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Attaches the job token to every unary call of a channel."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_METADATA_KEY, _TOKEN_PREFIX + token)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details = _CallDetails(
            client_call_details.method,
            client_call_details.timeout,
            [*(client_call_details.metadata or ()), self._entry],
            client_call_details.credentials,
            client_call_details.wait_for_ready,
            client_call_details.compression,
        )
        return continuation(details, request)
