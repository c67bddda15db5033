"""An embedding worker's Prometheus metrics (served by :mod:`persia_py.telemetry.monitoring`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from persia_py.telemetry.monitoring import LATENCY_BUCKETS, StateCollector

if TYPE_CHECKING:
    from persia_py.workers.embedding_worker import EmbeddingWorker


class EmbeddingWorkerMetrics:
    """Lookup phase latencies, pending batches, staleness and skipped NaN gradients."""

    def __init__(self, worker: EmbeddingWorker) -> None:
        self.registry = CollectorRegistry()
        self._worker = worker
        phase = Histogram(
            "persia_embedding_worker_lookup_seconds",
            "Time of one lookup by phase: pre (routing; dedup too for direct lookups, "
            "stored batches are deduplicated on arrival), rpc (parameter-server calls), "
            "post (assembling the answer)",
            ["phase"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self._pre, self._rpc, self._post = (phase.labels(p) for p in ("pre", "rpc", "post"))
        self.update_seconds = Histogram(
            "persia_embedding_worker_update_gradients_seconds",
            "Time to route one batch's gradients to the parameter servers",
            registry=self.registry, buckets=LATENCY_BUCKETS)
        self.registry.register(StateCollector(self._state))

    def observe_lookup(self, pre_sec: float, rpc_sec: float, post_sec: float) -> None:
        """The hook :class:`EmbeddingWorker` calls after each lookup."""
        self._pre.observe(pre_sec)
        self._rpc.observe(rpc_sec)
        self._post.observe(post_sec)

    def _state(self) -> Iterator:
        w = self._worker
        yield GaugeMetricFamily("persia_embedding_worker_pending_batches",
                                "Batches held: waiting for lookup or for their gradients",
                                value=w.num_pending)
        yield GaugeMetricFamily("persia_embedding_worker_staleness",
                                "Batches looked up whose gradients have not come back",
                                value=w.num_looked_up)
        yield GaugeMetricFamily("persia_embedding_worker_buffer_bytes",
                                "Bytes of ID features held", value=w.budget.used)
        skipped = CounterMetricFamily("persia_embedding_worker_nan_grad_skipped",
                                      "Batches whose gradients for a slot were not finite "
                                      "and were skipped, per slot", labels=["slot"])
        for slot in w.embedding_config.slots_config:
            skipped.add_metric([slot], w.num_nonfinite_skipped.get(slot, 0))
        yield skipped
