"""One embedding-parameter-server replica, as a plain object testable without gRPC.

It owns one :class:`EmbeddingTable` per feature group of the embedding config, named
after the group (a slot outside ``feature_groups`` is a group of its own, so its table
bears the slot's name); requests name tables. Tables are created
when the embedding optimizer arrives (``configure``), because a row's optimizer state is
laid out by the optimizer. Updates carry ``(worker_id, sequence)``; a pair seen before is
acknowledged without being applied again, so a retried update is applied once.

A replica in *inference* mode (serving) is read-only: it answers lookups with
``training=False`` only (unknown ids read as zeros and are never inserted) and refuses
training lookups and updates with FailedPrecondition; its rows change only by loading a
checkpoint or applying an incremental export. Its tables never expire rows.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass

import numpy as np

from persia_py.config import EmbeddingConfig, GlobalConfig
from persia_py.routing import RESERVED_ID, replica_of
from persia_py.rpc import FailedPrecondition
from persia_py.servers.optimizers import optimizer_from_dict, optimizer_to_dict
from persia_py.servers.storage import EmbeddingTable

_SEEN_PER_WORKER = 65536
"""How many recent sequence numbers per worker are remembered for exactly-once updates."""


@dataclass(frozen=True, kw_only=True)
class TableSettings:
    """What ``configure`` sets; identical repeats are accepted, conflicting ones refused."""

    optimizer: dict
    init_lower: float
    init_upper: float
    weight_bound: float | None
    seed: int


class ParameterServer:
    """Replica ``replica_index`` of ``replica_size``: lookups and updates of its ids."""

    def __init__(
        self,
        global_config: GlobalConfig,
        embedding_config: EmbeddingConfig,
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
        self._seen: dict[str, collections.OrderedDict[int, None]] = {}
        self._seen_lock = threading.Lock()
        self.num_updates = 0
        self.tracks_changes = False
        """Tables remember changed rows (for incremental exports; see ``track_changes``)."""
        self.increment_seq = 0
        """Sequence number of the last incremental export (recorded in checkpoints)."""

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
        opt = optimizer_from_dict(optimizer)  # validates
        if not (np.isfinite(init_lower) and np.isfinite(init_upper) and init_lower < init_upper):
            raise ValueError(f"initialization bounds must satisfy lower < upper, got "
                             f"({init_lower}, {init_upper})")
        if weight_bound is not None and not weight_bound > 0:
            raise ValueError(f"weight_bound must be > 0, got {weight_bound}")
        settings = TableSettings(
            optimizer=optimizer_to_dict(opt),
            init_lower=float(init_lower),
            init_upper=float(init_upper),
            weight_bound=weight_bound,
            seed=int(seed),
        )
        with self._lock:
            if self._settings is not None:
                if settings != self._settings:
                    raise FailedPrecondition(
                        "already configured with different settings: "
                        f"{json.dumps(self._settings.__dict__)}"
                    )
                return
            ps_cfg = self.global_config.embedding_parameter_server_config
            for name, slots in self.embedding_config.tables.items():
                # A group's slots agree on dim and capacity (checked by the config).
                slot = self.embedding_config.slots_config[slots[0]]
                self._tables[name] = EmbeddingTable(
                    dim=slot.dim,
                    optimizer=opt if slot.optimizer is None else optimizer_from_dict(
                        slot.optimizer),
                    init_lower=settings.init_lower,
                    init_upper=settings.init_upper,
                    seed=settings.seed,
                    num_shards=ps_cfg.num_hashmap_internal_shards,
                    capacity=slot.capacity or ps_cfg.capacity,
                    weight_bound=weight_bound,
                    admit_probability=slot.admit_probability,
                    min_occurrences=slot.min_occurrences,
                    # A serving replica keeps every row it was given.
                    expire_after_steps=None if self.inference else slot.expire_after_steps,
                    expire_after_seconds=None if self.inference else slot.expire_after_seconds,
                )
                if self.tracks_changes:
                    self._tables[name].track_changes()
            self._settings = settings

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

    def _table(self, slot: str) -> EmbeddingTable:
        if self._settings is None:
            raise FailedPrecondition(
                "no embedding optimizer configured yet (TrainCtx/InferCtx configures it)"
            )
        if slot not in self._tables:
            raise ValueError(f"unknown slot {slot!r}; this server has {sorted(self._tables)}")
        return self._tables[slot]

    def _check_ids(self, slot: str, ids: np.ndarray) -> None:
        if ids.dtype != np.uint64 or ids.ndim != 1:
            raise ValueError(f"slot {slot!r}: ids must be 1-D uint64, got {ids.dtype} {ids.shape}")
        if (ids == RESERVED_ID).any():
            raise ValueError(f"slot {slot!r}: id {int(RESERVED_ID)} is reserved")
        if self.replica_size > 1 and ids.size:
            wrong = replica_of(ids, self.replica_size) != self.replica_index
            if wrong.any():
                raise ValueError(
                    f"slot {slot!r}: {int(wrong.sum())} ids belong to other replicas "
                    f"(this is replica {self.replica_index} of {self.replica_size})"
                )

    def lookup(self, requests: list[tuple[str, np.ndarray]], *, training: bool,
               answer_itemsize: int = 4) -> list[np.ndarray]:
        """Embeddings ``[n, dim]`` for each ``(slot, ids)``; training lookups insert new ids.

        A request whose answer (``answer_itemsize`` bytes per value) would not fit in
        ``max_message_bytes`` is refused before anything is inserted.
        """
        if training and self.inference:
            raise FailedPrecondition("this parameter server is in inference mode (read-only): "
                                     "only lookups with training=False are answered")
        tables = [self._table(slot) for slot, _ in requests]
        for slot, ids in requests:
            self._check_ids(slot, ids)
        answer_bytes = sum(ids.size * t.dim * answer_itemsize for t, (_, ids) in zip(tables, requests))
        limit = self.global_config.common_config.max_message_bytes
        if answer_bytes > limit:
            raise ValueError(f"the answer would carry {answer_bytes} bytes of embeddings, over "
                             f"max_message_bytes {limit}; look up fewer ids per call")
        return [t.lookup(ids, insert=training) for t, (_, ids) in zip(tables, requests)]

    def update(
        self,
        requests: list[tuple[str, np.ndarray, np.ndarray]],
        *,
        worker_id: str = "",
        sequence: int = 0,
    ) -> tuple[int, bool]:
        """Apply gradients ``(slot, ids, grads)``; returns (rows updated, was duplicate).

        The whole request is validated before any table changes, so a bad request
        changes nothing.
        """
        if self.inference:
            raise FailedPrecondition("this parameter server is in inference mode (read-only): "
                                     "updates are refused")
        tables = [self._table(slot) for slot, _, _ in requests]
        checked = []
        for (slot, ids, grads), table in zip(requests, tables):
            self._check_ids(slot, ids)
            try:
                checked.append(table.check_update(ids, grads))
            except ValueError as exc:
                raise ValueError(f"slot {slot!r}: {exc}") from None
        if worker_id and self._seen_before(worker_id, sequence):
            return 0, True
        num_updated = sum(table.apply_update(ids, grads)
                          for (ids, grads), table in zip(checked, tables))
        with self._seen_lock:
            self.num_updates += 1
        return num_updated, False

    def _seen_before(self, worker_id: str, sequence: int) -> bool:
        with self._seen_lock:
            seen = self._seen.setdefault(worker_id, collections.OrderedDict())
            if sequence in seen:
                return True
            seen[sequence] = None
            if len(seen) > _SEEN_PER_WORKER:
                seen.popitem(last=False)
            return False

    def export_seen(self) -> dict[str, np.ndarray]:
        """The exactly-once window: worker id -> its remembered sequence numbers, oldest first."""
        with self._seen_lock:
            return {w: np.fromiter(seen, dtype=np.int64, count=len(seen))
                    for w, seen in self._seen.items()}

    def import_seen(self, windows: dict[str, np.ndarray]) -> None:
        """Remember these sequence numbers too (a checkpoint's window), in ascending order."""
        with self._seen_lock:
            for worker_id, sequences in windows.items():
                seen = self._seen.setdefault(worker_id, collections.OrderedDict())
                for sequence in np.unique(np.asarray(sequences, dtype=np.int64)).tolist():
                    seen[sequence] = None
                while len(seen) > _SEEN_PER_WORKER:
                    seen.popitem(last=False)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-table statistics (empty before configuration)."""
        return {slot: table.stats() for slot, table in self._tables.items()}

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
