"""The embedding worker, as a plain object: dedup, routing, and per-id gradient updates.

A batch's ID features arrive from a data loader (``put_batch``), are deduplicated per
slot and split by owning parameter-server replica at once (a :class:`RoutingPlan`, built
while earlier batches train) and wait in the forward buffer under a ref. When an NN
worker asks (``lookup``; a retry is answered again), the ids are fetched with one RPC per
replica for all slots and answered as the distinct rows plus an index per id occurrence.
The batch and its plan stay until its gradients come back (``update_gradients``), sent to
the same replicas by the same plan. All of it is vectorized over the batch.

A batch from a data loader carries its identity (the loader's stream and the batch id):
its update goes to the parameter servers as that pair, not as this process's, so when
this worker dies and the loader puts the batch on its restarted successor, the update
routed there again is applied once by every replica (``rerouted``: replicas that applied
it before acknowledge it only). Refs start at a random offset per process, so a ref
handed out by a worker that died is unknown to its successor, never another batch's.

Validation (:mod:`persia_py.workers.feature_checks`) rewrites a slot's ids into the ids
its table stores. The slots of a feature group share one table: their ids are fetched
once and their gradients summed per id.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from persia_py.config import EmbeddingTablesConfig, GlobalConfig
from persia_py.ids.dedup import unique_in_order
from persia_py.proto import common_pb2
from persia_py.wire.finite import all_finite
from persia_py.wire.rpc import NotFound, Overloaded
from persia_py.workers.budget import ByteBudget
from persia_py.workers.feature_checks import check_answer_size, prefixed, validate_features
from persia_py.workers.ps_client import PSClient, UpdateNotApplied
from persia_py.workers.routing_plan import RoutingPlan
from persia_py.workers.slots import SlotIds, SlotRows

logger = logging.getLogger(__name__)

_DONE_REFS_KEPT = 4096
"""Refs of recently finished updates remembered, so that a retried UpdateGradients is
acknowledged without being applied again."""

_STREAM = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
"""A data loader's stream name (part of the parameter servers' worker id of its updates)."""

_PUT_WAIT_SEC = 1.0
"""How long put_batch waits for room before answering RESOURCE_EXHAUSTED (the data loader
retries; nothing is dropped)."""


@dataclass(frozen=True)
class _DedupedSlot:
    """One slot of a batch, deduplicated: ``ids == unique[inverse]``."""

    slot: str
    unique: np.ndarray  # uint64 [num_distinct], in order of first occurrence
    inverse: np.ndarray  # int64 [num_ids]
    lengths: np.ndarray  # int32 [batch_size], in raw ids

    @classmethod
    def of(cls, f: SlotIds) -> _DedupedSlot:
        # One pass with a hash set: np.unique sorts, which costs several times more.
        return cls(f.slot, *unique_in_order(f.ids), f.lengths)


@dataclass
class _PendingBatch:
    slots: list[_DedupedSlot]
    requires_grad: bool
    nbytes: int
    plan: RoutingPlan | None = None  # built on arrival; its lookup and update both use it
    looked_up: bool = False  # claimed by a lookup; its gradients may come back
    sequences: list[int] | None = None  # of its update, per replica; kept for retries
    sent: list[bool] | None = None  # per replica: its update was sent (a resend is a retry)
    identity: tuple[str, int] | None = None  # (data loader stream, batch id)
    update_lock: threading.Lock = field(default_factory=threading.Lock)

    def routed(self) -> RoutingPlan:
        """Its plan, which put_batch sets before it returns the batch's ref: before any
        lookup or update of it."""
        assert self.plan is not None, "a batch looked up or updated before it was routed"
        return self.plan


class EmbeddingWorker:
    """Embedding worker ``index``, talking to every parameter-server replica."""

    def __init__(
        self,
        global_config: GlobalConfig,
        embedding_config: EmbeddingTablesConfig,
        ps_clients: list[PSClient],
        *,
        index: int = 0,
    ) -> None:
        self.global_config = global_config
        self.embedding_config = embedding_config
        self.ps_clients = ps_clients
        # Random per process start: parameter servers outlive workers, and an id derived
        # from the index and PID (1 in every container) would be reused by a restarted
        # worker, whose first updates the servers would then take for retries and drop.
        self.worker_id = f"embedding-worker-{index}-{secrets.token_hex(16)}"
        self._capacity = global_config.embedding_worker_config.forward_buffer_size
        self.budget = ByteBudget(global_config.embedding_worker_config.max_buffer_bytes,
                                 "embedding_worker_config.max_buffer_bytes")
        self._buffer: dict[int, _PendingBatch] = {}
        self._buffer_changed = threading.Condition()
        self._next_ref = itertools.count((secrets.randbits(46) << 16) + 1)
        self._refs_by_identity: dict[tuple[str, int], int] = {}
        """(stream, batch id) -> ref of the pending batches put with an identity."""
        self._sequence = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(ps_clients)),
                                        thread_name_prefix="ps-call")
        self.num_nonfinite_skipped: dict[str, int] = {}
        self.on_lookup_timed: Callable[[float, float, float], None] | None = None
        """Metrics hook: called with the seconds of a lookup's phases (pre: dedup and
        routing of a direct lookup, a stored batch's were done on arrival; rpc:
        parameter-server calls; post: assembling the answer)."""
        self._prefetch = global_config.embedding_parameter_server_config.disk_tier.enabled
        """Send the ids of every batch put to the replicas ahead of its lookup (their
        disk tier reads them back meanwhile), on threads of their own: a slow hint never
        holds up a lookup."""
        self._hints = ThreadPoolExecutor(max_workers=max(1, len(ps_clients)),
                                         thread_name_prefix="ps-hint")
        self._configured = False
        self._configure_request: common_pb2.ConfigureRequest | None = None
        self._done: collections.OrderedDict[int, int] = collections.OrderedDict()
        """Ref -> rows updated, of recently finished updates (under ``_buffer_changed``)."""

    # -- configuration -------------------------------------------------------------

    def configure(self, request: common_pb2.ConfigureRequest) -> None:
        """Forward the embedding optimizer and table settings to every replica."""
        list(self._pool.map(lambda c: c.configure(request), self.ps_clients))
        self._configure_request = request
        self._configured = True

    def _on_replica(self, r: int, fn: Callable[[PSClient], Any]) -> Any:
        """``fn(client of replica r)``; once more after re-configuring a restarted replica.

        A parameter server restarted without a checkpoint is empty and unconfigured; it
        answers FAILED_PRECONDITION until it gets the embedding optimizer again.
        """
        client = self.ps_clients[r]
        try:
            return fn(client)
        except grpc.RpcError as exc:
            if (exc.code() != grpc.StatusCode.FAILED_PRECONDITION
                    or self._configure_request is None):
                raise
            logger.warning("parameter server %s is not configured (restarted without a "
                           "checkpoint?): sending the embedding optimizer again", client.address)
            client.configure(self._configure_request)
            return fn(client)

    @property
    def configured(self) -> bool:
        return self._configured

    # -- validation ------------------------------------------------------------------

    def validate_features(self, features: list[SlotIds], batch_size: int) -> list[SlotIds]:
        """Check a batch's ID features against the config; apply hash stacking and prefix."""
        return validate_features(self.embedding_config, features, batch_size)

    def _prefixed(self, slot: str, ids: np.ndarray) -> np.ndarray:
        return prefixed(self.embedding_config, slot, ids)

    # -- forward buffer --------------------------------------------------------------

    def put_batch(self, features: list[SlotIds], batch_size: int, requires_grad: bool, *,
                  identity: tuple[str, int] | None = None) -> int:
        """Store a batch's ID features, deduplicated per slot and routed at once (off the
        lookup's path); returns its ref. Overloaded when the buffer is full.

        ``identity``: the data loader's (stream, batch id), which its update is sent as;
        putting a batch that is still pending again returns its ref (a retried put)."""
        if identity is not None:
            if not _STREAM.fullmatch(identity[0]):
                raise ValueError(f"stream {identity[0][:80]!r}: expected 1 to 64 characters "
                                 "out of letters, digits and _.:-")
            with self._buffer_changed:
                if identity in self._refs_by_identity:
                    return self._refs_by_identity[identity]
        features = self.validate_features(features, batch_size)
        # The distinct ids (at most one per id) and the int64 inverse, with the lengths,
        # and the routing plan.
        grouped = {t for t, slots in self.embedding_config.tables.items() if len(slots) > 1}
        nbytes = sum(2 * f.ids.nbytes + f.lengths.nbytes + RoutingPlan.max_nbytes(
            f.ids.size, self.embedding_config.table_of(f.slot) in grouped) for f in features)
        if not self.budget.try_acquire(nbytes, timeout=_PUT_WAIT_SEC):
            raise Overloaded(f"buffer full ({self.budget.used} of {self.budget.capacity} bytes); "
                             "retry later")
        with self._buffer_changed:
            if not self._buffer_changed.wait_for(
                lambda: len(self._buffer) < self._capacity, timeout=_PUT_WAIT_SEC
            ):
                self.budget.release(nbytes)
                raise Overloaded(f"forward buffer full ({self._capacity} batches); retry later")
            if identity in self._refs_by_identity:  # a retry raced its first attempt
                self.budget.release(nbytes)
                return self._refs_by_identity[identity]
            ref = next(self._next_ref)
            # Holds its place; nobody knows the ref before this returns.
            self._buffer[ref] = batch = _PendingBatch([], requires_grad, nbytes,
                                                      identity=identity)
            if identity is not None:
                self._refs_by_identity[identity] = ref
        try:
            batch.slots = [_DedupedSlot.of(f) for f in features]
            batch.plan = self._plan(batch.slots)
        except BaseException:
            self._release(ref)
            raise
        if self._prefetch and requires_grad:
            self._send_prefetch(batch.plan)
        return ref

    def _send_prefetch(self, plan: RoutingPlan) -> None:
        """Hint every replica that the batch's ids come next: with a disk tier, its rows on
        disk are read back while earlier batches train (:mod:`persia_py.servers.prefetch`).
        Not waited for; a hint that fails is logged and the lookup reads the rows itself."""
        per_replica = plan.lookup_requests()

        def send(r: int) -> None:
            try:
                if per_replica[r]:
                    self.ps_clients[r].prefetch(per_replica[r])
            except Exception as exc:  # a hint: nothing depends on it
                logger.debug("prefetch hint to replica %d failed: %s", r, exc)

        try:
            for r in range(plan.num_replicas):
                self._hints.submit(send, r)
        except RuntimeError:  # the worker is closing: no more hints
            pass

    def _release(self, ref: int) -> None:
        with self._buffer_changed:
            batch = self._buffer.pop(ref, None)
            if batch is not None and batch.identity is not None:
                self._refs_by_identity.pop(batch.identity, None)
            self._buffer_changed.notify_all()
        if batch is not None:
            self.budget.release(batch.nbytes)

    @property
    def num_pending(self) -> int:
        return len(self._buffer)

    @property
    def num_looked_up(self) -> int:
        """Batches looked up whose gradients have not come back yet."""
        with self._buffer_changed:
            return sum(b.looked_up for b in self._buffer.values())

    # -- lookup ----------------------------------------------------------------------

    def lookup(self, ref: int) -> list[SlotRows]:
        """Look up a stored batch for training; its ids stay until its gradients arrive."""
        with self._buffer_changed:
            batch = self._buffer.get(ref)
            if batch is None:
                raise NotFound(f"no batch with ref {ref} on this embedding worker")
            # Looked up already: a retry whose answer was lost (see the module docstring).
            claimed, batch.looked_up = not batch.looked_up, True
        try:
            rows = self._lookup(batch.slots, batch.routed(), training=batch.requires_grad)
        except BaseException:
            if claimed:
                batch.looked_up = False  # let the caller retry the lookup
            raise
        if not batch.requires_grad:
            self._release(ref)
        return rows

    def lookup_direct(self, features: list[SlotIds], batch_size: int) -> list[SlotRows]:
        """Look up ids for inference: nothing is inserted, nothing is kept."""
        started = time.perf_counter()
        slots = [_DedupedSlot.of(f) for f in self.validate_features(features, batch_size)]
        return self._lookup(slots, self._plan(slots), training=False, started=started)

    def _plan(self, slots: list[_DedupedSlot]) -> RoutingPlan:
        """Where a batch's ids go; the slots of a feature group share one table, so their
        ids are fetched once. Refuses a batch whose answer could not be sent."""
        common = self.global_config.common_config
        check_answer_size(self.embedding_config, [
            (s.slot, s.unique.size, s.inverse.size, s.lengths.size) for s in slots],
            row_bytes=2 if common.embedding_fp16 else 4, limit=common.max_message_bytes)
        return RoutingPlan.of_slots({s.slot: s.unique for s in slots},
                                    self.embedding_config.table_of, len(self.ps_clients))

    def _lookup(self, slots: list[_DedupedSlot], plan: RoutingPlan, *, training: bool,
                started: float | None = None) -> list[SlotRows]:
        """Rows of deduplicated slots: the NN worker gets one row per distinct id of a slot."""
        started = time.perf_counter() if started is None else started
        rpc_started = time.perf_counter()
        table_rows = self._fetch_rows(plan, training=training)
        rpc_done = time.perf_counter()
        result = []
        for s in slots:
            cfg = self.embedding_config.slots_config[s.slot]
            table = self.embedding_config.table_of(s.slot)
            result.append(SlotRows(
                slot=s.slot,
                rows=plan.slot_rows(table, s.slot, table_rows[table]),
                index=s.inverse,
                lengths=s.lengths,
                pooling=cfg.pooling_mode,
                sqrt_scaling=cfg.sqrt_scaling,
                sample_fixed_size=cfg.sample_fixed_size,
                hash_stack_rounds=cfg.hash_stack_config.rounds,
            ))
        if self.on_lookup_timed is not None:
            self.on_lookup_timed(rpc_started - started, rpc_done - rpc_started,
                                 time.perf_counter() - rpc_done)
        return result

    def _lookup_tables(self, table_ids: dict[str, np.ndarray], *,
                       training: bool) -> dict[str, np.ndarray]:
        """Rows ``[n, dim]`` of each table's distinct ids (table -> ids)."""
        return self._fetch_rows(RoutingPlan.of_tables(table_ids, len(self.ps_clients)),
                                training=training)

    def _fetch_rows(self, plan: RoutingPlan, *, training: bool) -> dict[str, np.ndarray]:
        """Rows ``[n, dim]`` of each table's ids, with one RPC per replica for all tables."""
        per_replica = plan.lookup_requests()
        answers = list(self._pool.map(
            # Rows stay as they travelled (float16 with embedding_fp16): only sent on.
            lambda r: self._on_replica(r, lambda c: c.lookup(per_replica[r], training=training,
                                                             as_float32=False)),
            range(plan.num_replicas),
        ))
        return plan.table_rows(answers)

    # -- backward --------------------------------------------------------------------

    def update_gradients(self, ref: int, grads: dict[str, np.ndarray], *,
                         rerouted: bool = False) -> int:
        """Route one batch's per-row gradients to the parameter servers; frees the batch.

        A slot whose gradients contain NaN or Inf is skipped (counted and logged); the
        other slots are applied. Safe to retry: the batch stays until every replica has
        acknowledged, a retry reuses the first attempt's sequence numbers (so a replica
        applies it once), and a repeat of a finished ref returns its answer unapplied.
        ``rerouted``: the batch (put with an identity) was looked up on a worker that
        died; its update may have reached some replicas, which acknowledge it only.
        """
        with self._buffer_changed:
            batch = self._buffer.get(ref)
            if batch is None and ref in self._done:
                return self._done[ref]
        if batch is None:
            raise NotFound(f"no batch with ref {ref} on this embedding worker")
        with batch.update_lock:  # a retry arriving while the first attempt runs waits for it
            with self._buffer_changed:
                if ref in self._done:
                    return self._done[ref]
            num_updated = self._update_gradients(ref, batch, grads, rerouted)
            with self._buffer_changed:
                self._done[ref] = num_updated
                if len(self._done) > _DONE_REFS_KEPT:
                    self._done.popitem(last=False)
            self._release(ref)
        return num_updated

    def _update_gradients(self, ref: int, batch: _PendingBatch,
                          grads: dict[str, np.ndarray], rerouted: bool) -> int:
        if rerouted and batch.identity is None:
            raise ValueError(f"batch {ref}: only a batch put with its data loader's identity "
                             "can be rerouted")
        if not ((batch.looked_up or rerouted) and batch.requires_grad):
            raise ValueError(f"batch {ref} has not been looked up for training")
        unique_ids = {s.slot: s.unique for s in batch.slots}
        unknown = set(grads) - set(unique_ids)
        if unknown:
            raise ValueError(f"gradients for slots {sorted(unknown)} not in batch {ref}")
        missing = set(unique_ids) - set(grads)
        if missing:
            raise ValueError(f"batch {ref}: gradients missing for slots {sorted(missing)}")
        finite = {}  # slot -> gradients; a slot left out sends nothing
        for slot, unique in unique_ids.items():
            g = grads[slot]
            dim = self.embedding_config.slots_config[slot].dim
            if g.shape != (unique.size, dim):
                raise ValueError(
                    f"slot {slot!r}: gradients of shape {g.shape}, expected ({unique.size}, {dim})"
                )
            if not all_finite(g):
                self.num_nonfinite_skipped[slot] = self.num_nonfinite_skipped.get(slot, 0) + 1
                logger.warning("slot %r: non-finite embedding gradients in batch %d skipped "
                               "(%d so far)", slot, ref, self.num_nonfinite_skipped[slot])
                continue
            finite[slot] = g
        per_replica = batch.routed().update_requests(finite)
        if batch.sequences is None:
            batch.sequences = [next(self._sequence) if batch.identity is None
                               else batch.identity[1] for _ in per_replica]
            batch.sent = [rerouted for _ in per_replica]
        counts = list(self._pool.map(
            lambda r: self._update_replica(r, batch, per_replica[r]) if per_replica[r] else 0,
            range(len(per_replica)),
        ))
        return sum(counts)

    def _update_replica(self, r: int, batch: _PendingBatch,
                        slots: list[tuple[str, np.ndarray, np.ndarray]]) -> int:
        """Send replica ``r`` its part of a batch's update; a retry resends the same
        ``(worker id, sequence)`` so that the replica applies it once."""
        sequences, sent = batch.sequences, batch.sent
        assert sequences is not None and sent is not None, "update() sets them first"
        sequence, resend = sequences[r], sent[r]
        sent[r] = True
        worker_id = self.worker_id if batch.identity is None else f"data-{batch.identity[0]}"
        try:
            return self._on_replica(r, lambda c: c.update(
                slots, worker_id=worker_id, sequence=sequence, resend=resend))
        except UpdateNotApplied as exc:
            if batch.identity is not None:
                # Nothing of this worker sent the pair before (a rerouted batch is sent as
                # `resend`), so another sender took it: the gradients were not applied, and
                # taking the answer for success would lose them. Every attempt says so; the
                # pair cannot change (it is what applies a rerouted batch once).
                sent[r] = False
                raise UpdateNotApplied(
                    f"batch {sequence} of data loader stream {batch.identity[0][:12]}...: "
                    f"{exc}; its gradients are not applied (a stream's identity is random "
                    "per training start, so this is a forged update or a reused stream)"
                ) from None
            # The replica had the pair from another sender: a later attempt takes a new
            # sequence, so that it is applied (or refused again), never acknowledged unapplied.
            sequences[r], sent[r] = next(self._sequence), False
            raise

    def close(self) -> None:
        """Close the parameter-server channels, then wait for the pool. Call it after the
        gRPC server has stopped: the pool only runs work of calls in flight, whose callers
        no longer get an answer and send again what was not acknowledged. Closing the
        channels first cancels their attempts; waiting first would let a call to a
        parameter server that stopped too retry for ``rpc_timeout_sec``."""
        for client in self.ps_clients:
            client.close()
        self._hints.shutdown(wait=True)
        self._pool.shutdown(wait=True)
