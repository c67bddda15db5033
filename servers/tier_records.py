"""Rows packed into a disk tier's blocks, in one pass: the numba kernel behind
:meth:`persia_py.servers.disk_tier.DiskTier._write_at` (spills, compaction, a checkpoint's
load).

A block is ``rows_per_block`` packed records (``id``, the weights' bits, the float32
state: :func:`persia_py.servers.disk_tier.record_layout`) and zeros up to its end; a slot
with no row holds the id ``EMPTY`` and zeros. Built with numpy, a write took four passes
over every row (a structured array filled field by field, its bytes copied into the
aligned buffer, the tail of each block zeroed) and a fresh buffer per write, whose pages the kernel faults
in and zeroes each time (docs/benchmarks.md, "Disk tier"). Here each byte is
written once, into a staging buffer the tier keeps (:class:`BlockStager`), and a
checkpoint's load packs its next rows while the last ones are written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.routing import RESERVED_ID
from persia_py.servers.page_file import SECTOR, aligned_empty

__all__ = ["SEGMENT_BYTES", "BlockStager", "byte_columns", "compact_live", "file_geometry",
           "pack_blocks", "record_layout"]

SEGMENT_BYTES = 8 << 20
"""Bytes of a segment of a tier's file (fewer where the file would have under 64), and
the most bytes of one write."""
_EMPTY_BYTES = np.array([RESERVED_ID], np.uint64).view(np.uint8)
"""The id of a record that holds no row, as its 8 bytes."""


@njit(cache=True, nogil=True, inline="always")
def _copy(out: np.ndarray, at: np.uint64, src: np.ndarray, i: int) -> np.uint64:
    """Row ``i`` of ``src`` to ``out[at:]``; returns the offset past it. Unsigned offsets
    into a flat array: LLVM then vectorizes the loop (7.5 GB/s here, 1.1 with 2-D
    signed indexing)."""
    for x in range(src.shape[1]):
        out[at + np.uint64(x)] = src[i, x]
    return at + np.uint64(src.shape[1])


@njit(cache=True, nogil=True)
def _pack_kernel(out: np.ndarray, block_bytes: int, head: np.ndarray, skip: int,
                 a: np.ndarray, b: np.ndarray, c: np.ndarray, empty: np.ndarray,
                 rpb: int) -> None:
    record = a.shape[1] + b.shape[1] + c.shape[1]
    k = a.shape[0]
    zero = np.uint8(0)
    for blk in range(out.shape[0] // block_bytes):
        base = np.uint64(blk * block_bytes)
        for j in range(rpb):
            slot = blk * rpb + j
            at = base + np.uint64(j * record)
            if slot < skip:  # the records already in the head's block
                for x in range(record):
                    out[at + np.uint64(x)] = head[slot * record + x]
            elif slot < skip + k:
                i = slot - skip
                _copy(out, _copy(out, _copy(out, at, a, i), b, i), c, i)
            else:  # no row
                for x in range(8):
                    out[at + np.uint64(x)] = empty[x]
                for x in range(8, record):
                    out[at + np.uint64(x)] = zero
        for x in range(rpb * record, block_bytes):
            out[base + np.uint64(x)] = zero


@njit(cache=True, nogil=True)
def _compact_kernel(data: np.ndarray, block_bytes: int, rpb: int, record: int,
                    slot_fp: np.ndarray, first_slot: int, slots: np.ndarray) -> int:
    # In place: the k-th live record moves to byte k * record, never past where it was
    # (rpb * record <= block_bytes), so a forward copy never overwrites a record unread.
    k = 0
    for blk in range(data.shape[0] // block_bytes):
        for j in range(rpb):
            s = blk * rpb + j
            if slot_fp[s] == 0:  # FREE
                continue
            src = np.uint64(blk * block_bytes + j * record)
            dst = np.uint64(k * record)
            if dst != src:
                for x in range(record):
                    data[dst + np.uint64(x)] = data[src + np.uint64(x)]
            slots[k] = first_slot + s
            k += 1
    return k


def compact_live(data: np.ndarray, slot_fp: np.ndarray, first_slot: int, rows_per_block: int,
                 record: np.dtype, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The records of the live slots (``slot_fp`` not ``FREE``) of blocks ``data`` (``uint8``
    ``(n, block bytes)``, C-contiguous, whose first slot is ``first_slot``; ``slot_fp``
    their slots'), moved in slot order to the start of ``data`` itself (no scratch
    array: fresh memory is faulted in slower than the disk reads it), their slots to
    ``slots``: returns a ``record`` array viewing ``data``, and a view of ``slots``, both
    ``k`` long."""
    n, block_bytes = data.shape
    record = np.dtype(record)
    if (slot_fp.shape[0] != n * rows_per_block or slots.shape[0] < slot_fp.shape[0]
            or rows_per_block * record.itemsize > block_bytes or not data.flags.c_contiguous):
        raise ValueError(f"{n} contiguous blocks of {rows_per_block} records of "
                         f"{record.itemsize} bytes: slot_fp and slots must hold "
                         f"{n * rows_per_block}")
    flat = data.reshape(-1)
    k = _compact_kernel(flat, block_bytes, rows_per_block, record.itemsize, slot_fp,
                        first_slot, slots)
    return flat[:k * record.itemsize].view(record), slots[:k]


