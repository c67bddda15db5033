"""A disk tier's rows read back in log order, chunk by chunk: what a checkpoint's dump of
a table with rows on disk streams to its files (:mod:`persia_py.servers.row_stream`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from persia_py.servers.disk_expiry import DiskStamps
from persia_py.servers.tier_reads import DiskTier as TierFile
from persia_py.servers.tier_records import SEGMENT_BYTES, BlockStager, compact_live


class DiskTier(TierFile, Protocol):
    """What a scan needs of a :class:`persia_py.servers.disk_tier.DiskTier`."""

    stager: BlockStager
    stamps: DiskStamps | None
    state_width: int
    num_read: int

    def flush(self) -> None: ...


def scan_chunks(tier: DiskTier) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray | None]]:
    """Every row stored in ``tier`` as ``(ids, weights, state, last access)`` chunks in log
    order, one per sequential read of up to 8 MiB (checkpoints stream them to their
    files); the first three views into the tier's staging buffers, valid until the next
    chunk is asked for (no write before); last access in absolute ticks (None: no
    stamps)."""
    rpb, nb = tier.rows_per_block, tier.file.num_blocks
    step = max(1, SEGMENT_BYTES // tier.file.block_bytes)  # a write's blocks
    ranges = [(f, min(step, nb - f)) for f in range(0, nb, step)
              if tier.slot_fp[f * rpb:(f + step) * rpb].any()]
    if not ranges:
        return
    # The writes' staging buffers (faulted in already), the next range read meanwhile.
    tier.flush()  # no write of them in flight
    buffers = [tier.stager.blocks(step), tier.stager.blocks(step)]
    handed = tier.stager.num_handed
    slots = np.empty(step * rpb, np.int64)
    ahead = tier.file.read_range_ahead(*ranges[0], buffers[0][:ranges[0][1]])
    for i, (first, n) in enumerate(ranges):
        data = ahead.result()
        if tier.stager.num_handed != handed:  # a write took one: a caller's bug
            raise RuntimeError("disk tier: written to during a scan")
        if i + 1 < len(ranges):
            ahead = tier.file.read_range_ahead(*ranges[i + 1],
                                               buffers[(i + 1) % 2][:ranges[i + 1][1]])
        live, where = compact_live(data, tier.slot_fp[first * rpb:(first + n) * rpb],
                                   first * rpb, rpb, tier.record, slots)
        tier.index.check_slots(where, live["id"])
        tier.num_read += live.shape[0]
        state = (live["state"] if tier.state_width
                 else np.zeros((live.shape[0], 0), np.float32))
        stamps = None if tier.stamps is None else tier.stamps.get(where)
        yield live["id"], live["weights"], state, stamps  # strided views of the records
