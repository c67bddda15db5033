"""A request over many tables, served by one kernel call per kind of table (issue 43).

A lookup or update names up to every table of the server (the embedding-heavy benchmark's
26 slots: 26 tables). Served table by table, each table costs a few kernel dispatches and
the interpreter's bookkeeping around them; here the tables a call can serve together,
those of one internal shard without a disk tier (:meth:`EmbeddingTable.single_shard`),
go to one call of :mod:`persia_py.servers.request_kernels` per group of one set of
element types (rows, answer, gradients: one compiled kernel each), holding their shards'
locks for that call. Everything around the kernels stays each table's and each shard's
own code, in the same order: the checks, the clock's tick and expiry sweeps
(:meth:`EmbeddingTable.start_lookup`), admission, insertion and eviction of the ids not
found (:meth:`Shard.found`), the change log and stamps (:meth:`Shard.start_update`), the
summing of repeated rows (:meth:`Shard.step_rows`). A training lookup leaves each shard
the rows it found, and the update of the same ids starts from them instead of probing
the index again (:mod:`persia_py.servers.row_hints`; each checked). Other tables (several internal
shards, a disk tier, a table named twice in one request, a custom optimizer, arrays
the kernels cannot take as they are) are served table by table as before.

Locks: a call takes its shards' locks in one global order (by ``id``) and holds them
together for the call; every other path holds one shard lock at a time, so no two paths
can wait on each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from persia_py.servers.optimizers import KernelStep
from persia_py.servers.request_kernels import TABLES_PER_CALL, find_gather_tables, step_tables
from persia_py.servers.row_types import kernel_view
from persia_py.servers.shard import Shard
from persia_py.servers.storage import EmbeddingTable

__all__ = ["lookup_tables", "update_tables"]

_NO_HINT = np.zeros(0, np.int32)
"""The hints of an update whose lookup left none (:mod:`persia_py.servers.row_hints`)."""


def lookup_tables(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray], insert: bool,
                  outs: Sequence[np.ndarray | None], dtypes: Sequence[npt.DTypeLike]
                  ) -> list[np.ndarray]:
    """``[table.lookup(ids, insert, out=out, dtype=dtype) ...]`` of every entry, with the
    same results; the tables checked and ticked first, all of them."""
    started = [table.start_lookup(table_ids, out, dtype)
               for table, table_ids, out, dtype in zip(tables, ids, outs, dtypes)]
    read_ids = [_read_only(table_ids) for table_ids, _, _ in started]
    groups, alone = _groups(tables, [(table_ids, kernel_view(out))
                                     for table_ids, (_, out, _) in zip(read_ids, started)])
    for k in alone:
        tables[k].lookup_started(started[k][0], insert, started[k][2], started[k][1])
    for members in groups:
        shards = [shard for _, shard in members]
        with _holding(shards):
            stamps = [shard.clock.stamp(started[k][2], shard.last_access[:shard.size])
                      for k, shard in members]
            ids_k = [read_ids[k] for k, _ in members]
            outs_k = [kernel_view(started[k][1]) for k, _ in members]
            offsets = _offsets(ids_k)
            rows = find_gather_tables(
                len(members), *_index_args(shards), _padded(ids_k),
                _padded([kernel_view(shard.weights) for shard in shards]), _padded(outs_k),
                _padded([shard.last_access for shard in shards]),
                np.array(stamps, np.int64), offsets)
            for j, (k, shard) in enumerate(members):
                found = shard.found(ids_k[j], rows[offsets[j]:offsets[j + 1]], insert,
                                    started[k][2], stamps[j], outs_k[j], None)
                if insert:  # a training lookup: its update comes with the same ids
                    shard.hints.remember(ids_k[j], found)
    return [out for _, out, _ in started]


def update_tables(tables: Sequence[EmbeddingTable],
                  checked: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """``sum(table.apply_update(ids, grads) ...)`` of every entry (input as
    :meth:`EmbeddingTable.check_update` returns it), with the same results."""
    read = [(_read_only(ids), _read_only(kernel_view(grads))) for ids, grads in checked]
    groups, alone = _groups(tables, read, update=True)
    num_updated = sum(tables[k].apply_update(*checked[k]) for k in alone)
    for members in groups:
        shards = [shard for _, shard in members]
        ids_k = [read[k][0] for k, _ in members]
        grads_k = [read[k][1] for k, _ in members]
        steps = [tables[k].row_step for k, _ in members]
        kinds = [cast(KernelStep, step.step) for step in steps]  # as _groups checked
        params = np.array([(s.lr, s.weight_decay, s.bound, s.eps, s.momentum) for s in kinds],
                          np.float32)
        betas = np.array([(s.beta1, s.beta2) for s in kinds], np.float64)
        offsets = _offsets(ids_k)
        ticks = [tables[k].clock_now for k, _ in members]
        with _holding(shards):
            stamps = [shard.start_update(ids_j, tick)
                      for shard, ids_j, tick in zip(shards, ids_k, ticks)]
            hints = [shard.hints.take(ids_j) for shard, ids_j in zip(shards, ids_k)]
            rows, stepped, held = step_tables(
                len(members), *_index_args(shards),
                np.array([shard.size for shard in shards], np.int64), _padded(ids_k),
                _padded([_NO_HINT if h is None else h for h in hints]), _padded(grads_k),
                _padded([kernel_view(shard.weights) for shard in shards]),
                _padded([shard.state for shard in shards]),
                _padded([shard.last_access for shard in shards]),
                np.array(stamps, np.int64), offsets,
                np.array([s.kind for s in kinds], np.int64),
                np.array([step.rounding[0] for step in steps], np.uint64),
                np.array([step.rounding[1] for step in steps], np.bool_), params, betas)
            for j, shard in enumerate(shards):
                shard.hints.held += int(held[j])
                if stepped[j] < 0:  # a row met twice: its gradients are summed first
                    stepped[j] = shard.step_rows(ids_k[j], rows[offsets[j]:offsets[j + 1]],
                                                 checked[members[j][0]][1], stamps[j])
        num_updated += int(stepped.sum())
    return num_updated


def _groups(tables: Sequence[EmbeddingTable], arrays: list[tuple[np.ndarray, np.ndarray]],
            update: bool = False) -> tuple[list[list[tuple[int, Shard]]], list[int]]:
    """The entries one kernel call can serve, by group of element types (at most
    :data:`TABLES_PER_CALL` each), and the others. ``arrays``: each entry's ids and its
    answer (lookup) or gradients (update), as the kernels take them."""
    named = [id(table) for table in tables]
    by_key: dict[tuple, list[tuple[int, Shard]]] = {}
    alone = []
    for k, (table, (ids, other)) in enumerate(zip(tables, arrays)):
        shard = table.single_shard()
        if (shard is None or named.count(id(table)) > 1 or not ids.flags.aligned
                or not other.flags.aligned or shard.index.probe_args()[0].dtype != np.uint32
                or (update and (not ids.shape[0]
                                or not isinstance(table.row_step.step, KernelStep)))):
            alone.append(k)
            continue
        key = (kernel_view(shard.weights).dtype, other.dtype, other.flags.writeable)
        by_key.setdefault(key, []).append((k, shard))
    groups = [members[at:at + TABLES_PER_CALL] for members in by_key.values()
              for at in range(0, len(members), TABLES_PER_CALL)]
    return groups, alone


def _index_args(shards: list[Shard]) -> tuple[tuple, tuple, np.ndarray, tuple, np.ndarray,
                                               np.ndarray]:
    """The arguments of the kernels that say each shard's index (``HashIndex.probe_args``)."""
    args = [shard.index.probe_args() for shard in shards]
    return (_padded([a[0] for a in args]), _padded([a[1] for a in args]),
            np.array([a[2] for a in args], np.uint64), _padded([a[3] for a in args]),
            np.array([a[4] for a in args], np.uint64), np.array([a[5] for a in args], np.int64))


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, or a read-only view of it, for what the kernels only read: a wire's
    buffers are read-only, a caller's arrays mostly not, and numba compiles a kernel once
    per array type, read-only or not (each variant some seconds)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def _offsets(ids: list[np.ndarray]) -> np.ndarray:
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([part.shape[0] for part in ids], out=offsets[1:])
    return offsets


def _padded(arrays: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """``arrays`` (of one numba type) and empty arrays of that type after them, up to
    :data:`TABLES_PER_CALL`: one compiled kernel serves any number of tables."""
    first = arrays[0]
    empty = np.zeros((0, *first.shape[1:]), first.dtype)
    empty.flags.writeable = first.flags.writeable
    return (*arrays, *[empty] * (TABLES_PER_CALL - len(arrays)))


@contextlib.contextmanager
def _holding(shards: list[Shard]) -> Iterator[None]:
    """The shards' locks, taken in one global order, released in the opposite one."""
    taken = []
    try:
        for shard in sorted(shards, key=id):
            shard.lock.acquire()
            taken.append(shard.lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release()
