"""Prometheus metrics of every role, each process with a registry of its own.

A role builds its metrics object (:class:`ParameterServerMetrics`,
:class:`EmbeddingWorkerMetrics`, :class:`NNWorkerMetrics`, :class:`DataLoaderMetrics`)
whether or not it serves them: observing a histogram costs about a microsecond.
:func:`serve_metrics` exposes the registry over HTTP at ``/metrics``. Gauges that mirror
state (table entries, pending batches) are read when scraped, by custom collectors, so
no hot path updates them.

Metric names follow PERSIA's where it had one, prefixed ``persia_``. (Evaluation metrics
such as AUC live in :mod:`persia_py.metrics`.)
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

ENV_METRICS_PORT = "PERSIA_METRICS_PORT"
"""Port of the metrics endpoint of a role that reads its settings from the environment
(NN-worker ranks add their local rank; 0: any free port; unset or empty: not served)."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)


MAX_METRICS_CONNECTIONS = 8
"""Connections a metrics endpoint serves at once (a thread each); one more is answered
503 at once and closed, without a thread (a scraper comes back at its next interval)."""
METRICS_READ_TIMEOUT_SEC = 10.0
"""How long a metrics connection may take to send its request (it holds a thread)."""
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
         b"Connection: close\r\n\r\n")


class _Handler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_SEC

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """One line per scrape would drown the role's own output."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection (as prometheus_client's server), at most
    :data:`MAX_METRICS_CONNECTIONS` of them at once."""

    daemon_threads = True
    max_connections = MAX_METRICS_CONNECTIONS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_active = 0
        self._idle = threading.Condition()

    def process_request(self, request, client_address) -> None:
        with self._idle:
            full = self.num_active >= self.max_connections
            if not full:
                self.num_active += 1
        if full:
            try:  # a fresh socket's buffer takes these bytes; never wait on this client
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a client gone, or too slow: its loss
            return
        super().handle_error(request, client_address)

    def _release(self) -> None:
        with self._idle:
            self.num_active -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no connection is being served; False after ``timeout`` s."""
        with self._idle:
            return self._idle.wait_for(lambda: self.num_active == 0, timeout=timeout)


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close`` stops it."""

    def __init__(self, httpd: _BoundedServer, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.port: int = httpd.server_port

    @property
    def num_connections(self) -> int:
        """Connections being served now (each on a thread of its own)."""
        return self._httpd.num_active

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no connection is being served; False after ``timeout`` s."""
        return self._httpd.wait_idle(timeout)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
        self._httpd.wait_idle(timeout=2.0)  # a scrape under way finishes; none waits longer


def serve_metrics(registry: CollectorRegistry, port: int, host: str, what: str) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: any free port) and print where, for people
    and for ``persia-launcher local``: ``<what> metrics on http://host:port/metrics``.
    At most :data:`MAX_METRICS_CONNECTIONS` connections are served at once."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    server_class: type[_BoundedServer] = type("_BoundedServer", (_BoundedServer,),
                                              {"address_family": family})
    httpd = make_server(host, port, make_wsgi_app(registry), server_class,
                        handler_class=_Handler)
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics {what}", daemon=True)
    thread.start()
    server = MetricsServer(httpd, thread)
    print(f"{what} metrics on http://{host}:{server.port}/metrics", flush=True)
    return server


def metrics_port_from_env(environ: Mapping[str, str], offset: int = 0) -> int | None:
    """The port named by ``PERSIA_METRICS_PORT`` plus ``offset`` (unless it is 0), or None."""
    value = environ.get(ENV_METRICS_PORT, "")
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"environment variable {ENV_METRICS_PORT}={value!r} is not an "
                         "integer") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"environment variable {ENV_METRICS_PORT}={port} is not a port")
    return port + offset if port else 0


class StateCollector(Collector):
    """Gauges and counters computed from a callable when scraped."""

    def __init__(self, collect: Callable[[], Iterable]) -> None:
        self._collect = collect

    def collect(self):
        return self._collect()

    def describe(self):
        return []  # no description up front: collect() is only called on a scrape




class NNWorkerMetrics:
    """Forward, backward and wait times, samples/s, loss and staleness of one NN-worker rank."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.forward_seconds = Histogram("persia_nn_worker_forward_seconds",
                                         "Time of ctx.forward", registry=r,
                                         buckets=LATENCY_BUCKETS)
        self.backward_seconds = Histogram("persia_nn_worker_backward_seconds",
                                          "Time of ctx.backward (backward, dense optimizer "
                                          "step, gradients handed to the sender)",
                                          registry=r, buckets=LATENCY_BUCKETS)
        self.wait_seconds = Histogram("persia_nn_worker_wait_seconds",
                                      "Time between the end of a step and the next forward "
                                      "(mostly waiting for the next looked-up batch)",
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.steps = Counter("persia_nn_worker_steps", "Training steps", registry=r)
        self.samples = Counter("persia_nn_worker_samples", "Samples trained", registry=r)
        self.samples_per_second = Gauge("persia_nn_worker_samples_per_second",
                                        "Training throughput over the last seconds",
                                        registry=r)
        self.loss = Gauge("persia_nn_worker_loss", "Loss of the last step", registry=r)
        self.staleness = Gauge("persia_nn_worker_staleness",
                               "Embedding staleness of the last step's batch", registry=r)
        self.restarts = Counter("persia_restarts", "Times torchrun restarted the NN ranks "
                                "(this rank's TORCHELASTIC_RESTART_COUNT)", ["role"], registry=r)


class DataLoaderMetrics:
    """Batches and samples a data loader sent, and how long it waited for room."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.batches = Counter("persia_data_loader_batches", "Batches sent",
                               registry=self.registry)
        self.samples = Counter("persia_data_loader_samples", "Samples sent",
                               registry=self.registry)
        self.send_seconds = Histogram("persia_data_loader_send_seconds",
                                      "Time of one send_data (waits included)",
                                      registry=self.registry, buckets=LATENCY_BUCKETS)


_FRESHNESS = {
    "increment": ("persia_serving_increment_age_seconds",
                  "Seconds since the newest incremental export this serving replica applied "
                  "was written (NaN: none applied yet)",
                  "persia_serving_increments_applied", "Incremental exports applied"),
    "dense_model": ("persia_serving_dense_model_age_seconds",
                    "Seconds since the dense model this serving process answers with was "
                    "written (a dense export, or the checkpoint it started from)",
                    "persia_serving_dense_models_loaded",
                    "Dense model versions swapped in after the first"),
}


def register_freshness(registry: CollectorRegistry, kind: str,
                       age_sec: Callable[[], float | None],
                       num_applied: Callable[[], int]) -> None:
    """Expose how fresh a serving replica's copy of ``kind`` (``increment`` or
    ``dense_model``) is: its age in seconds and how many versions it applied, both read
    from the follower when scraped."""
    age_name, age_help, count_name, count_help = _FRESHNESS[kind]

    def collect() -> Iterator:
        age = age_sec()
        yield GaugeMetricFamily(age_name, age_help,
                                value=float("nan") if age is None else age)
        yield CounterMetricFamily(count_name, count_help, value=num_applied())

    registry.register(StateCollector(collect))


class LauncherMetrics:
    """What ``persia-launcher local`` did to keep a job up: processes it restarted."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter("persia_restarts", "Processes that died and were restarted "
                                "(role: the launcher's name of the one that died)",
                                ["role"], registry=self.registry)
