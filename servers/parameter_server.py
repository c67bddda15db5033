"""One embedding-parameter-server replica, as a plain object testable without gRPC.

It owns one :class:`EmbeddingTable` per feature group of the embedding config, named
after the group (a slot outside ``feature_groups`` is a group of its own, so its table
bears the slot's name); requests name tables. Tables are created
when the embedding optimizer arrives (``configure``), because a row's optimizer state is
laid out by the optimizer. Updates carry ``(worker_id, sequence)``; a pair seen before is
acknowledged without being applied again, so a retried update is applied once. An update
that carries no ids is refused (it would mark a pair as applied and nothing else). The
window is bounded per worker id and never forgets a live one for a new one
(``servers/update_window.py``; embedding workers take a random id per process start, so a
restarted one never reuses a window). A lookup or an update over many tables runs one
kernel call across the tables it can (:mod:`.request_tables`), not one per table.

A call's memory is bounded before anything is allocated for it (:mod:`.call_memory`): its
arrays plus what serving it takes within 1.5 x ``max_message_bytes``, its answer within
``max_message_bytes``.

The replica's state (optimizer settings, every table's rows, the exactly-once window)
goes in and out through :meth:`ParameterServer.state_dict` and
:meth:`ParameterServer.load_state_dict`, as plain arrays (:class:`ReplicaState`):
checkpoints and incremental exports use only these, never the tables themselves.

A replica in *inference* mode (serving) is read-only: it answers lookups with
``training=False`` only (unknown ids read as zeros and are never inserted) and refuses
training lookups and updates with FailedPrecondition; its rows change only by loading a
checkpoint or applying an incremental export. Its tables never expire rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from persia_py.config import DiskTierConfig, EmbeddingTablesConfig, GlobalConfig
from persia_py.ids.routing import RESERVED_ID, replica_of
from persia_py.servers import call_memory
from persia_py.servers.call_memory import LookupAnswer
from persia_py.servers.optimizers import optimizer_from_dict
from persia_py.servers.prefetch import Prefetcher, serve_hint
from persia_py.servers.replica_state import ReplicaState, Rows
from persia_py.servers.request_tables import lookup_tables, update_tables
from persia_py.servers.row_stream import RowChunks
from persia_py.servers.sizing import (
    capacity_warning,
    derived_capacity_note,
    memory_limit,
    table_sizes,
)
from persia_py.servers.storage import EmbeddingTable
from persia_py.servers.swap_lock import SwapLock
from persia_py.servers.table_settings import TableSettings, checked_settings, old_default_hint
from persia_py.servers.update_window import UpdateWindow, check_worker_id, checked_window
from persia_py.wire.rpc import FailedPrecondition

if TYPE_CHECKING:
    from persia_py.servers.update_log import UpdateLog

logger = logging.getLogger(__name__)

_ROW_KEYS = ("ids", "weights", "state", "last_access", "clock")
class ParameterServer:
    """Replica ``replica_index`` of ``replica_size``: lookups and updates of its ids."""

    def __init__(
        self,
        global_config: GlobalConfig,
        embedding_config: EmbeddingTablesConfig,
        *,
        replica_index: int = 0,
        replica_size: int = 1,
        inference: bool = False,
    ) -> None:
        if not 0 <= replica_index < replica_size:
            raise ValueError(f"replica_index {replica_index} not in [0, {replica_size})")
        self.global_config = global_config
        self.embedding_config = embedding_config
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.inference = inference
        """Read-only serving replica: no training lookups, no updates, no expiry."""
        self._lock = threading.Lock()
        self._settings: TableSettings | None = None
        self._tables: dict[str, EmbeddingTable] = {}
        self._window = UpdateWindow()
        self._count_lock = threading.Lock()
        self._increments = SwapLock()
        """Lookups share it, :meth:`apply_increment` holds it alone."""
        self.prefetcher = (Prefetcher() if global_config.embedding_parameter_server_config
                           .disk_tier.enabled else None)
        self.num_updates = 0
        self.tracks_changes = False
        """Tables remember changed rows (for incremental exports; see ``track_changes``)."""
        self.increment_seq = 0
        """Sequence number of the last incremental export (recorded in checkpoints)."""
        self.update_log: UpdateLog | None = None
        """A ``persia_py.servers.update_log.UpdateLog`` where applied updates and settings
        are logged for a restart (None: not logged; see ``servers/replica_start.py``)."""
        self.memory = memory_limit()
        """The memory this process can have, read once: it bounds the tables whose
        capacity is unset and is what :meth:`warn_if_too_big` compares the others with."""
        self._capacity_note: str | None = None
        self.warn_if_too_big(None)

    # -- configuration -------------------------------------------------------------

    def configure(
        self,
        *,
        optimizer: dict,
        init_lower: float = -0.01,
        init_upper: float = 0.01,
        weight_bound: float | None = None,
        seed: int = 0,
    ) -> None:
        """Create the tables with this optimizer; a repeat with equal settings is a no-op."""
        settings = checked_settings(optimizer=optimizer, init_lower=init_lower,
                                    init_upper=init_upper, weight_bound=weight_bound, seed=seed)
        with self._lock:
            if self._settings is not None:
                self._check_same_settings(settings)
                return
            self._tables = self._build_tables(settings)
            self._settings = settings
            if self.update_log is not None:
                self.update_log.configure(dataclasses.asdict(settings))

    def _check_same_settings(self, settings: TableSettings, source: str = "the request") -> None:
        if self._settings is not None and settings != self._settings:
            raise FailedPrecondition(
                "already configured with different settings: "
                f"{json.dumps(self._settings.__dict__)}; {source} has "
                f"{json.dumps(settings.__dict__)}" + old_default_hint(self._settings, settings))

    def _build_tables(self, settings: TableSettings) -> dict[str, EmbeddingTable]:
        """New, empty tables of the embedding config with ``settings``."""
        opt = optimizer_from_dict(settings.optimizer)
        ps_cfg = self.global_config.embedding_parameter_server_config
        sizes = table_sizes(self.embedding_config, self.global_config, settings.optimizer,
                            self.memory)
        capacity = {t.name: t.capacity for t in sizes}
        note = derived_capacity_note(sizes, self.memory)
        if note is not None and note != self._capacity_note:  # once, unless it changes
            logger.info("parameter server %d: %s", self.replica_index, note)
            self._capacity_note = note
        tables = {}
        for name, slots in self.embedding_config.tables.items():
            # A group's slots agree on dim and capacity (checked by the config).
            slot = self.embedding_config.slots_config[slots[0]]
            tables[name] = EmbeddingTable(
                dim=slot.dim,
                optimizer=opt if slot.optimizer is None else optimizer_from_dict(slot.optimizer),
                init_lower=settings.init_lower,
                init_upper=settings.init_upper,
                seed=settings.seed,
                num_shards=ps_cfg.num_hashmap_internal_shards,
                capacity=capacity[name],
                weight_bound=settings.weight_bound,
                admit_probability=slot.admit_probability,
                min_occurrences=slot.min_occurrences,
                # A serving replica keeps every row it was given.
                expire_after_steps=None if self.inference else slot.expire_after_steps,
                expire_after_seconds=None if self.inference else slot.expire_after_seconds,
                row_dtype=self.embedding_config.row_dtype_of(name),
                stochastic_rounding=self.embedding_config.stochastic_rounding,
                disk_tier=self._disk_tier(),
            )
            if self.tracks_changes:
                tables[name].track_changes()
        self.warn_if_too_big(settings.optimizer)
        return tables

    def _disk_tier(self) -> DiskTierConfig | None:
        """The disk tier of every table on this replica (None: off). Its files are
        unnamed, so replicas and tables may share the configured folder."""
        config = self.global_config.embedding_parameter_server_config.disk_tier
        return config if config.enabled else None

    def warn_if_too_big(self, optimizer: dict | None) -> str | None:
        """Log (and return) a warning when the tables whose capacity is configured, full,
        outgrow the memory this process can have (see persia_py.servers.sizing): at
        start, counting weights and index only, and when configure brings the
        optimizer, counting its state."""
        what = ("weights, optimizer state and index" if optimizer is not None else
                "weights and index only: the optimizer's state is added when training "
                "configures the tables")
        sizes = table_sizes(self.embedding_config, self.global_config, optimizer, self.memory)
        message = capacity_warning(sizes, self.memory, what=what)
        if message is not None:
            logger.warning("parameter server %d: %s", self.replica_index, message)
        return message

    def track_changes(self) -> None:
        """Every table, now and after any (re)configuration, remembers the rows that
        inserts and updates change (``EmbeddingTable.export_changed_rows``)."""
        with self._lock:
            self.tracks_changes = True
            for table in self._tables.values():
                table.track_changes()

    @property
    def configured(self) -> bool:
        return self._settings is not None

    # -- lookup and update ---------------------------------------------------------

    def _table(self, name: str) -> EmbeddingTable:
        if self._settings is None:
            raise FailedPrecondition(
                "no embedding optimizer configured yet (TrainCtx/InferCtx configures it)"
            )
        if name not in self._tables:
            raise ValueError(f"unknown table {name!r}; this server has {sorted(self._tables)}")
        return self._tables[name]

    def _check_ids(self, name: str, ids: np.ndarray) -> None:
        if ids.dtype != np.uint64 or ids.ndim != 1:
            raise ValueError(f"table {name!r}: ids must be 1-D uint64, got {ids.dtype} {ids.shape}")
        if (ids == RESERVED_ID).any():
            raise ValueError(f"table {name!r}: id {int(RESERVED_ID)} is reserved")
        if self.replica_size > 1 and ids.size:
            wrong = replica_of(ids, self.replica_size) != self.replica_index
            if wrong.any():
                raise ValueError(
                    f"table {name!r}: {int(wrong.sum())} ids belong to other replicas "
                    f"(this is replica {self.replica_index} of {self.replica_size})"
                )

    def lookup(self, requests: list[tuple[str, np.ndarray]], *, training: bool,
               answer: LookupAnswer | None = None,
               out: Callable[[list[tuple[int, int]], list[str]], list[np.ndarray]] | None = None,
               ) -> list[np.ndarray]:
        """Embeddings ``[n, dim]`` for each ``(table, ids)``; training lookups insert new ids.

        ``answer``: how the rows travel back (default float32, uncompressed); float16 tables
        answer a float16 wire with their rows as stored (no conversion), float32 tables
        with theirs narrowed as they are gathered, bfloat16 tables in float32. A lookup
        whose answer would not fit in ``max_message_bytes``, or that would take too much
        memory to serve (:mod:`persia_py.servers.call_memory`), is
        refused before anything is inserted or allocated. ``out``: called with each
        answer's shape and dtype name once every check passed, when the rows can go on the
        wire as gathered (uncompressed, in the wire's type); returns the arrays to write
        them to (default: new ones).
        """
        if training and self.inference:
            raise FailedPrecondition("this parameter server is in inference mode (read-only): "
                                     "only lookups with training=False are answered")
        tables = [self._table(name) for name, _ in requests]
        for name, ids in requests:
            self._check_ids(name, ids)
        shapes = [(ids.size, t.dim) for t, (_, ids) in zip(tables, requests)]
        (answer or LookupAnswer()).check([ids for _, ids in requests], shapes,
                                         self.global_config.common_config.max_message_bytes)
        wire = answer or LookupAnswer()
        dtypes = [np.dtype(np.float16 if wire.fp16 and t.row_type.answers_float16
                           else np.float32) for t in tables]
        as_gathered = not wire.lz4 and all(d.name == wire.dtype for d in dtypes)
        outs = (out(shapes, [d.name for d in dtypes]) if out is not None and as_gathered
                else [None] * len(shapes))
        with self._increments.shared():  # one kernel call for the tables it can serve
            answers = lookup_tables(tables, [ids for _, ids in requests], training, outs, dtypes)
        if training and self.update_log is not None:  # the rows it inserted, for a restart
            self.update_log.lookup(requests)
        return answers

    def prefetch(self, requests: list[tuple[str, np.ndarray]]) -> bool:
        """Queue bringing the rows of these ids that are on disk back into RAM, off the
        lookups' path (:mod:`persia_py.servers.prefetch`); False if not queued."""
        tables = [self._table(name) for name, _ in requests]
        for name, ids in requests:
            self._check_ids(name, ids)
        if self.prefetcher is None:  # no disk tier
            return False
        return self.prefetcher.submit(
            lambda: serve_hint(tables, [ids for _, ids in requests], self._increments))

    def update(
        self,
        requests: list[tuple[str, np.ndarray, np.ndarray]],
        *,
        worker_id: str = "",
        sequence: int = 0,
        replayed: bool = False,
    ) -> tuple[int, bool]:
        """Apply gradients ``(table, ids, grads)``; returns (rows updated, was duplicate).

        The whole request is validated before any table changes, so a bad request
        changes nothing; a request without ids is refused, and so is one that would take
        too much memory to apply (:mod:`persia_py.servers.call_memory`). ``worker_id``
        (see :func:`check_worker_id`; empty: no exactly-once) and ``sequence`` identify
        it; ``replayed``: an update from the update log, accepted when it first came.
        """
        if self.inference:
            raise FailedPrecondition("this parameter server is in inference mode (read-only): "
                                     "updates are refused")
        if not any(ids.size for _, ids, _ in requests):
            raise ValueError("tables: an update must carry at least one id; empty updates are "
                             "refused")
        if worker_id:
            check_worker_id(worker_id)
        tables = [self._table(name) for name, _, _ in requests]
        if not replayed:  # accepted when it came
            call_memory.check_update([(ids.size, g.size, g.dtype.name) for _, ids, g in requests],
                                     self.global_config.common_config.max_message_bytes)
        checked = []
        for (name, ids, grads), table in zip(requests, tables):
            self._check_ids(name, ids)
            try:
                checked.append(table.check_update(ids, grads))
            except ValueError as exc:
                raise ValueError(f"table {name!r}: {exc}") from None
        if worker_id and self._window.seen_before(worker_id, sequence, replayed=replayed):
            return 0, True
        try:
            num_updated = update_tables(tables, checked)  # one kernel call where it can
        except BaseException:
            if worker_id:  # not applied: a retry must not be taken for a duplicate
                self._window.forget(worker_id, sequence)
            raise
        if self.update_log is not None:  # before the caller hears of it: see update_log
            # float16 gradients as they arrived (half the bytes), others as applied
            self.update_log.update([(name, ids, raw if raw.dtype == np.float16 else grads)
                                    for (name, _, raw), (ids, grads) in zip(requests, checked)],
                                   worker_id, sequence)
        with self._count_lock:
            self.num_updates += 1
        return num_updated, False

    def export_seen(self) -> dict[str, np.ndarray]:
        """The exactly-once window: worker id -> its remembered sequence numbers (uint64),
        oldest first; the least recently updating worker first."""
        return self._window.export()

    # -- state: checkpoints and incremental exports ---------------------------------

    def state_dict(self, *, stream: bool = False) -> ReplicaState:
        """A copy of everything this replica holds (each internal shard copied under its
        lock); with ``stream``, the tables themselves instead of their rows' copies, for
        a writer to stream (:meth:`EmbeddingTable.stream_rows`). The caller makes the cut
        consistent across tables and replicas by taking it only when no update is in
        flight (``TrainCtx.dump_checkpoint`` flushes first)."""
        # Read before any row is copied: increments after this one hold rows at least as new.
        increment_seq = self.increment_seq
        with self._lock:
            settings, tables = self._settings, dict(self._tables)
        return ReplicaState(
            settings=None if settings is None else dataclasses.asdict(settings),
            tables={name: table if stream else table.export_rows()
                    for name, table in sorted(tables.items())},
            seen=self.export_seen(), increment_seq=increment_seq)

    def load_state_dict(self, state: ReplicaState) -> int:
        """Replace the settings, every table and the exactly-once window by ``state``'s;
        returns the rows stored. All or nothing: new tables are built and filled beside
        the live ones, and swapped in only once every check passed (settings, table names,
        row shapes and dtypes, distinct ids, finite values, clocks, worker ids); a failure
        (ValueError, or FailedPrecondition if this replica is configured with other
        settings) changes nothing. Tables the state lacks start empty."""
        if state.settings is None:
            raise ValueError("settings: the state has no optimizer settings")
        if not isinstance(state.settings, dict):
            raise ValueError(f"settings: expected a mapping, got {state.settings!r}")
        settings = checked_settings(**state.settings)
        with self._lock:
            self._check_same_settings(settings, "the checkpoint (its embedding optimizer)")
        unknown = sorted(set(state.tables) - set(self.embedding_config.tables))
        if unknown:
            raise ValueError(f"tables {unknown} are not in the embedding config "
                             f"({sorted(self.embedding_config.tables)})")
        seen = checked_window(state.seen)
        tables = self._build_tables(settings)
        try:
            num_rows = self._import(tables, state.tables)
            with self._lock:
                # A Configure may have come meanwhile.
                self._check_same_settings(settings, "the checkpoint (its embedding optimizer)")
                if self.tracks_changes:
                    for table in tables.values():
                        table.track_changes()
                old, self._tables, self._settings = self._tables, tables, settings
                self._window.replace(seen)
        except BaseException:
            for table in tables.values():
                table.close()
            raise
        for table in old.values():
            table.close()
        return num_rows

    def changed_rows(self) -> tuple[dict[str, Rows], dict[str, np.ndarray]]:
        """Every table's rows inserted or updated since the last call (see
        :meth:`track_changes`), and the ids it removed since (evicted or expired, not
        stored again); each table's logs of them are emptied."""
        with self._lock:
            tables = dict(self._tables)
        rows, removed = {}, {}
        for name, table in sorted(tables.items()):
            rows[name], removed[name] = table.export_changed_rows()
        return rows, removed

    def remove_rows(self, ids: dict[str, np.ndarray]) -> int:
        """Delete the stored rows of ``ids`` by table name (the ids an incremental export
        says the training side evicted or expired); returns how many rows went. Every
        table name and id array is checked before any row is removed."""
        tables = self._live_tables(ids)
        for name, table_ids in ids.items():
            try:
                tables[name]._check_ids(table_ids)
            except ValueError as exc:
                raise ValueError(f"table {name!r}: removed ids: {exc}") from None
        return sum(tables[name].remove_ids(table_ids) for name, table_ids in ids.items())

    def apply_increment(self, removed: dict[str, np.ndarray], rows: dict[str, Rows]) -> int:
        """Remove ``removed`` (:meth:`remove_rows`), then store ``rows``
        (:meth:`apply_rows`), with lookups held off meanwhile: a lookup sees an incremental
        export wholly or not at all. Returns the rows stored."""
        with self._increments.exclusive():
            self.remove_rows(removed)
            return self.apply_rows(rows)

    def apply_rows(self, rows: dict[str, Rows]) -> int:
        """Store ``rows`` by table name into the live tables, overwriting rows of the same
        ids (an incremental export's); returns how many. Each table's rows are checked
        before any of them is stored."""
        return self._import(self._live_tables(rows), rows)

    def _live_tables(self, names: dict) -> dict[str, EmbeddingTable]:
        """The live tables, once configured, if every key of ``names`` is one of them."""
        with self._lock:
            if self._settings is None:
                raise FailedPrecondition("not configured: load a checkpoint first")
            tables = dict(self._tables)
        missing = sorted(set(names) - set(tables))
        if missing:
            raise ValueError(f"tables {missing} are not on this server ({sorted(tables)})")
        return tables

    @staticmethod
    def _import(tables: dict[str, EmbeddingTable], rows: Mapping[str, Any]) -> int:
        num_rows = 0
        for name, table_rows in rows.items():
            if isinstance(table_rows, RowChunks):
                try:
                    num_rows += tables[name].load_chunks(table_rows, name=name)
                except ValueError as exc:  # a CheckpointError (damaged file) stays one
                    raise type(exc)(f"table {name!r}: {exc}") from None
                continue
            if not isinstance(table_rows, dict) or set(table_rows) - {"row_dtype"} != set(
                    _ROW_KEYS):
                raise ValueError(f"table {name!r}: rows need exactly the keys {list(_ROW_KEYS)} "
                                 "(and row_dtype)")
            source = table_rows.get("row_dtype", "float32")
            try:
                tables[name].import_rows(table_rows["ids"], table_rows["weights"],
                                         table_rows["state"], table_rows["last_access"],
                                         table_rows["clock"], source)
            except ValueError as exc:
                raise ValueError(f"table {name!r}: {exc}") from None
            if source != tables[name].row_dtype and table_rows["ids"].shape[0]:
                logger.info("table %r: %d rows stored as %s were converted once to the "
                            "table's %s", name, table_rows["ids"].shape[0], source,
                            tables[name].row_dtype)
            num_rows += int(table_rows["ids"].shape[0])
        return num_rows

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-table statistics (empty before configuration)."""
        return {name: table.stats() for name, table in self._tables.items()}

    def disk_stats(self) -> dict[str, dict[str, int]]:
        """Per-table counters of the disk tier (tables with one only; see
        :meth:`persia_py.servers.storage.EmbeddingTable.disk_stats`)."""
        return {name: stats for name, table in self._tables.items()
                if (stats := table.disk_stats())}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        for table in self._tables.values():
            table.close()
