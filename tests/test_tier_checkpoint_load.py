"""A checkpoint's files loaded into a fresh tiered table (the Load RPC's path,
``EmbeddingTable.load_chunks``): RAM's share in RAM, the rest to the tier, every row as
dumped; a load that RAM and the tier cannot hold together is refused, saying so."""

from __future__ import annotations

import concurrent.futures
import contextlib

import numpy as np
import pytest

from persia_py.config import DiskTierConfig
from persia_py.ops import safe_files
from persia_py.servers.disk_tier import DiskTier
from persia_py.servers.optimizers import AdagradConfig
from persia_py.servers.row_stream import RowChunks, _most_recent
from persia_py.servers.storage import EmbeddingTable
from persia_py.servers.table_files import TableFiles, row_chunks, write_table

DIM = 8


def _table(tmp_path, capacity: int, disk_rows: int) -> EmbeddingTable:
    return EmbeddingTable(dim=DIM, optimizer=AdagradConfig(lr=0.1), capacity=capacity, seed=3,
                          disk_tier=DiskTierConfig(path=str(tmp_path), capacity_rows=disk_rows))


def _rows(table: EmbeddingTable) -> dict[int, tuple[bytes, bytes]]:
    rows = table.export_rows()
    return {int(i): (w.tobytes(), s.tobytes())
            for i, w, s in zip(rows["ids"], rows["weights"], rows["state"])}


def test_a_load_fills_ram_then_the_tier_and_refuses_what_neither_holds(tmp_path) -> None:
    rng = np.random.default_rng(5)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    with _table(tmp_path, capacity=32, disk_rows=500) as table:
        for _ in range(30):
            ids = rng.integers(1, 300, 16).astype(np.uint64)
            table.lookup(ids, True)
            table.update(ids, rng.standard_normal((16, DIM)).astype(np.float32))
        with safe_files.opened_dir(None, str(folder)) as fd:
            description, _ = write_table(fd, "t0", table)
            assert description["num_rows"] > 32 + 8
            for disk_rows in (500, 8):
                with _table(tmp_path, 32, disk_rows) as fresh, contextlib.ExitStack() as files:
                    chunks = row_chunks([TableFiles(fd, description, "t0", None, files)])
                    if disk_rows == 8:
                        with pytest.raises(ValueError, match="disk tier's capacity_rows"):
                            fresh.load_chunks(chunks)
                        continue
                    assert fresh.load_chunks(chunks) == description["num_rows"]
                    assert fresh.num_entries == 32
                    assert fresh.disk_stats()["disk_rows"] == description["num_rows"] - 32
                    assert _rows(fresh) == _rows(table)


def test_a_load_whose_ids_repeat_between_ram_and_the_tier_is_refused(tmp_path) -> None:
    """An id twice in the files, once among the rows kept in RAM and once among those
    sent to disk (each shard's index would hold one copy and its tier the other): the
    load fails naming it, and so does one whose repeat is within the tier's rows."""
    n = 60
    ids = np.arange(1, n + 1, dtype=np.uint64)
    stamps = np.arange(n, dtype=np.int64)  # the highest stamps stay in RAM
    weights = np.ones((n, DIM), np.float32)
    state = np.zeros((n, DIM), np.float32)
    for a, b in ((0, n - 1), (0, 1)):  # disk and RAM; disk and disk
        repeated = ids.copy()
        repeated[a] = repeated[b]
        rows = RowChunks(ids=repeated, last_access=stamps, clock=n,
                         chunks=lambda: iter([(0, weights, state, "float32", True)]))
        with _table(tmp_path, capacity=16, disk_rows=200) as fresh:
            with pytest.raises(ValueError, match=f"not distinct: id {int(repeated[b])} "):
                fresh.load_chunks(rows)


@pytest.mark.parametrize("stamps", [
    [3, 1, 3, 2, 3, 0, 1], [5] * 9, [2**63 - 1, -2**63, 0, 5, 2**63 - 1, -2**63, 7],
    list(np.random.default_rng(2).integers(-2**40, 2**40, 500)),
    list(np.random.default_rng(3).integers(0, 4, 500)),
    list(np.random.default_rng(4).integers(0, 70_000, 3000)),
])
def test_the_rows_kept_in_ram_are_the_most_recent_first_among_ties(stamps) -> None:
    stamps = np.array(stamps, np.int64)
    for k in sorted({0, 1, 2, stamps.size // 3, stamps.size // 2, stamps.size - 1, stamps.size}):
        by_recency = sorted(range(stamps.size), key=lambda i: (-int(stamps[i]), i))
        assert _most_recent(stamps, k).tolist() == sorted(by_recency[:k])


class _Failing(concurrent.futures.Executor):
    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(MemoryError("the index could not grow"))
        return future


def test_appended_rows_indexed_in_a_thread_are_found_and_its_error_raised(tmp_path) -> None:
    rng = np.random.default_rng(6)
    ids = rng.choice(10**9, 3000, replace=False).astype(np.uint64)
    weights = rng.standard_normal((3000, DIM)).astype(np.float32)
    state = rng.random((3000, DIM)).astype(np.float32)
    args = dict(capacity_rows=4000, dim=DIM, weight_dtype=np.float32, state_width=DIM)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as indexer:
        tier = DiskTier(str(tmp_path), **args)
        for a in range(0, 3000, 700):
            tier.append(ids[a:a + 700], weights[a:a + 700], state[a:a + 700], indexer=indexer)
        tier.flush()
        found, got_w, got_s = tier.peek(ids[::-1])
        assert found.all()
        assert np.array_equal(got_w, weights[::-1]) and np.array_equal(got_s, state[::-1])
        tier.close()
    tier = DiskTier(str(tmp_path), **args)
    tier.append(ids, weights, state, indexer=_Failing())
    with pytest.raises(MemoryError, match="could not grow"):
        tier.flush()
    tier.close()
