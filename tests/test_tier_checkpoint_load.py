"""A checkpoint's files loaded into a fresh tiered table (the Load RPC's path,
``EmbeddingTable.load_chunks``): RAM's share in RAM, the rest to the tier, every row as
dumped; a load that RAM and the tier cannot hold together is refused, saying so."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from persia_py.config import DiskTierConfig
from persia_py.ops import safe_files
from persia_py.servers.optimizers import AdagradConfig
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
