"""A parameter server's Prometheus metrics (served by :mod:`persia_py.telemetry.monitoring`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from persia_py.telemetry.monitoring import LATENCY_BUCKETS, StateCollector

if TYPE_CHECKING:
    from persia_py.servers.parameter_server import ParameterServer


class ParameterServerMetrics:
    """Entries, bytes, lookup/update latency, index miss ratio and evictions of one PS."""

    def __init__(self, ps: ParameterServer) -> None:
        self.registry = CollectorRegistry()
        self._ps = ps
        self.lookup_seconds = Histogram(
            "persia_ps_lookup_seconds", "Time to serve one lookup request (all its slots)",
            registry=self.registry, buckets=LATENCY_BUCKETS)
        self.update_seconds = Histogram(
            "persia_ps_update_seconds", "Time to apply one gradient update request",
            registry=self.registry, buckets=LATENCY_BUCKETS)
        self.lookup_ids = Counter("persia_ps_lookup_ids", "Ids looked up",
                                  registry=self.registry)
        self.update_ids = Counter("persia_ps_update_ids", "Ids whose rows were updated",
                                  registry=self.registry)
        self.increment_failures = Counter(
            "persia_ps_increment_failures",
            "Failed attempts to write (kind=export) or apply (kind=apply) an incremental "
            "export; each is retried", ["kind"], registry=self.registry)
        self.registry.register(StateCollector(self._tables))

    def _tables(self) -> Iterator:
        stats = self._ps.stats()
        label = ["table"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "entries": GaugeMetricFamily("persia_ps_entries", "Rows held, per table", labels=label),
            "bytes": GaugeMetricFamily("persia_ps_bytes",
                                       "Bytes of the row arrays (embeddings and optimizer "
                                       "state), per table", labels=label),
            "miss": GaugeMetricFamily("persia_ps_index_miss_ratio",
                                      "Share of looked-up ids not yet in the table, per table",
                                      labels=label),
            "evicted": CounterMetricFamily("persia_ps_evictions",
                                           "Rows evicted (least recently used), per table",
                                           labels=label),
            "inserted": CounterMetricFamily("persia_ps_insertions", "Rows inserted, per table",
                                            labels=label),
        }
        for table, s in stats.items():
            families["entries"].add_metric([table], s["entries"])
            families["bytes"].add_metric([table], s["bytes"])
            looked_up = s["hits"] + s["misses"]
            families["miss"].add_metric([table], s["misses"] / looked_up if looked_up else 0.0)
            families["evicted"].add_metric([table], s["evicted"])
            families["inserted"].add_metric([table], s["inserted"])
        yield from families.values()
        yield from self._disk_tiers(stats)
        yield GaugeMetricFamily("persia_ps_entries_total", "Rows held, all slots",
                                value=sum(s["entries"] for s in stats.values()))
        yield GaugeMetricFamily("persia_ps_bytes_total", "Bytes of the row arrays, all slots",
                                value=sum(s["bytes"] for s in stats.values()))
        yield CounterMetricFamily("persia_ps_update_requests", "Update requests applied",
                                  value=self._ps.num_updates)

    def _disk_tiers(self, table_stats: dict[str, dict[str, int]]) -> Iterator:
        """The disk tier's rows, counters and ratios, per table with a tier (none
        without). Disk reads per second: ``rate(persia_ps_disk_reads_total[1m])``."""
        label = ["table"]
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            ("disk_rows", GaugeMetricFamily("persia_ps_disk_rows", "Rows on disk, per table",
                                            labels=label)),
            ("disk_bytes", GaugeMetricFamily("persia_ps_disk_bytes",
                                             "Bytes of the disk tier's files, per table",
                                             labels=label)),
            ("disk_hits", CounterMetricFamily(
                "persia_ps_disk_hits", "Ids absent from RAM found on disk (brought back), "
                "per table", labels=label)),
            ("disk_misses", CounterMetricFamily(
                "persia_ps_disk_misses", "Ids absent from RAM asked of the disk tier and not "
                "there, per table", labels=label)),
            ("disk_block_reads", CounterMetricFamily(
                "persia_ps_disk_reads", "Random block reads from the disk tier, per table",
                labels=label)),
            ("disk_bytes_read", CounterMetricFamily(
                "persia_ps_disk_read_bytes", "Bytes read from the disk tier (random reads, "
                "compaction and checkpoint scans), per table", labels=label)),
            ("disk_evicted", CounterMetricFamily(
                "persia_ps_disk_evictions", "Rows deleted from a full disk tier (also in "
                "persia_ps_evictions), per table", labels=label)),
            ("disk_expired", CounterMetricFamily(
                "persia_ps_disk_expirations", "Rows deleted from a disk tier by a TTL (the "
                "disk's own, or the slot's; also in the Stats RPC's expired), per table",
                labels=label)),
            ("disk_read_random", CounterMetricFamily(
                "persia_ps_disk_rows_read", "Rows read from the disk tier by random reads, "
                "per table", labels=label)),
            ("spilled", CounterMetricFamily("persia_ps_disk_spilled",
                                            "Rows moved from RAM to disk, per table",
                                            labels=label)),
        ]
        ratios = {
            "ram_hit": GaugeMetricFamily(
                "persia_ps_ram_hit_ratio", "Share of looked-up ids (repeats included) "
                "answered from RAM, neither from disk nor absent, since start, per table",
                labels=label),
            "amplification": GaugeMetricFamily(
                "persia_ps_disk_read_amplification", "Bytes of the blocks read at random "
                "per byte of the rows they were read for, since start, per table",
                labels=label)}
        for table, s in self._ps.disk_stats().items():
            for key, family in families:
                family.add_metric([table], s[key])
            t = table_stats[table]
            asked = t["hits"] + t["misses"]
            ratios["ram_hit"].add_metric(
                [table], (t["hits"] - s["disk_answered"]) / asked if asked else 0.0)
            rows = s["disk_read_random"] * s["disk_record_bytes"]
            ratios["amplification"].add_metric(
                [table], s["disk_block_reads"] * s["disk_block_bytes"] / rows if rows else 0.0)
        for _, family in families:
            yield family
        yield from ratios.values()
        prefetcher = self._ps.prefetcher
        if prefetcher is not None:  # a disk tier: hints of the batches to come
            yield CounterMetricFamily("persia_ps_disk_prefetched", "Rows brought back from "
                                      "disk by prefetch hints, all tables",
                                      value=prefetcher.num_rows)
            yield CounterMetricFamily("persia_ps_disk_prefetch_dropped", "Prefetch hints not "
                                      "queued (too many waiting)", value=prefetcher.num_dropped)
