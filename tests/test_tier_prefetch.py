"""A prefetch reads the disk tier without the shard's lock (issue 42): updates go on while
it waits on the disk, lookups wait for it instead of reading its rows again, and what
moved meanwhile is never taken twice, lost or taken stale: the table ends bit-identical
to one that never prefetched."""

from __future__ import annotations

import threading

import numpy as np

from persia_py.config import DiskTierConfig
from persia_py.servers.disk_tier import DiskTier
from persia_py.servers.optimizers import AdagradConfig
from persia_py.servers.storage import EmbeddingTable

DIM = 4


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.random((n, DIM), dtype=np.float32)
    return w, w[:, :1].copy()


def test_a_read_made_without_the_lock_takes_only_rows_still_where_it_read_them(tmp_path
                                                                               ) -> None:
    rng = np.random.default_rng(1)
    # No free reserve: every write that needs room compacts a segment of live rows.
    tier = DiskTier(str(tmp_path), capacity_rows=3_000, dim=DIM, weight_dtype=np.float32,
                    state_width=1, free_fraction=0.0)
    try:
        ids = np.arange(1, 3_001, dtype=np.uint64)
        w, s = _rows(rng, 3_000)
        tier.write(ids, w, s)
        asked = ids[::2].copy()
        read = tier.plan_read(asked)
        records = tier.read_planned(read)  # as a prefetch does, the lock released
        # Meanwhile: rows go back to RAM and are deleted all over the log, and a write
        # that needs room compacts some segments (their live rows move within them).
        taken, deleted = asked[::10], asked[3::15]
        assert tier.take(taken)[0].all()
        assert tier.delete(deleted) == deleted.shape[0]
        epochs = tier.segment_epoch.copy()
        tier.write(np.arange(10_001, 10_101, dtype=np.uint64), *_rows(rng, 100))
        reopened = tier.segment_epoch != epochs
        assert reopened.any() and not reopened.all()
        found, got_w, got_s = tier.take_read(read, records)
        got = asked[found]
        # Only rows whose segment stayed closed since the read, and none moved or gone.
        assert found.any() and not np.isin(got, np.concatenate([taken, deleted])).any()
        np.testing.assert_array_equal(got_w, w[got - 1])
        np.testing.assert_array_equal(got_s, s[got - 1])
        assert not tier.holds(got).any()
        # Every other row asked is where it was left: still on disk, intact.
        left = np.setdiff1d(asked, np.concatenate([got, taken, deleted]))
        assert left.shape[0] > 0
        present, left_w, _ = tier.peek(left)
        assert present.all()
        np.testing.assert_array_equal(left_w, w[left - 1])
        assert tier.num_rows == 3_000 - 150 - 100 + 100 - got.shape[0]
    finally:
        tier.close()


def _tiered(tmp_path, name: str) -> EmbeddingTable:
    return EmbeddingTable(dim=DIM, optimizer=AdagradConfig(lr=0.1), capacity=400, seed=3,
                          num_shards=1,
                          disk_tier=DiskTierConfig(path=str(tmp_path / name),
                                                   capacity_rows=10_000))


def test_updates_go_on_while_a_prefetch_waits_on_the_disk_and_lookups_wait_for_it(
        tmp_path, monkeypatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hinted, plain = _tiered(tmp_path, "a"), _tiered(tmp_path, "b")
    rng = np.random.default_rng(2)
    try:
        batches = [rng.integers(1, 2_000, 300).astype(np.uint64) for _ in range(8)]
        grads = [rng.standard_normal((300, DIM)).astype(np.float32) for _ in range(8)]
        for table in (hinted, plain):
            for ids, g in zip(batches[:4], grads[:4]):
                table.lookup(ids, True)
                table.update(ids, g)
        shard = hinted._shards[0]
        reading, go = threading.Event(), threading.Event()
        read_planned = shard.tier.read_planned

        def held_read(read):  # the disk's wait, held open until the main thread is done
            reading.set()
            assert go.wait(30)
            return read_planned(read)

        monkeypatch.setattr(shard.tier, "read_planned", held_read)
        hint = np.unique(batches[0])
        on_disk = int(shard.tier.holds(hint).sum())
        assert on_disk > 50
        moved: list[int] = []
        prefetch = threading.Thread(target=lambda: moved.append(hinted.prefetch(hint)))
        prefetch.start()
        assert reading.wait(60)
        # The shard's lock is free: the last batch's update runs (its rows are in RAM,
        # spilled rows it met would come back from disk)...
        for table in (hinted, plain):
            table.update(batches[3], grads[4])
        # ... and a lookup of the hinted ids waits for the prefetch rather than reading
        # its rows from disk a second time.
        answered_from_disk = shard.disk_answered
        looked_up: list[np.ndarray] = []
        lookup = threading.Thread(target=lambda: looked_up.append(hinted.lookup(hint, True)))
        lookup.start()
        go.set()
        prefetch.join(60)
        lookup.join(60)
        assert not prefetch.is_alive() and not lookup.is_alive()
        assert moved == [on_disk] and shard.disk_answered == answered_from_disk
        np.testing.assert_array_equal(looked_up[0], plain.lookup(hint, True))
        for table in (hinted, plain):
            for ids, g in zip(batches[4:], grads[4:]):
                table.lookup(ids, True)
                table.update(ids, g)
        for first in range(1, 2_000, 100):  # a lookup's rows must fit in RAM
            ids = np.arange(first, first + 100, dtype=np.uint64)
            np.testing.assert_array_equal(hinted.lookup(ids, False), plain.lookup(ids, False))
        assert hinted.num_entries + shard.tier.num_rows == plain.num_entries + sum(
            s.tier.num_rows for s in plain._shards)
    finally:
        hinted.close()
        plain.close()


def test_a_table_closed_while_a_prefetch_reads_keeps_nothing_and_raises_nothing(tmp_path,
                                                                                monkeypatch
                                                                                ) -> None:
    (tmp_path / "a").mkdir()
    table = _tiered(tmp_path, "a")
    try:
        ids = np.arange(1, 1_001, dtype=np.uint64)
        for first in range(0, 1_000, 200):
            table.lookup(ids[first:first + 200], True)
        shard = table._shards[0]
        assert shard.tier.holds(ids[:200]).all()
        reading, go = threading.Event(), threading.Event()
        read_planned = shard.tier.read_planned

        def held_read(read):
            reading.set()
            assert go.wait(30)
            return read_planned(read)

        monkeypatch.setattr(shard.tier, "read_planned", held_read)
        moved: list[int] = []
        prefetch = threading.Thread(target=lambda: moved.append(table.prefetch(ids[:200])))
        prefetch.start()
        assert reading.wait(60)
        table.close()  # a Load swapping tables closes the old ones so
        go.set()
        prefetch.join(60)
        assert moved == [0]
    finally:
        table.close()
