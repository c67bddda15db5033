"""A request over many tables in one kernel call (servers/request_tables.py) changes and
answers exactly what the same request served table by table does."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from persia_py.config.optimizer import AdagradConfig, AdamConfig, SGDConfig
from persia_py.servers import request_tables, row_hints
from persia_py.servers.request_kernels import TABLES_PER_CALL, find_gather_tables, step_tables
from persia_py.servers.row_hints import RowHints
from persia_py.servers.storage import EmbeddingTable

# Every kind of table: row types, optimizers, admission, capacity (eviction), expiry;
# the last two are served table by table (several internal shards; named twice below).
TABLES: list[dict[str, Any]] = [
    dict(optimizer=AdagradConfig(lr=0.1)),
    dict(optimizer=SGDConfig(lr=0.5, weight_decay=0.01), row_dtype="float16"),
    dict(optimizer=AdamConfig(lr=0.01), row_dtype="bfloat16", weight_bound=0.02),
    dict(optimizer=AdagradConfig(lr=0.1, vectorwise_shared=True), row_dtype="float16",
         stochastic_rounding=False),
    dict(optimizer=AdagradConfig(lr=0.1), capacity=150, admit_probability=0.7),
    dict(optimizer=SGDConfig(lr=0.1), min_occurrences=2, expire_after_steps=3, dim=3),
    dict(optimizer=AdagradConfig(lr=0.1), num_shards=2),
    dict(optimizer=AdamConfig(lr=0.01)),
]
TWICE = len(TABLES) - 1
"""The table a request names twice."""


def _tables() -> list[EmbeddingTable]:
    tables = [EmbeddingTable(**{"dim": 8, "seed": 3, "capacity": 10_000, **kwargs})
              for kwargs in TABLES]
    for table in tables:
        table.track_changes()
    return tables


def _request(rng: np.random.Generator, step: int) -> list[np.ndarray]:
    # Distinct ids per entry (as embedding workers send), some read-only (wire buffers).
    ids = [np.unique(rng.integers(1, 400, 60).astype(np.uint64)) for _ in range(len(TABLES) + 1)]
    ids[1] = np.frombuffer(ids[1].tobytes(), np.uint64)
    return ids if step % 3 else [np.zeros(0, np.uint64), *ids[1:]]


def _export(table: EmbeddingTable) -> list[np.ndarray]:
    rows = table.export_rows()
    order = np.argsort(np.asarray(rows["ids"]))
    return [np.asarray(rows[key])[order] for key in ("ids", "weights", "state", "last_access")]


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_a_request_over_tables_is_the_same_as_table_by_table(wire: str) -> None:
    fused, alone = _tables(), _tables()
    named = [*range(len(TABLES)), TWICE]
    rng = np.random.default_rng(5)
    for step in range(12):
        ids = _request(rng, step)
        dtypes = [np.dtype(wire if t.row_type.answers_float16 else np.float32)
                  for t in (fused[k] for k in named)]
        groups, by_table = request_tables._groups(
            [fused[k] for k in named], [(i, np.zeros((0, 1), d)) for i, d in zip(ids, dtypes)])
        assert sum(len(members) for members in groups) == len(TABLES) - 2  # served together
        assert sorted(by_table) == [len(TABLES) - 2, len(TABLES) - 1, len(TABLES)]
        got = request_tables.lookup_tables([fused[k] for k in named], ids, True,
                                           [None] * len(named), dtypes)
        want = [alone[k].lookup(i, True, dtype=d) for k, i, d in zip(named, ids, dtypes)]
        for k, g, w in zip(named, got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"table {k}, step {step}")
        # Gradients with a repeated id in some entries (summed first), float16 in others.
        grads = []
        for j, (k, entry) in enumerate(zip(named, ids)):
            if j % 2 and entry.shape[0]:
                ids[j] = entry = np.concatenate([entry, entry[:3]])
            g = rng.normal(0, 1, (entry.shape[0], fused[k].dim))
            grads.append(g.astype(np.float16 if j % 3 == 1 else np.float32))
        checked = [fused[k].check_update(i, g) for k, i, g in zip(named, ids, grads)]
        num = request_tables.update_tables([fused[k] for k in named], checked)
        assert num == sum(alone[k].update(i, g) for k, i, g in zip(named, ids, grads))
    for k, (f, a) in enumerate(zip(fused, alone)):
        assert f.stats() == a.stats(), f"table {k}"
        for x, y in zip(_export(f), _export(a)):
            np.testing.assert_array_equal(x, y, err_msg=f"table {k}")
        (f_rows, f_gone), (a_rows, a_gone) = f.export_changed_rows(), a.export_changed_rows()
        np.testing.assert_array_equal(np.sort(np.asarray(f_rows["ids"])),
                                      np.sort(np.asarray(a_rows["ids"])))
        np.testing.assert_array_equal(np.sort(f_gone), np.sort(a_gone))


def test_read_only_and_writable_arrays_share_one_compiled_kernel() -> None:
    # A wire's arrays are read-only, a caller's writable: the kernels get both read-only,
    # so numba compiles each once per element types, not once more per flag.
    tables = [EmbeddingTable(dim=4, optimizer=SGDConfig(lr=1.0), seed=k) for k in range(2)]
    for writable in (True, False):
        ids = [np.arange(1, 9, dtype=np.uint64) for _ in tables]
        grads = [np.ones((8, 4), np.float32) for _ in tables]
        for array in (*ids, *grads):
            array.flags.writeable = writable
        request_tables.lookup_tables(tables, ids, True, [None, None], [np.float32] * 2)
        assert request_tables.update_tables(
            tables, [t.check_update(i, g) for t, i, g in zip(tables, ids, grads)]) == 16
    for kernel, names in ((find_gather_tables, ("ids",)), (step_tables, ("ids", "grads"))):
        params = list(inspect.signature(kernel.py_func).parameters)
        assert kernel.signatures
        for signature in kernel.signatures:
            for name in names:
                assert not signature[params.index(name)].dtype.mutable, (kernel, name)


def test_more_tables_than_one_call_takes_are_served_in_several() -> None:
    count = TABLES_PER_CALL + 3
    fused = [EmbeddingTable(dim=4, optimizer=SGDConfig(lr=1.0), seed=k) for k in range(count)]
    alone = [EmbeddingTable(dim=4, optimizer=SGDConfig(lr=1.0), seed=k) for k in range(count)]
    ids = [np.arange(1, 20 + k, dtype=np.uint64) for k in range(count)]
    groups, by_table = request_tables._groups(fused, [(i, i) for i in ids])
    assert [len(members) for members in groups] == [TABLES_PER_CALL, 3] and not by_table
    got = request_tables.lookup_tables(fused, ids, True, [None] * count, [np.float32] * count)
    for table, i, g in zip(alone, ids, got):
        np.testing.assert_array_equal(g, table.lookup(i, True))
    grads = [np.ones((i.shape[0], 4), np.float32) for i in ids]
    checked = [t.check_update(i, g) for t, i, g in zip(fused, ids, grads)]
    assert request_tables.update_tables(fused, checked) == sum(i.shape[0] for i in ids)
    for f, a, i, g in zip(fused, alone, ids, grads):
        a.update(i, g)
        np.testing.assert_array_equal(f.lookup(i, False), a.lookup(i, False))


def _hinted_and_probing(capacity: int) -> tuple[list[EmbeddingTable], list[EmbeddingTable]]:
    """Twin tables; the second set's updates never get a lookup's rows (they probe)."""
    make = [dict(optimizer=AdagradConfig(lr=0.1)),
            dict(optimizer=SGDConfig(lr=0.5), row_dtype="float16", capacity=capacity)]
    hinted, probing = ([EmbeddingTable(dim=4, seed=2, **kwargs) for kwargs in make]
                       for _ in range(2))
    for table in probing:
        table.single_shard().hints.take = lambda ids: None  # type: ignore[method-assign]
    return hinted, probing


def test_updates_start_from_their_lookups_rows_and_check_each() -> None:
    # Three batches in flight (as with embedding staleness): later lookups insert and,
    # in the small table, evict and move rows of earlier batches before their updates.
    hinted, probing = _hinted_and_probing(capacity=120)
    rng = np.random.default_rng(9)
    in_flight: list[list[np.ndarray]] = []
    updated = 0  # ids of the big table updated
    for step in range(30):
        ids = [np.unique(rng.integers(1, 300, 50).astype(np.uint64)) for _ in hinted]
        for group in (hinted, probing):
            request_tables.lookup_tables(group, ids, True, [None, None],
                                         [np.float32, np.float32])
        in_flight.append(ids)
        if len(in_flight) < 3:
            continue
        done = in_flight.pop(0)
        updated += done[0].shape[0]
        grads = [rng.normal(0, 1, (i.shape[0], 4)).astype(np.float32) for i in done]
        counts = [request_tables.update_tables(group, [t.check_update(i, g) for t, i, g
                                                       in zip(group, done, grads)])
                  for group in (hinted, probing)]
        assert counts[0] == counts[1], f"step {step}"
    for k, (h, p) in enumerate(zip(hinted, probing)):
        for x, y in zip(_export(h), _export(p)):
            np.testing.assert_array_equal(x, y, err_msg=f"table {k}")
    held = [t.single_shard().hints.held for t in hinted]
    assert held[0] == updated  # the big table's rows never move: every hint held
    assert 0 < held[1] < updated, held  # the small one's moved rows were probed
    assert all(t.single_shard().hints.held == 0 for t in probing)


def test_wrong_hints_change_nothing() -> None:
    # Another batch's rows filed under the same fingerprint, rows past the end, none.
    hinted, probing = _hinted_and_probing(capacity=10_000)
    ids = [np.arange(1, 200, dtype=np.uint64) * 7 for _ in hinted]
    for group in (hinted, probing):
        request_tables.lookup_tables(group, ids, True, [None, None], [np.float32] * 2)
    for table, wrong in zip(hinted, (np.arange(198, -1, -1), np.full(199, 10**6))):
        table.single_shard().hints.take(ids[0])
        table.single_shard().hints.remember(ids[0], wrong.astype(np.int64))
    grads = [np.ones((199, 4), np.float32) for _ in hinted]
    for group in (hinted, probing):
        assert request_tables.update_tables(
            group, [t.check_update(i, g) for t, i, g in zip(group, ids, grads)]) == 2 * 199
    for k, (h, p) in enumerate(zip(hinted, probing)):
        for x, y in zip(_export(h), _export(p)):
            np.testing.assert_array_equal(x, y, err_msg=f"table {k}")
    # The reversed rows held where they met their own id (the middle one) only.
    assert [t.single_shard().hints.held for t in hinted] == [1, 0]


def test_a_shard_keeps_a_bounded_number_of_hints() -> None:
    hints = RowHints()
    batches = [np.arange(k, k + 100, dtype=np.uint64) for k in range(row_hints.MAX_HINTS + 8)]
    for ids in batches:
        hints.remember(ids, np.arange(100, dtype=np.int64))
    assert hints.take(batches[7]) is None  # the oldest went first
    np.testing.assert_array_equal(hints.take(batches[8]), np.arange(100))
    assert hints.take(batches[8]) is None  # taken once
    big = np.arange(1, row_hints.MAX_HINT_ROWS + 2, dtype=np.uint64)
    hints.remember(big, np.zeros(big.shape[0], np.int64))  # more rows than all hints hold
    assert hints.take(big) is None and hints.take(batches[-1]) is not None
    half = np.arange(1, row_hints.MAX_HINT_ROWS // 2 + 1, dtype=np.uint64)
    for shift in range(3):  # rows beyond the bound push out the oldest
        hints.remember(half + np.uint64(shift), np.zeros(half.shape[0], np.int64))
    assert hints.take(half) is None and hints.take(half + np.uint64(2)) is not None
