"""The disk tier's record packing (servers/tier_records.py): byte for byte the blocks that
numpy's structured records give, for any record shape, offset in a block and count; a
tier written in several staging pieces reads every row back; a scan's live records
compacted in place are those numpy reads, and a write during a scan stops it."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.servers.disk_tier import EMPTY, DiskTier, record_layout
from persia_py.servers.tier_records import byte_columns, compact_live, pack_blocks


def _reference(record: np.dtype, block: int, rpb: int, head: np.ndarray, skip: int,
               ids: np.ndarray, weights: np.ndarray, state: np.ndarray) -> np.ndarray:
    """The blocks as the tier built them with numpy before the kernel."""
    k = ids.shape[0]
    blocks = -(-(skip + k) // rpb)
    records = np.zeros(blocks * rpb, record)
    records["id"] = EMPTY
    records[:skip] = head[:skip * record.itemsize].view(record)
    records["id"][skip:skip + k] = ids
    records["weights"][skip:skip + k] = weights
    if state.shape[1]:
        records["state"][skip:skip + k] = state
    out = np.zeros((blocks, block), np.uint8)
    out[:, :rpb * record.itemsize] = records.view(np.uint8).reshape(blocks, -1)
    return out


@pytest.mark.parametrize(("dim", "dtype", "width"), [(64, np.float16, 1), (3, np.float16, 0),
                                                     (5, np.float32, 2), (200, np.float32, 4)])
def test_packed_blocks_match_numpy_records(dim: int, dtype: type, width: int) -> None:
    record, block, rpb = record_layout(dim, np.dtype(dtype), width)
    rng = np.random.default_rng(dim)
    head = rng.integers(0, 256, block, np.uint8)  # earlier records of the head's block
    for skip in sorted({0, 1, rpb - 1}):
        for k in (1, rpb, 3 * rpb + 1, 50):
            ids = rng.integers(1, 2**62, k).astype(np.uint64)
            weights = rng.standard_normal((k, dim)).astype(dtype)
            state = rng.random((k, width), dtype=np.float32)
            blocks = -(-(skip + k) // rpb)
            out = np.full((blocks, block), 0xAB, np.uint8)  # garbage: all of it is written
            pack_blocks(out, head, skip, byte_columns(ids, weights, state), rpb)
            expect = _reference(record, block, rpb, head, skip, ids, weights, state)
            assert np.array_equal(out, expect), (skip, k)
            # Whole records as one column (compaction) give the same bytes.
            records = np.ascontiguousarray(
                expect[:, :rpb * record.itemsize]).view(record).reshape(-1)[skip:skip + k]
            again = np.full_like(out, 0xCD)
            pack_blocks(again, head, skip, byte_columns(records), rpb)
            assert np.array_equal(again, expect)


def test_bad_columns_are_refused() -> None:
    out = np.zeros((1, 512), np.uint8)
    head = np.zeros(512, np.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        pack_blocks(out, head, 0, byte_columns(np.zeros((4, 140), np.uint8)), 3)
    with pytest.raises(ValueError, match="same rows"):
        pack_blocks(out, head, 0, (np.zeros((1, 8), np.uint8), np.zeros((2, 4), np.uint8)), 3)


def test_a_write_larger_than_the_staging_piece_reads_back(tmp_path) -> None:
    # 140-byte records, 3 a block: 8 MiB pieces of 49,152 rows; the head starts mid-block.
    rng = np.random.default_rng(0)
    n = 120_001
    tier = DiskTier(str(tmp_path), capacity_rows=n, dim=64, weight_dtype=np.float16,
                    state_width=1)
    try:
        ids = rng.choice(2**40, n, replace=False).astype(np.uint64) + np.uint64(1)
        weights = rng.standard_normal((n, 64)).astype(np.float16)
        state = rng.random((n, 1), dtype=np.float32)
        tier.append(ids[:1], weights[:1], state[:1])
        tier.append(ids[1:], weights[1:], state[1:])
        got_ids, got_w, got_s = tier.scan()
        assert np.array_equal(got_ids, ids)
        assert np.array_equal(got_w.view(np.uint16), weights.view(np.uint16))
        assert np.array_equal(got_s, state)
        asked = ids[rng.choice(n, 2_000, replace=False)]
        found, w, _ = tier.take(asked)
        assert found.all() and tier.num_rows == n - 2_000
        order = {int(i): p for p, i in enumerate(ids.tolist())}
        rows = np.array([order[int(i)] for i in asked.tolist()])
        assert np.array_equal(w.view(np.uint16), weights[rows].view(np.uint16))
    finally:
        tier.close()


@pytest.mark.parametrize(("dim", "dtype", "width"), [(64, np.float16, 1), (5, np.float32, 2),
                                                     (120, np.float32, 0)])
def test_live_records_are_compacted_in_place(dim: int, dtype: type, width: int) -> None:
    # A scan's blocks: the live slots' records, in slot order, moved to the buffer's
    # start over the records they pass; compared with the records read by numpy first.
    record, block, rpb = record_layout(dim, np.dtype(dtype), width)
    rng = np.random.default_rng(dim)
    for live_share in (0.0, 0.3, 1.0):
        n = 37
        data = rng.integers(0, 256, (n, block), np.uint8)
        slot_fp = (rng.random(n * rpb) < live_share).astype(np.uint32) * np.uint32(7)
        records = data[:, :rpb * record.itemsize].copy().view(record).reshape(-1)
        want_slots = np.flatnonzero(slot_fp) + 1000
        want = records[slot_fp != 0].view(np.uint8).copy()
        slots = np.full(n * rpb, -1, np.int64)
        got, got_slots = compact_live(data, slot_fp, 1000, rpb, record, slots)
        assert got.dtype == record and got.shape == (want_slots.shape[0],)
        assert np.array_equal(got.view(np.uint8), want)
        assert np.array_equal(got_slots, want_slots)
    with pytest.raises(ValueError, match="must hold"):
        compact_live(np.zeros((2, block), np.uint8), np.zeros(rpb, np.uint32), 0, rpb,
                     record, np.zeros(2 * rpb, np.int64))


def test_a_write_during_a_scan_is_refused(tmp_path) -> None:
    # A scan hands out views of the staging buffers: a write taking one before the next
    # chunk would change rows already handed out, so the scan stops with an error.
    rng = np.random.default_rng(1)
    n = 60_000  # two 8 MiB ranges of 140-byte records
    tier = DiskTier(str(tmp_path), capacity_rows=n + 10, dim=64, weight_dtype=np.float16,
                    state_width=1)
    try:
        ids = rng.choice(2**40, n + 1, replace=False).astype(np.uint64) + np.uint64(1)
        weights = rng.standard_normal((n + 1, 64)).astype(np.float16)
        state = rng.random((n + 1, 1), dtype=np.float32)
        tier.append(ids[:n], weights[:n], state[:n])
        chunks = tier.scan_chunks()
        first = next(chunks)[0]
        assert np.array_equal(first, ids[:first.shape[0]]) and first.shape[0] < n
        tier.write(ids[n:], weights[n:], state[n:], fresh=True)
        with pytest.raises(RuntimeError, match="during a scan"):
            next(chunks)
    finally:
        tier.close()
