"""Appending records to a log file in whole blocks, bypassing the page cache where the file
system allows it (``O_DIRECT``).

Why: a buffered ``write`` of a parameter server's update records (tens of MB per batch)
costs the writer more CPU than the update itself: the kernel allocates, fills and accounts
a page-cache page per 4 KiB, then writes it back (docs/benchmarks.md). With ``O_DIRECT``
the bytes go from one aligned staging buffer to the device: the writer pays one memcpy.
The durability promise is unchanged or better: when ``write`` returns, the record is out
of the process (on the device, rather than in the page cache), so the process's death
cannot lose it; a machine's crash may still lose what the device had not made durable.

A record is ``<length u32><check u32><payload>``, the check a crc32 or the faster
``lanes64`` (``servers/record_sum.py``). ``O_DIRECT`` wants the file offset, the
length and the buffer aligned to the logical block size, so every record is padded with
zeros to a multiple of :data:`BLOCK`; readers skip
the padding (the log says so in its header). Where ``O_DIRECT`` is refused (tmpfs on older
kernels, some network file systems) the same padded records are written buffered.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct

from persia_py.servers.record_sum import CRC32, SUMS

BLOCK = 4096
"""Record alignment: the largest logical block size of common devices."""
FRAME = struct.Struct("<II")
"""What precedes a record's payload: its length and its check (``servers/record_sum.py``)."""


def padded(size: int, block: int = BLOCK) -> int:
    """``size`` rounded up to a multiple of ``block``."""
    return -(-size // block) * block


class BlockAppender:
    """Writes whole-block records to ``fd`` (opened for appending; its size a multiple of
    ``block``), each in one ``write`` from a page-aligned staging buffer."""

    def __init__(self, fd: int, *, block: int = BLOCK, check: str = CRC32) -> None:
        self.fd = fd
        self.block = block
        """Records are padded to a multiple of this; 1 (a segment written before padding):
        none, and buffered."""
        self.check = check
        """The name of the check in the frames (a key of ``record_sum.SUMS``)."""
        self.direct = _set_direct(fd, True) if block == BLOCK else False
        self._staging: mmap.mmap | None = None

    def append(self, payload: list) -> int:
        """Write one record: :data:`FRAME` (the payload's length and :attr:`check`), the
        ``payload`` pieces (bytes-like), zeros up to the next block; returns the bytes the
        file grew by (fewer than ``padded(FRAME.size + length, block)`` only if the file
        system refused the rest). The check is computed over the staging buffer, where
        the pieces lie one after the other."""
        length = sum(len(piece) for piece in payload)
        total = padded(FRAME.size + length, self.block)
        staging = self._buffer(total)
        view = memoryview(staging)
        try:
            at = FRAME.size
            for piece in payload:
                view[at:at + len(piece)] = piece
                at += len(piece)
            FRAME.pack_into(view, 0, length, SUMS[self.check](view[FRAME.size:at]))
            view[at:total] = bytes(total - at)
            try:
                return os.write(self.fd, view[:total])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # Alignment this file system will not take after all: go on buffered.
                self.direct = _set_direct(self.fd, False)
                return os.write(self.fd, view[:total])
        finally:
            view.release()

    def _buffer(self, size: int) -> mmap.mmap:
        """A page-aligned staging buffer of at least ``size`` bytes (kept and reused)."""
        if self._staging is None or len(self._staging) < size:
            if self._staging is not None:
                self._staging.close()
            self._staging = mmap.mmap(-1, max(padded(size, 1 << 20), 1 << 20))
        return self._staging

    def close(self) -> None:
        """Release the staging buffer (the caller closes ``fd``)."""
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is on."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | direct) if on else (flags & ~direct))
    except OSError:
        return False
    return on
