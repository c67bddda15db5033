"""What a row costs besides its weights: the id, a 4-byte access stamp and the index."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.servers import sizing
from persia_py.servers.access_clock import AccessClock
from persia_py.servers.hash_index import HashIndex, index_bytes, slot_dtype, slots_for
from persia_py.servers.optimizers import SGDConfig
from persia_py.servers.storage import EmbeddingTable


def _table(**kwargs) -> EmbeddingTable:
    kwargs.setdefault("dim", 4)
    kwargs.setdefault("optimizer", SGDConfig(lr=0.1))
    return EmbeddingTable(**kwargs)


def _bookkeeping_bytes(shard) -> int:
    return shard.size * (shard.ids.itemsize + shard.last_access.itemsize) + shard.index.nbytes


def test_bookkeeping_is_at_most_24_bytes_a_row_on_average_over_growth() -> None:
    per_row = []
    with _table(capacity=1 << 20) as table:
        shard = table._shards[0]
        for first in range(0, 400_000, 10_000):
            ids = np.arange(first + 1, first + 10_001, dtype=np.uint64)
            table.lookup(ids, insert=True)
            per_row.append(_bookkeeping_bytes(shard) / shard.size)
    # 8 (id) + 4 (stamp) + 4-byte slots at 3/10..3/5 load: 18.7 to 25.3 bytes.
    assert float(np.mean(per_row)) <= 24.0, per_row
    assert max(per_row) <= 8 + 4 + 4 * 10 / 3 + 0.01, per_row
    # sizing plans with the very slot count the index reaches.
    assert shard.index.nbytes == index_bytes(shard.size)


def test_slot_type_widens_only_where_row_numbers_leave_too_few_tag_bits() -> None:
    assert slot_dtype(slots_for(100_000_000)) == np.uint32
    assert slot_dtype(1 << 29) == np.uint64
    assert slot_dtype(1 << 10, row_limit=1 << 29) == np.uint64
    assert index_bytes(1000) == slots_for(1000) * 4


def test_index_widens_its_row_numbers_when_given_far_rows() -> None:
    index = HashIndex(initial_slots=16)
    ids = np.arange(1, 101, dtype=np.uint64)
    index.find_or_insert(ids[:50], next_row=0)
    # Rows past what the slot count's bits hold re-encode the slots, keeping every entry.
    rows, is_new = index.find_or_insert(ids[50:], next_row=70_000)
    assert is_new.all() and rows.tolist() == list(range(70_000, 70_050))
    np.testing.assert_array_equal(index.find(ids[:50]), np.arange(50))
    np.testing.assert_array_equal(index.find(ids[50:]), np.arange(70_000, 70_050))
    index.rebuild(ids[::-1].copy(), np.arange(100) * 3)
    np.testing.assert_array_equal(index.find(ids[::-1].copy()), np.arange(100) * 3)


def test_index_reads_ids_from_the_table_array_it_is_given() -> None:
    row_ids = np.zeros(64, np.uint64)
    index = HashIndex(row_ids=row_ids)
    ids = np.array([7, 9, 11], np.uint64)
    index.find_or_insert(ids, next_row=5)
    assert row_ids[5:8].tolist() == [7, 9, 11]
    with pytest.raises(ValueError, match="row_ids"):
        index.find_or_insert(np.array([13], np.uint64), next_row=64)


def test_access_clock_rebases_without_losing_order() -> None:
    clock = AccessClock()
    stamps = np.zeros(4, np.uint32)
    for row, tick in enumerate((5, 2**31 + 200, 2**32 - 2, 2**32 - 1)):
        stamps[row] = clock.stamp(tick, stamps[:row])
    assert clock.base == 0
    now = clock.stamp(2**32 + 100, stamps)  # past the limit: base moves on
    assert clock.base == 2**32 + 100 - 2**31
    # The oldest row is clamped to the base (at least 2**31 ticks old); the others keep
    # their exact ages, and the order LRU needs holds.
    np.testing.assert_array_equal(clock.absolute(stamps)[1:], [2**31 + 200, 2**32 - 2, 2**32 - 1])
    assert int(clock.absolute(stamps)[0]) == clock.base
    assert np.all(np.diff(stamps.astype(np.int64)) >= 0) and now > int(stamps.max())
    assert clock.cutoff(clock.base - 10) == 0
    assert clock.cutoff(2**32 + 101) == now + 1


def test_checkpoint_stamps_past_32_bits_round_trip_and_steer_eviction() -> None:
    clock = 2**40
    ids = np.arange(1, 9, dtype=np.uint64)
    stamps = clock - np.arange(8, dtype=np.int64)[::-1] * 1000  # ids[0] is the oldest
    with _table(capacity=8) as table:
        table.import_rows(ids, np.zeros((8, 4), np.float32), np.zeros((8, 0), np.float32),
                          stamps, clock)
        rows = table.export_rows()
        order = np.argsort(rows["ids"])
        np.testing.assert_array_equal(rows["last_access"][order], stamps)
        assert rows["clock"] == clock
        table.lookup(np.array([100], np.uint64), insert=True)  # full: evicts the LRU rows
        kept = set(table.export_rows()["ids"].tolist())
        assert 100 in kept and 1 not in kept and 8 in kept
        assert int(table.export_rows()["last_access"].max()) == clock + 1


def test_sizing_row_bytes_counts_the_new_bookkeeping() -> None:
    assert sizing.ID_AND_STAMP_BYTES == 12
    assert sizing.row_bytes(16, 16) == 4 * 32 + 12 + sizing.INDEX_BYTES_PER_ROW
