"""gRPC plumbing shared by every role: servers, channels, deadlines, retries, errors.

Servicers stay thin: they decode the request, call a plain domain object and encode
the answer. Domain errors map to status codes here, in one place:
``ValueError`` -> INVALID_ARGUMENT, :class:`NotFound` -> NOT_FOUND,
:class:`FailedPrecondition` -> FAILED_PRECONDITION, :class:`Overloaded` ->
RESOURCE_EXHAUSTED; anything else -> INTERNAL (and is logged with its traceback).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from persia_py.config import CommonConfig
from persia_py.wire import codec
from persia_py.wire import raw_methods as wire_rpc
from persia_py.wire.address_book import BookEntry, BookError
from persia_py.wire.security import TransportSecurity

logger = logging.getLogger(__name__)

_MAX_QUEUED_PER_WORKER = 8
"""Calls a server accepts at once, per worker thread (running plus queued)."""

RETRYABLE = frozenset([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.CANCELLED])
"""Codes an idempotent call is retried on. CANCELLED: a server that stops (its process
dying, or restarting) cancels the calls it holds, such as an NN worker's long poll for
its next batch; the role is restarted and answers again, so to the caller it is an
outage like UNAVAILABLE, not a reason to fail."""
_GONE = frozenset([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
_BOOK_POLL_SEC = 5.0
"""How often a client that may move and waits for its server to start looks in its book."""


class NotFound(LookupError):
    """The request names something the server does not have."""


class FailedPrecondition(RuntimeError):
    """The server is not in a state to answer (e.g. not configured yet)."""


class Overloaded(RuntimeError):
    """The server is full right now; the caller should wait and retry."""


def _options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _client_keepalive(common: CommonConfig) -> list[tuple[str, int]]:
    # common_config.keepalive_sec says why: dead links found in seconds, not deadlines.
    ms = int(common.keepalive_sec * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.max_pings_without_data", 0)]  # long polls carry no data for a while


def _server_keepalive(common: CommonConfig) -> list[tuple[str, int]]:
    # Accept the clients' pings (gRPC's default allows one per 5 min, then GOAWAY).
    return [("grpc.http2.min_recv_ping_interval_without_data_ms",
             int(common.keepalive_sec * 1000) // 2),
            ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)]


def _carries_arrays(descriptor: Any) -> bool:
    """Whether a message of this type can carry arrays (a Tensor or ``bytes`` field)."""
    return any(f.type == f.TYPE_BYTES or (f.message_type is not None
                                          and _carries_arrays(f.message_type))
               for f in descriptor.fields)


def _request_limit(method: str, common: CommonConfig) -> tuple[int, str]:
    """Largest request ``method`` (``/package.Service/Method``) accepts, and its config key.

    Requests that cannot carry arrays (Configure, Stats, Health, checkpoint calls, a
    lookup by ref) get the small ``max_control_message_bytes``; the others, and methods
    unknown to protobuf's pool, ``max_message_bytes``.
    """
    try:
        found = descriptor_pool.Default().FindMethodByName(method.strip("/").replace("/", "."))
    except KeyError:
        found = None
    if found is not None and not _carries_arrays(found.input_type):
        return (min(common.max_control_message_bytes, common.max_message_bytes),
                "common_config.max_control_message_bytes")
    return common.max_message_bytes, "common_config.max_message_bytes"


class _ParseRequests(grpc.ServerInterceptor):
    """Parse requests inside the handler, so undecodable bytes get INVALID_ARGUMENT, after
    checking their size against the method's limit (:func:`_request_limit`) and, before
    any array is decoded, the size their lz4 payloads claim to decompress to.

    gRPC itself answers a request its deserializer rejects with INTERNAL, which reads
    as a server bug; a malformed message is the caller's error.
    """

    def __init__(self, common: CommonConfig) -> None:
        self._common = common
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        with self._lock:
            wrapped = self._handlers.get(method)
        if wrapped is not None:
            return wrapped
        handler = continuation(handler_call_details)
        if (handler is None or handler.request_streaming or handler.response_streaming
                or handler.request_deserializer is None):
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        limit, key = _request_limit(method, self._common)
        decoded_limit = self._common.max_message_bytes

        def parse_then_call(raw: bytes, context: grpc.ServicerContext) -> Any:
            if len(raw) > limit:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: request larger than max ({len(raw)} vs. {limit}, {key})")
            try:
                request = parse(raw)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: request is not a valid message ({exc})")
            try:
                codec.check_decoded_size(request, len(raw), decoded_limit,
                                         what="common_config.max_message_bytes")
            except codec.CodecError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc}")
            return behavior(request, context)

        wrapped = grpc.unary_unary_rpc_method_handler(
            parse_then_call, response_serializer=handler.response_serializer)
        with self._lock:
            self._handlers[method] = wrapped
        return wrapped


def create_server(
    address: str, common: CommonConfig, *, max_workers: int = 16
) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``address`` (``host:0`` picks a free port); returns (server, port).

    With TLS configured it listens with TLS only (mutual: clients need a certificate
    signed by the CA); with a job token every call must carry it. At most
    ``_MAX_QUEUED_PER_WORKER * max_workers`` calls are accepted at once; beyond that
    callers get RESOURCE_EXHAUSTED (and retry) instead of queueing without bound.
    Services must be added before ``server.start()``.
    """
    security = TransportSecurity.from_common(common)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        # The token is checked first: an unauthenticated body is never read (security.py).
        interceptors=[*security.server_interceptors(), _ParseRequests(common)],
        options=[*_options(common.max_message_bytes), *_server_keepalive(common)],
        maximum_concurrent_rpcs=_MAX_QUEUED_PER_WORKER * max_workers,
    )
    if security.tls:
        port = server.add_secure_port(address, security.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, port


def create_channel(address: str, common: CommonConfig) -> grpc.Channel:
    """A channel to ``address`` with the configured message-size limit, TLS and token."""
    security = TransportSecurity.from_common(common)
    # A restarted server is found within a second (gRPC's default backoff grows to 2 min).
    options = [*_options(common.max_message_bytes), *_client_keepalive(common),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if security.tls:
        channel = grpc.secure_channel(address, security.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    interceptors = security.client_interceptors()
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def wait_for_ready(channel: grpc.Channel, address: str, timeout: float) -> None:
    """Block until ``channel`` connects; TimeoutError naming ``address`` after ``timeout`` s."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout)
    except grpc.FutureTimeoutError:
        # Unsubscribe it: gRPC's polling thread serves a channel as long as any future
        # waits on it, and one that was still at it when the caller closed the channel
        # printed "Cannot invoke RPC: Channel closed!" from that thread.
        ready.cancel()
        raise TimeoutError(f"service at {address} not reachable within {timeout:.0f}s") from None


class OutageLog:
    """Logs a service's outage once: a WARNING when calls to it first fail UNAVAILABLE,
    an INFO when one succeeds again. A client shares one among its calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down_since: dict[str, float] = {}

    def failed(self, what: str, details: str | None, timeout: float) -> None:
        with self._lock:
            if what in self._down_since:
                return
            self._down_since[what] = time.monotonic()
        logger.warning("%s unavailable (%s); waiting and retrying until the call's deadline "
                       "(%.0f s, common_config.rpc_timeout_sec)", what, details, timeout)

    def moved(self, what: str, to: str) -> None:
        """The service is reached at another address now (``to``): its outage under the
        old name ends there."""
        with self._lock:
            since = self._down_since.pop(what, None)
        logger.warning("%s moved to %s%s; calls go on there", what, to,
                       "" if since is None else f" after {time.monotonic() - since:.1f} s")

    def recovered(self, what: str) -> None:
        if what not in self._down_since:  # the common case, without the lock
            return
        with self._lock:
            since = self._down_since.pop(what, None)
        if since is not None:
            logger.info("%s reachable again after %.1f s; calls go on", what,
                        time.monotonic() - since)


def _over_size_limit(exc: grpc.RpcError) -> bool:
    """Whether gRPC refused a message over ``max_message_bytes`` (client or server side):
    RESOURCE_EXHAUSTED, like an overloaded server, but not worth retrying."""
    return (exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "larger than max" in (exc.details() or ""))


def _closed_here(exc: grpc.RpcError) -> bool:
    """Whether a CANCELLED call was cancelled by this side closing its channel."""
    return "channel closed" in (exc.details() or "").lower()


def call(
    method: Callable[..., Any],
    request: Any,
    *,
    timeout: float,
    idempotent: bool,
    what: str,
    outages: OutageLog | None = None,
    redial: Callable[[], tuple[Callable[..., Any], str] | None] | None = None,
) -> Any:
    """Call ``method`` with a deadline; retry idempotent calls on :data:`RETRYABLE` codes.

    Retries back off exponentially (10 ms .. 1 s) until ``timeout`` seconds have
    passed in all; then the last error is raised. Non-idempotent calls are retried
    only on RESOURCE_EXHAUSTED, which servers answer before changing anything. A message
    over the size limit (also RESOURCE_EXHAUSTED) is never retried.
    Attempts fail fast while the server is unreachable (no ``wait_for_ready``: clients
    wait for their servers once, at start-up), so an outage is logged (``outages``, once
    per outage of the service) and the call keeps retrying until the server is back.

    ``redial`` (idempotent calls): asked, each time an attempt finds the server gone
    (UNAVAILABLE, CANCELLED, no answer by the deadline), whether the server moved
    (:mod:`persia_py.wire.address_book`); it answers None, or the method at the new
    address and its new ``what``: the call goes on there, with a whole ``timeout`` again.
    Calls that never fail never ask.
    """
    outages = outages if outages is not None else OutageLog()
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        remaining = deadline - time.monotonic()
        try:
            answer = method(request, timeout=max(remaining, 0.001), wait_for_ready=False)
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in (*_GONE, grpc.StatusCode.DEADLINE_EXCEEDED):
                outages.recovered(what)  # the server answered
            retryable = code in RETRYABLE if idempotent else code == grpc.StatusCode.RESOURCE_EXHAUSTED
            if code == grpc.StatusCode.CANCELLED and _closed_here(exc):
                raise  # this client closed its channel: nobody is left to wait
            moved = (redial() if redial is not None and idempotent
                     and code in (*_GONE, grpc.StatusCode.DEADLINE_EXCEEDED) else None)
            if moved is not None:
                outages.moved(what, moved[1])
                method, what = moved
                deadline, delay = time.monotonic() + timeout, 0.01
                continue
            if _over_size_limit(exc):  # the same message would be refused again
                logger.error("%s: %s; raise common_config.max_message_bytes on both sides "
                             "or send smaller batches", what, exc.details())
                raise
            if not retryable or time.monotonic() + delay >= deadline:
                # Name the peer here, or the caller's error names no one. A peer cut off
                # silently (no reset, no carrier lost) never answers UNAVAILABLE; one whose
                # host stopped answering ARP fails UNAVAILABLE only after the connect ran
                # out the whole deadline, with no earlier attempt to log its outage.
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    logger.warning("%s did not answer within %.0f s "
                                   "(common_config.rpc_timeout_sec)", what, timeout)
                elif code in _GONE:
                    logger.warning("%s unavailable (%s); %s", what, exc.details(),
                                   f"gave up at the call's deadline ({timeout:.0f} s, "
                                   "common_config.rpc_timeout_sec)" if retryable
                                   else "not retried: the call is not idempotent")
                raise
            if code in _GONE:
                outages.failed(what, exc.details(), timeout)
            logger.debug("%s: %s (%s), retrying in %.2fs", what, code.name, exc.details(), delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        else:
            outages.recovered(what)
            return answer


class ServiceClient:
    """Base of a client of one service at ``address``: its channel, deadlines and retries
    (:func:`call`), and its outages logged once (:class:`OutageLog`)."""

    service_name = "service"
    """How logs and errors name the service, before its address."""
    stub_class: Callable[[grpc.Channel], Any]
    """The service's generated stub class; the client's ``stub``."""
    wire_methods: dict[str, tuple[Any, str, type, bool]] = {}
    """Attribute -> ``(service descriptor, method, response class, parse the response)``:
    methods whose big messages skip protobuf's copies (:func:`persia_py.wire.raw_methods.unary`)."""

    def __init__(self, address: str, common: CommonConfig, *,
                 book: BookEntry | None = None) -> None:
        self.common = common
        self._outages = OutageLog()
        self._book = book
        """Where the service's address is kept, when it may move (None: it never does)."""
        self._redial_lock = threading.RLock()
        self._book_error = ""
        """The book's error at the last redial, logged once ("": it was read)."""
        self._retired: list[grpc.Channel] = []
        self._dial(address)

    def _dial(self, address: str) -> None:
        """A channel to ``address``, with the stub and wire methods on it."""
        self.address = address
        self.channel = create_channel(address, self.common)
        self.stub = self.stub_class(self.channel)
        for attribute, (service, method, response, parse) in self.wire_methods.items():
            setattr(self, attribute, wire_rpc.unary(self.channel, service, method,
                                                    response_class=response,
                                                    parse_response=parse))

    def wait_ready(self) -> None:
        """Block until the service is reachable (``common_config.startup_timeout_sec``);
        a client that may move looks in its book every few seconds meanwhile."""
        if self._book is None:
            wait_for_ready(self.channel, self.address, self.common.startup_timeout_sec)
            return
        deadline = time.monotonic() + self.common.startup_timeout_sec
        while True:
            try:
                wait_for_ready(self.channel, self.address,
                               min(_BOOK_POLL_SEC, max(deadline - time.monotonic(), 0.001)))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"service at {self.address} not reachable within "
                        f"{self.common.startup_timeout_sec:.0f}s") from None
                self._follow_book()

    def _call(self, method: Callable[..., Any] | str, request: Any, *, idempotent: bool,
              timeout: float | None = None) -> Any:
        """``method``: a callable, or the name of one on this client's stub or on itself
        (``"stub.Stats"``, ``"_lookup"``), which a client that may move (``book``) finds
        again on its new channel; a callable is called as it is (one that looks up this
        client's methods itself, as it runs, follows too)."""
        redial = (None if self._book is None
                  else functools.partial(self._redial, method, [self.address]))
        return call(self._method(method), request,
                    timeout=timeout or self.common.rpc_timeout_sec, idempotent=idempotent,
                    what=f"{self.service_name} {self.address}", outages=self._outages,
                    redial=redial)

    def _method(self, method: Callable[..., Any] | str) -> Callable[..., Any]:
        if not isinstance(method, str):
            return method
        if method.startswith("stub."):
            return getattr(self.stub, method[5:])
        return getattr(self, method)

    def _redial(self, method: Callable[..., Any] | str,
                used: list[str]) -> tuple[Callable[..., Any], str] | None:
        """After a failed attempt at ``used[0]`` (the address the call is at, updated
        here): if the book says the service is elsewhere, dial it there (once, whichever
        thread sees it first); the method there and its name in logs, or None (it has
        not moved since the call went there, or the book cannot be read now: logged)."""
        with self._redial_lock:
            try:
                self._follow_book()
            except BookError as exc:
                # Unreadable now (a shared file system's hiccup, an edit by hand): the
                # call goes on retrying where it is and looks again at its next failure,
                # where raising would fail a call its server may still answer.
                if str(exc) != self._book_error:
                    logger.warning("%s %s: %s; retrying at this address", self.service_name,
                                   self.address, exc)
                self._book_error = str(exc)
                return None
            self._book_error = ""
            if self.address == used[0]:
                return None
            used[0] = self.address
            return self._method(method), f"{self.service_name} {self.address}"

    def _follow_book(self) -> None:
        """Dial the address the book has now, if it is not this client's."""
        assert self._book is not None
        with self._redial_lock:
            version, address = self._book.current()
            if address == self.address:
                return
            logger.warning("%s %s: the address book (version %d) has it at %s; redialling",
                           self.service_name, self.address, version, address)
            # Calls of other threads may still run on the old channel: it is closed with
            # the client, not now (closing it would fail them at once).
            self._retired.append(self.channel)
            self._dial(address)

    def close(self) -> None:
        for channel in [*self._retired, self.channel]:
            channel.close()


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a domain exception crosses the wire as."""
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def grpc_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method: domain exceptions become status codes with their message."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except grpc.RpcError as exc:
            # A call this method made to another service failed: pass its status on.
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.INTERNAL
            details = exc.details() if hasattr(exc, "details") else str(exc)
            context.abort(code, f"{fn.__name__}: downstream call failed: {details}")
        except Exception as exc:  # noqa: BLE001 - every error must reach the caller
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", fn.__name__)
            context.abort(code, f"{fn.__name__}: {exc}")

    return wrapper
