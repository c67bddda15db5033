"""What a row costs besides its weights: the id, a 2-byte access stamp and the index."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.servers import sizing
from persia_py.servers.access_clock import STAMP_DTYPE, AccessClock
from persia_py.servers.hash_index import HashIndex, index_bytes, slot_dtype, slots_for
from persia_py.servers.initializer import initial_rows
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
    # 8 (id) + 2 (stamp) + 4-byte slots at 0.48..3/5 load: 16.7 to 18.3 bytes (the
    # smallest indexes, of 16 to 56 slots, are emptier).
    assert float(np.mean(per_row)) <= 18.5, per_row
    assert max(per_row) <= 8 + 2 + 4 / 0.48 + 0.01, per_row
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


def _stamp_all(clock: AccessClock, ticks: list[int]) -> np.ndarray:
    """Stamps of rows touched at ``ticks`` (in order), as a shard stamps them."""
    stamps = np.zeros(len(ticks), STAMP_DTYPE)
    for row, tick in enumerate(ticks):
        stamps[row] = clock.stamp(tick, stamps[:row])
    return stamps


def test_access_clock_stays_exact_while_rows_span_fewer_than_2_15_lookups() -> None:
    clock = AccessClock()
    ticks = [2**40 + t for t in (0, 3, 10_000, 30_000)]
    stamps = _stamp_all(clock, ticks)
    assert clock.shift == 0 and clock.base == 2**40  # one rebase, at the first row
    np.testing.assert_array_equal(clock.absolute(stamps), ticks)
    assert clock.stamp(2**40 - 7, stamps) == 0  # a late caller: before the base
    assert clock.cutoff(2**40 - 7) == 0 and clock.cutoff(2**40 + 4) == 4


def test_access_clock_coarsens_instead_of_clamping_and_keeps_the_lru_order() -> None:
    clock = AccessClock()
    ticks = [5, 6, 40_000, 2**20, 2**20 + 1, 2**31 + 200, 2**32 - 2]
    stamps = _stamp_all(clock, ticks)
    assert clock.base == 5 and clock.shift > 0
    # No row is clamped: the order LRU needs holds (ties only within a unit) ...
    assert np.all(np.diff(stamps.astype(np.int64)) >= 0) and stamps[0] < stamps[3]
    # ... and every row reads as touched at the last tick of its unit: never older than
    # it is, younger by less than one unit.
    unit = 1 << clock.shift
    absolute = clock.absolute(stamps)
    assert np.all(absolute >= ticks) and np.all(absolute - ticks < unit)
    # Expiry takes a row only once its whole unit is before the cutoff: never early.
    for cutoff in (6, 7, 40_001, 2**20 + 2, 2**31 + 201, 2**32):
        expired = stamps < clock.cutoff(cutoff)
        assert not np.any(expired & (np.array(ticks) >= cutoff)), cutoff
        assert np.all(expired | (np.array(ticks) >= cutoff - unit)), cutoff
    assert clock.stamp(2**32 - 1, stamps) >= int(stamps.max())


def test_access_clock_refines_its_unit_once_the_oldest_rows_are_gone() -> None:
    clock = AccessClock()
    stamps = _stamp_all(clock, [0, 2**30, 2**30 + 10, 2**30 + 2_000])
    coarse = clock.shift
    assert coarse > 14
    young = stamps[1:].copy()  # the oldest row evicted
    before = clock.absolute(young)
    clock.rebase(clock.latest, young)
    assert clock.shift == coarse - 14  # at most 14 halvings a rebase
    np.testing.assert_array_equal(clock.absolute(young), before)  # same bounds as before
    clock.rebase(clock.latest, young)
    assert clock.shift < coarse - 14
    new = clock.stamp(2**30 + 2_001, young)
    assert clock.absolute(np.array([new], STAMP_DTYPE))[0] <= 2**30 + 2_001


def test_absolute_stamps_round_trip_through_relative_at_any_unit() -> None:
    for ticks in ([7, 8, 9], [1, 2**18, 2**33]):
        clock = AccessClock()
        stamps = _stamp_all(clock, ticks)
        exported = clock.absolute(stamps)
        fresh = AccessClock()
        imported = fresh.relative(exported, int(exported.max()), np.zeros(0, STAMP_DTYPE))
        np.testing.assert_array_equal(fresh.absolute(imported), exported)
        # Into a clock whose rows are newer than the import: the base moves back.
        other = AccessClock()
        held = _stamp_all(other, [2**34])
        imported = other.relative(exported, 2**34, held)
        assert np.all(other.absolute(imported) >= exported)
        assert other.absolute(held)[0] == 2**34 and held[0] >= imported.max()


def test_eviction_spares_exactly_the_batch_rows_when_stamps_are_coarse() -> None:
    with _table(capacity=4) as table:
        shard = table._shards[0]
        table.lookup(np.arange(1, 5, dtype=np.uint64), insert=True)
        shard.clock.shift = 16  # every row and the next batch in one unit
        shard.last_access[:shard.size] = 0
        table.lookup(np.array([2, 100], np.uint64), insert=True)
        kept = set(table.export_rows()["ids"].tolist())
        assert {2, 100} <= kept and len(kept) <= 4


def test_expiry_with_coarse_stamps_is_late_by_under_a_unit_never_early() -> None:
    with _table(capacity=100) as table:
        shard = table._shards[0]
        shard.clock.shift = 2  # units of 4 lookups: ticks 1-3 in unit 0, 4-7 in unit 1
        for tick in range(1, 6):  # id t looked up at tick t
            table.lookup(np.array([tick], np.uint64), insert=True)
        shard.expire(3)  # ids 1 and 2 are due, but unit 0 also holds tick 3: late
        assert table.num_entries == 5
        shard.expire(4)  # unit 0 wholly before the cutoff
        assert sorted(table.export_rows()["ids"].tolist()) == [4, 5]
        assert shard.clock.shift == 0  # the pass refined the unit: ticks 4-5 are exact


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
    assert sizing.ID_AND_STAMP_BYTES == 10
    assert sizing.row_bytes(16, 16) == 4 * 32 + 10 + sizing.INDEX_BYTES_PER_ROW


def test_index_deletes_and_repoints_in_place_leaving_no_tombstones() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = np.unique(rng.integers(0, 2**63, int(rng.integers(10, 20_000)), dtype=np.uint64))
        n = ids.shape[0]
        index = HashIndex()
        index.find_or_insert(ids, 0)
        slots = index.slots
        # A compaction: delete random rows, move the tail's survivors into the holes.
        victims = rng.choice(n, int(rng.integers(1, n)), replace=False)
        keep = np.ones(n, bool)
        keep[victims] = False
        n_keep = int(keep.sum())
        holes = np.sort(victims[victims < n_keep])
        movers = np.flatnonzero(keep[n_keep:]) + n_keep
        assert index.delete(index.row_ids[victims].copy()) == victims.shape[0]
        index.repoint(index.row_ids[movers].copy(), holes)
        index.row_ids[holes] = index.row_ids[movers]
        expect = np.arange(n)
        expect[movers] = holes
        expect[victims] = -1
        np.testing.assert_array_equal(index.find(ids), expect)
        # No tombstone: every occupied slot is a live entry, and the array kept its size.
        assert len(index) == n_keep == int(np.count_nonzero(index._slots))
        assert index.slots == slots and index.delete(ids[victims]) == 0
        rows, is_new = index.find_or_insert(ids[victims], n_keep)
        assert is_new.all() and (index.find(ids) >= 0).all()
    with pytest.raises(ValueError, match="not in the index"):
        index.repoint(np.array([2**63 + 5], np.uint64), np.array([0]))


def test_a_shard_edits_its_index_on_eviction_and_redraws_its_key_once_rows_turned_over() -> None:
    with _table(capacity=1600, num_shards=1, init_lower=-1.0, init_upper=1.0) as table:
        shard = table._shards[0]
        table.lookup(np.arange(1600, dtype=np.uint64), True)
        key, first = shard.index._key, 1600
        evictions = 0
        while shard.index._key is key:
            ids = np.arange(first, first + 50, dtype=np.uint64)  # 100 rows leave per eviction
            first += 50
            np.testing.assert_array_equal(table.lookup(ids, True),
                                          initial_rows(ids, 4, -1.0, 1.0, 0))
            evictions = table.stats()["evicted"] // 100
            assert evictions <= 16, "the key outlived a turnover of the shard's rows"
        # Edited, not rebuilt, until as many rows had left as stayed (1,500).
        assert evictions == 15
        stored = np.flatnonzero(table.lookup(np.arange(first, dtype=np.uint64), False).any(1))
        assert stored.shape[0] == shard.size
        np.testing.assert_array_equal(shard.index.find(stored.astype(np.uint64)) >= 0, True)
        np.testing.assert_array_equal(shard.ids[shard.index.find(stored.astype(np.uint64))],
                                      stored)