def byte_columns(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each of ``arrays`` (``k`` rows of any shape and dtype) as a C-contiguous ``uint8``
    matrix ``(k, row bytes)``: the columns :func:`pack_blocks` takes."""
    out = []
    for array in arrays:
        array = np.ascontiguousarray(array)
        out.append(array.reshape(array.shape[0], -1).view(np.uint8)
                   .reshape(array.shape[0], -1))
    return tuple(out)


def pack_blocks(out: np.ndarray, head: np.ndarray, skip: int, columns: tuple[np.ndarray, ...],
                rows_per_block: int) -> None:
    """Fill ``out`` (``uint8`` ``(blocks, block bytes)``) with records: the first ``skip``
    slots from ``head`` (the bytes of the first block's earlier records), then one per
    row of ``columns`` (up to three :func:`byte_columns` matrices of the same rows, their
    widths summing to the record's, in its field order), then records of no row to the
    end of the last block; each block's bytes past its records are zeroed."""
    if not 1 <= len(columns) <= 3:
        raise ValueError(f"pack_blocks takes 1 to 3 columns, got {len(columns)}")
    k = columns[0].shape[0]
    if any(c.shape[0] != k or c.dtype != np.uint8 or c.ndim != 2 for c in columns):
        raise ValueError("columns must be uint8 matrices of the same rows")
    record = sum(c.shape[1] for c in columns)
    if out.shape[0] * rows_per_block < skip + k or rows_per_block * record > out.shape[1]:
        raise ValueError(f"{skip} + {k} records of {record} bytes do not fit "
                         f"{out.shape[0]} blocks of {out.shape[1]} bytes")
    if head.shape[0] < skip * record:
        raise ValueError(f"head holds {head.shape[0]} bytes, under {skip} records")
    empty = np.zeros((k, 0), np.uint8)
    a, b, c = (*columns, empty, empty)[:3]
    _pack_kernel(out.reshape(-1), out.shape[1], head, skip, a, b, c, _EMPTY_BYTES,
                 rows_per_block)


def record_layout(dim: int, weight_dtype: np.dtype, state_width: int
                  ) -> tuple[np.dtype, int, int]:
    """``(record dtype, block bytes, records per block)`` of rows of this shape."""
    weight_dtype = np.dtype(weight_dtype)
    fields: list[tuple] = [("id", np.uint64), ("weights", weight_dtype, (dim,))]
    if state_width:
        fields.append(("state", np.float32, (state_width,)))
    record = np.dtype(fields)  # packed: no padding between fields
    block = -(-record.itemsize // SECTOR) * SECTOR
    return record, block, block // record.itemsize


def file_geometry(capacity_rows: int, block_bytes: int, rows_per_block: int,
                  free_fraction: float) -> tuple[int, int]:
    """``(segments, blocks per segment)`` of the file of a tier of ``capacity_rows`` (its
    slots: ``segments x blocks per segment x rows_per_block``; its bytes: ``segments x
    blocks per segment x block_bytes``, what :mod:`persia_py.servers.sizing` plans)."""
    slots = int(np.ceil(capacity_rows / (1.0 - free_fraction)))
    blocks = -(-slots // rows_per_block)
    # At least 64 segments where the file has that many blocks: a write never waits on
    # compacting more than 1/64 of the file; rounding up to whole segments adds under one
    # block per segment.
    most = max(1, min(SEGMENT_BYTES // block_bytes, blocks // 64))
    num_segments = -(-blocks // most)
    return num_segments, -(-blocks // num_segments)


class BlockStager:
    """Two aligned staging buffers of whole blocks, kept and reused (each write would
    otherwise fault in fresh memory), handed out in turn: the one a write in the
    background still reads is never the one filled next, as long as a write waits for
    the one before it (:meth:`persia_py.servers.page_file.PageFile.write_blocks`). A
    scan reads into both (:meth:`persia_py.servers.disk_tier.DiskTier.scan_chunks`) and
    checks :attr:`num_handed` to know that no write took one meanwhile."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._buffers = [aligned_empty((0, block_bytes)), aligned_empty((0, block_bytes))]
        self._turn = 0
        self.num_handed = 0
        """Buffers handed out so far."""

    def blocks(self, n: int) -> np.ndarray:
        """The first ``n`` blocks of the next buffer (grown to them if needed; contents
        undefined)."""
        self._turn ^= 1
        self.num_handed += 1
        if self._buffers[self._turn].shape[0] < n:
            self._buffers[self._turn] = aligned_empty((n, self.block_bytes))
        return self._buffers[self._turn][:n]
