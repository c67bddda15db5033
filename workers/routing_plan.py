"""A batch's routing plan: which parameter-server replica gets which of its distinct ids.

The embedding worker builds one plan per batch, when the batch arrives, and keeps it
with the batch: the lookup sends every replica its ids and puts the answers back in
place, and the gradients that come back for the same rows go to the same replicas by
the same positions (as TorchRec's input_dist and output_dist share one context). No id is
hashed, grouped or split twice. Everything is vectorized over the batch.

The slots of a feature group share one table: the plan holds the table's distinct ids
once (sorted) and, per slot, where the slot's own distinct ids sit among them.

Rows are gathered with ``numpy.take(..., axis=0)``, which copies a whole row at a time:
indexing a 2-D array with an array of positions goes element by element, several times
slower (docs/benchmarks.md#scaling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from persia_py.ids.dedup import unique_in_order
from persia_py.ids.routing import replica_of, split_by

Positions = np.ndarray | slice
"""Positions into a table's ids: an int64 array, or ``slice(None)`` for all (no copy)."""


@dataclass(frozen=True)
class TablePlan:
    """One table's share of a batch."""

    ids: np.ndarray
    """uint64 ``[n]``: the distinct ids the batch reads from the table."""
    by_replica: list[Positions]
    """Per replica, the positions in ``ids`` of the ids it owns."""
    slot_rows: dict[str, np.ndarray | None]
    """Per slot of the table, the position in ``ids`` of each of the slot's distinct ids
    (``None``: the table's only slot, whose distinct ids are ``ids`` themselves)."""

    @property
    def nbytes(self) -> int:
        arrays = [p for p in self.by_replica if isinstance(p, np.ndarray)]
        arrays += [r for r in self.slot_rows.values() if r is not None]
        own_ids = self.ids.nbytes if len(self.slot_rows) > 1 else 0  # else the slot's array
        return own_ids + sum(a.nbytes for a in arrays)


class RoutingPlan:
    """Where each table's ids of one batch go, for its lookup and for its gradients."""

    def __init__(self, tables: dict[str, TablePlan], num_replicas: int) -> None:
        self.tables = tables
        self.num_replicas = num_replicas

    @classmethod
    def of_slots(cls, unique_ids: dict[str, np.ndarray], table_of: Callable[[str], str],
                 num_replicas: int) -> RoutingPlan:
        """The plan for slots' distinct ids (slot -> ids); ``table_of`` names a slot's table."""
        slots_of: dict[str, list[str]] = {}
        for slot in unique_ids:
            slots_of.setdefault(table_of(slot), []).append(slot)
        tables = {}
        for table, slots in slots_of.items():
            slot_rows: dict[str, np.ndarray | None]
            if len(slots) == 1:
                ids, slot_rows = unique_ids[slots[0]], {slots[0]: None}
            else:  # the group's distinct ids; each slot's rows are its part of the inverse
                parts = [unique_ids[s] for s in slots]
                ids, inverse = unique_in_order(np.concatenate(parts))
                ends = np.cumsum([p.size for p in parts])
                slot_rows = {s: inverse[end - p.size:end] for s, p, end in zip(slots, parts, ends)}
            tables[table] = TablePlan(ids, _by_replica(ids, num_replicas), slot_rows)
        return cls(tables, num_replicas)

    @classmethod
    def of_tables(cls, table_ids: dict[str, np.ndarray], num_replicas: int) -> RoutingPlan:
        """The plan for tables' distinct ids (table -> ids), each read as one slot."""
        return cls({t: TablePlan(ids, _by_replica(ids, num_replicas), {t: None})
                    for t, ids in table_ids.items()}, num_replicas)

    @property
    def nbytes(self) -> int:
        """Bytes the plan holds beyond the slots' distinct ids."""
        return sum(t.nbytes for t in self.tables.values())

    @staticmethod
    def max_nbytes(num_ids: int, grouped: bool) -> int:
        """An upper bound of what a slot of ``num_ids`` ids adds to a plan's ``nbytes``:
        an int64 position per id and, in a group, its table's id and row position."""
        return 8 * num_ids * (3 if grouped else 1)

    def lookup_requests(self) -> list[list[tuple[str, np.ndarray]]]:
        """Per replica, ``(table, ids)`` for every table, in the plan's table order."""
        return [[(table, t.ids[t.by_replica[r]]) for table, t in self.tables.items()]
                for r in range(self.num_replicas)]

    def table_rows(self, answers: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        """Each table's rows ``[n, dim]`` in the order of its ids, from the replicas'
        answers to :meth:`lookup_requests` (one array per table, in the same order)."""
        if self.num_replicas == 1:
            return dict(zip(self.tables, answers[0]))
        out = {}
        for pos, (table, t) in enumerate(self.tables.items()):
            first = answers[0][pos]
            rows = np.empty((t.ids.size, first.shape[1]), dtype=first.dtype)
            for r, positions in enumerate(t.by_replica):
                rows[positions] = answers[r][pos]
            out[table] = rows
        return out

    def slot_rows(self, table: str, slot: str, rows: np.ndarray) -> np.ndarray:
        """The rows of ``slot``'s distinct ids, from its table's ``rows``."""
        index = self.tables[table].slot_rows[slot]
        return rows if index is None else np.take(rows, index, axis=0)

    def update_requests(self, grads: dict[str, np.ndarray]
                        ) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
        """Per replica, ``(table, ids, gradients)`` from each slot's gradients of its
        distinct ids; a slot absent from ``grads`` (skipped) sends nothing, and an id only
        such slots read is not sent. The slots of a group are summed per id (float32)."""
        out: list[list[tuple[str, np.ndarray, np.ndarray]]] = [[] for _ in range(self.num_replicas)]
        for table, t in self.tables.items():
            present = [s for s in t.slot_rows if s in grads]
            if not present:
                continue
            by_replica = t.by_replica
            if len(t.slot_rows) == 1:
                g = grads[present[0]]
            else:
                g = np.zeros((t.ids.size, grads[present[0]].shape[1]), dtype=np.float32)
                for s in present:  # a slot's distinct ids are distinct rows: no add.at needed
                    g[t.slot_rows[s]] += grads[s]
                if len(present) < len(t.slot_rows):
                    touched = np.zeros(t.ids.size, dtype=bool)
                    for s in present:
                        touched[t.slot_rows[s]] = True
                    by_replica = [_where(p, touched, t.ids.size) for p in by_replica]
            for r, positions in enumerate(by_replica):
                ids = t.ids[positions]
                if ids.size:
                    rows = g if isinstance(positions, slice) else np.take(g, positions, axis=0)
                    out[r].append((table, ids, rows))
        return out


def _by_replica(ids: np.ndarray, num_replicas: int) -> list[Positions]:
    """Positions of the ids each replica owns; with one replica, a slice (views, no copies)."""
    if num_replicas == 1:
        return [slice(None)]
    order, bounds = split_by(replica_of(ids, num_replicas), num_replicas)
    return [order[bounds[r]:bounds[r + 1]] for r in range(num_replicas)]


def _where(positions: Positions, keep: np.ndarray, size: int) -> np.ndarray:
    """The positions among ``positions`` where ``keep`` is set, in their order."""
    positions = np.arange(size) if isinstance(positions, slice) else positions
    return positions[keep[positions]]
