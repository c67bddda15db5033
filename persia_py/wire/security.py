"""Transport security of every gRPC server and channel: mutual TLS and the job token.

:func:`persia_py.wire.rpc.create_server` and :func:`persia_py.wire.rpc.create_channel` are the only
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
  A token easy to guess (short, a string repeated, few bits of randomness in its
  characters) and a token file that others may read or write are refused, unless
  ``$PERSIA_INSECURE_TOKEN`` is 1 (``persia-launcher ... --insecure-token``).
"""

from __future__ import annotations

import collections
import hmac
import math
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from persia_py.config import CommonConfig, ConfigError

ENV_AUTH_TOKEN = "PERSIA_AUTH_TOKEN"
TOKEN_METADATA_KEY = "authorization"
_TOKEN_PREFIX = "Bearer "
ENV_INSECURE_TOKEN = "PERSIA_INSECURE_TOKEN"
"""1: accept a token easy to guess and a token file others can use (``--insecure-token``)."""
MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 32
"""Least randomness a token's characters must carry, as :func:`token_weakness` estimates
it (a random 16-character hex token: 34 bits or more in millions of draws)."""
_HOW_TO_MAKE = "python -c 'import secrets; print(secrets.token_hex(32))'"
_OPT_OUT = f"or pass --insecure-token ({ENV_INSECURE_TOKEN}=1) to accept it"


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
        insecure = environ.get(ENV_INSECURE_TOKEN) == "1"
        pem = {}
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(common, name)
            pem[name] = None if path is None else _read(name, path)
        if common.auth_token_file is not None:
            path = common.auth_token_file
            token = _check_token(_read_token_file(path, insecure), f"auth_token_file {path!r}",
                                 insecure)
        elif environ.get(ENV_AUTH_TOKEN):
            token = _check_token(environ[ENV_AUTH_TOKEN].strip(), ENV_AUTH_TOKEN, insecure)
        else:
            token = None
        return cls(cert=pem["tls_cert_file"], key=pem["tls_key_file"], ca=pem["tls_ca_file"],
                   token=token)

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.key is not None and self.cert is not None, \
            "server_credentials without TLS files"
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


def _read_token_file(path: str, insecure: bool) -> str:
    """The token in ``path``, refused (unless ``insecure``) when :func:`token_file_problem`
    finds one; the mode is read from the file opened, not from its name."""
    try:
        with open(path, "rb") as f:
            problem = None if insecure else token_file_problem(os.fstat(f.fileno()))
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"auth_token_file: cannot read {path!r}: {exc.strerror}") from None
    if problem is not None:
        raise ConfigError(f"auth_token_file {path!r}: {problem}; a job token file must be "
                          f"readable by its owner only (chmod 600 {path}), {_OPT_OUT}")
    return text.decode(errors="replace").strip()


def token_file_problem(st: os.stat_result) -> str | None:
    """Why a token file with this status is not private (None: it is). A file of this
    user must allow nothing to group and others; one of root (as Kubernetes mounts a
    Secret: root's, readable by the pod's group) nothing to others and no group write;
    anyone else's is refused."""
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    if st.st_uid == uid:
        if mode & 0o077:
            return f"readable or writable by group or others (mode {mode:04o})"
    elif st.st_uid == 0:
        if mode & 0o027:
            return f"root's, but writable by its group or usable by others (mode {mode:04o})"
    else:
        return f"owned by uid {st.st_uid}, neither this user (uid {uid}) nor root"
    return None


def _check_token(token: str, source: str, insecure: bool = False) -> str:
    if not token or not token.isascii() or not token.isprintable() or (
        any(c.isspace() for c in token)
    ):
        raise ConfigError(f"{source}: the job token must be printable ASCII characters "
                          f"without spaces (e.g. {_HOW_TO_MAKE})")
    weakness = None if insecure else token_weakness(token)
    if weakness is not None:
        raise ConfigError(f"{source}: the job token is too easy to guess ({weakness}); make "
                          f"one with {_HOW_TO_MAKE}, {_OPT_OUT}")
    return token


def token_weakness(token: str) -> str | None:
    """Why ``token`` is easy to guess (None: no reason found). Its randomness is estimated
    twice, from the counts of its characters and of the steps between neighbours (which
    catches ``0123...``), and the lower estimate must reach :data:`MIN_TOKEN_BITS`."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"fewer than {MIN_TOKEN_CHARS} characters"
    if 2 * _smallest_period(token) <= len(token):
        return "a shorter string repeated"
    steps = [ord(b) - ord(a) for a, b in zip(token, token[1:])]
    bits = min(_bits(list(token)), _bits(steps))
    if bits < MIN_TOKEN_BITS:
        return (f"about {bits:.0f} bits of randomness in its characters, fewer than "
                f"{MIN_TOKEN_BITS}")
    return None


def _smallest_period(text: str) -> int:
    """The least ``p`` with ``text[i] == text[i + p]`` throughout (prefix function)."""
    border = [0] * len(text)
    k = 0
    for i in range(1, len(text)):
        while k and text[i] != text[k]:
            k = border[k - 1]
        if text[i] == text[k]:
            k += 1
        border[i] = k
    return len(text) - border[-1]


def _bits(symbols: list) -> float:
    """``len(symbols)`` times the entropy of their frequencies (bits)."""
    counts = collections.Counter(symbols)
    n = len(symbols)
    return -sum(c * math.log2(c / n) for c in counts.values())


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
