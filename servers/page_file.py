"""``PageFile``: fixed-size blocks in an unnamed file, read in batches past the page cache.

The disk tier (:mod:`persia_py.servers.disk_tier`) keeps rows in blocks of a multiple of
the device's 512-byte sector. This module only moves blocks:

* **Unnamed file.** The file is created with ``O_TMPFILE`` in the configured folder (or
  created and unlinked at once where the file system lacks it): it has no name, so a
  crash leaves nothing behind to clean up, a restart can never read a stale or torn
  file, and two tables (or two replicas sharing a folder) cannot collide. (Without
  ``O_TMPFILE``, a crash between the create and the unlink could leave a named file: a
  later tier in the folder deletes those of processes no longer alive; none is ever
  read.) Its space is
  reserved up front (``posix_fallocate``), so a disk too small fails at start, not in
  the middle of training.
* **O_DIRECT.** Reads and writes bypass the page cache, so what the tier's reads cost
  is the device's, not RAM's in disguise. Buffers are 4096-byte aligned, offsets and
  lengths multiples of 512. Where the file system refuses ``O_DIRECT`` (tmpfs), the file
  is opened without it and :attr:`PageFile.direct` says so (a warning is logged).
* **Batched random reads at a queue depth.** :meth:`PageFile.read_blocks` splits a
  batch's sorted block numbers among ``queue_depth`` threads, each running a numba
  loop of ``pread`` calls with the GIL released: ``queue_depth`` reads in flight, a
  fixed number of Python calls per batch (none per row).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numba import njit

__all__ = ["ALIGN", "SECTOR", "PageFile", "aligned_empty"]

logger = logging.getLogger(__name__)

SECTOR = 512
"""Unit of every offset and length (the logical block size of the devices we target)."""
ALIGN = 4096
"""Alignment of every buffer handed to the file (enough for any O_DIRECT device)."""
_WRITE_CHUNK = 8 << 20
"""Bytes per ``pwrite`` call of a large write."""
_LEFTOVER = re.compile(r"\.persia-tier-(\d+)-[0-9a-f]{12}")
"""Name of a tier file created without ``O_TMPFILE`` (unlinked at once, unless a crash)."""

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
# The buffer travels as an integer address: numba passes ``array.ctypes.data`` as one.
_pread.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t


# Not cached: numba cannot cache a function that calls a ctypes pointer.
@njit(nogil=True)
def _read_kernel(fd: int, blocks: np.ndarray, block_bytes: int, out: np.ndarray) -> int:
    """``pread`` block ``blocks[i]`` into ``out[i]`` for every i; returns the first i whose
    read failed or came back short (-1: none)."""
    base = out.ctypes.data
    for i in range(blocks.shape[0]):
        got = _pread(fd, base + i * block_bytes, block_bytes, blocks[i] * block_bytes)
        if got != block_bytes:
            return i
    return -1


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts at an ``ALIGN`` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _remove_leftovers(directory: str) -> None:
    """Delete the named tier files of dead processes in ``directory`` (a crash between a
    create and its unlink); their rows are never read (the tier starts empty)."""
    for name in os.listdir(directory):
        match = _LEFTOVER.fullmatch(name)
        if match is None:
            continue
        try:
            os.kill(int(match[1]), 0)
            continue  # alive (or another user's): its file is its own
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _open_unnamed(directory: str) -> tuple[int, bool]:
    """A new unnamed read-write file in ``directory`` and whether it is ``O_DIRECT``."""
    if not os.path.isdir(directory):
        raise ValueError(f"disk tier path {directory!r} is not an existing folder")
    base = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    for flags, is_direct in ((base | direct, bool(direct)), (base, False)):
        try:
            if hasattr(os, "O_TMPFILE"):
                try:
                    return os.open(directory, flags | os.O_TMPFILE, 0o600), is_direct
                except OSError as exc:
                    if exc.errno not in (95, 21, 22):  # EOPNOTSUPP, EISDIR, EINVAL
                        raise
            # No O_TMPFILE here: a named file, unlinked at once.
            _remove_leftovers(directory)
            path = os.path.join(directory, f".persia-tier-{os.getpid()}-{os.urandom(6).hex()}")
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)
            return fd, is_direct
        except OSError as exc:
            if exc.errno == 22 and is_direct:  # EINVAL: no O_DIRECT on this file system
                continue
            raise ValueError(f"disk tier path {directory!r}: cannot create a file there "
                             f"({exc.strerror})") from None
    raise AssertionError("unreachable")


class PageFile:
    """``num_blocks`` blocks of ``block_bytes`` (a multiple of 512) in an unnamed file.

    Not thread-safe: its owner serializes calls (the disk tier runs under its shard's
    lock), but for :meth:`read_blocks` without flushing or counting. :meth:`close` joins
    the reader threads and frees the disk space.
    """

    def __init__(self, directory: str, *, block_bytes: int, num_blocks: int,
                 queue_depth: int = 32) -> None:
        if block_bytes <= 0 or block_bytes % SECTOR:
            raise ValueError(f"block_bytes must be a positive multiple of {SECTOR}, "
                             f"got {block_bytes}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not 1 <= queue_depth <= 256:
            raise ValueError(f"queue_depth must be in [1, 256], got {queue_depth}")
        self.block_bytes = int(block_bytes)
        self.num_blocks = int(num_blocks)
        self.queue_depth = int(queue_depth)
        self.fd, self.direct = _open_unnamed(directory)
        if not self.direct:
            logger.warning("disk tier in %s: the file system refuses O_DIRECT; reads go "
                           "through the page cache (measured speed is not the disk's)",
                           directory)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as exc:
            os.close(self.fd)
            raise ValueError(f"disk tier path {directory!r}: cannot reserve "
                             f"{self.nbytes:,} bytes ({exc.strerror}); free disk space or "
                             f"lower capacity_rows") from None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=self.queue_depth, thread_name_prefix="disk-tier-read")
        self.num_block_reads = 0
        """Blocks read by :meth:`read_blocks` (random reads)."""
        self.num_block_writes = 0
        self._pending: Future | None = None
        """The write in flight (``write_blocks(..., wait=False)``): every other call
        waits for it first, so the file reads as if it had been written at once."""
        self.num_bytes_read = 0
        """Bytes read, random reads and scans."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._pool is None

    @property
    def nbytes(self) -> int:
        """Bytes of the file (all reserved at start)."""
        return self.block_bytes * self.num_blocks

    def close(self) -> None:
        """Join the threads and close the file (its space is freed: it has no name; a
        write still in flight is waited for, its failure moot: the rows go with the file)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
            self._pending = None
            os.close(self.fd)

    def flush(self) -> None:
        """Wait for the write in flight, if any; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _check_open(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise ValueError("the page file is closed")
        self.flush()
        return self._pool

    def read_blocks(self, blocks: np.ndarray, *, counted: bool = True, flush: bool = True
                    ) -> np.ndarray:
        """Blocks ``blocks`` (int64, in range; sorted ascending reads best) as an
        aligned ``uint8`` array ``(len(blocks), block_bytes)``. ``flush`` False and
        ``counted`` False: from another thread than the owner's, which flushed before and
        counts after (:meth:`count_reads`): the call then touches only the file."""
        if self._pool is None:
            raise ValueError("the page file is closed")
        pool = self._check_open() if flush else self._pool
        blocks = np.ascontiguousarray(blocks, dtype=np.int64)
        n = blocks.shape[0]
        out = aligned_empty((n, self.block_bytes))
        if n == 0:
            return out
        if int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks:
            raise ValueError(f"block numbers must be in [0, {self.num_blocks})")
        # One slice per thread: ``parts`` reads in flight, one Python call per thread.
        parts = min(self.queue_depth, n)
        bounds = [k * n // parts for k in range(parts + 1)]
        futures = [pool.submit(_read_kernel, self.fd, blocks[a:b], self.block_bytes,
                               out[a:b]) for a, b in zip(bounds, bounds[1:])]
        failed = [f.result() for f in futures]
        if counted:
            self.count_reads(n)
        for a, f in zip(bounds, failed):
            if f >= 0:
                block = int(blocks[a + f])
                got = os.preadv(self.fd, [out[a + f]], block * self.block_bytes)  # for errno
                raise OSError(f"disk tier: short read of block {block} ({got} of "
                              f"{self.block_bytes} bytes)")
        return out

    def count_reads(self, n: int) -> None:
        """Count ``n`` blocks read by :meth:`read_blocks`."""
        self.num_block_reads += n
        self.num_bytes_read += n * self.block_bytes

    def write_blocks(self, first_block: int, data: np.ndarray, *, wait: bool = True) -> None:
        """Write ``data`` (aligned ``uint8`` ``(n, block_bytes)``, C-contiguous) to blocks
        ``first_block .. first_block + n - 1``. ``wait`` False: in a thread, while the
        caller goes on (a checkpoint's load packs the next chunk meanwhile); ``data`` must
        stay untouched until the next call to this file, which waits for it
        (:meth:`flush`)."""
        pool = self._check_open()
        n = data.shape[0]
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != self.block_bytes:
            raise ValueError(f"data must be uint8 of shape (n, {self.block_bytes})")
        if not 0 <= first_block <= self.num_blocks - n:
            raise ValueError(f"blocks {first_block}..{first_block + n - 1} are past the "
                             f"file's {self.num_blocks}")
        if data.ctypes.data % ALIGN or not data.flags.c_contiguous:
            raise ValueError("data must be C-contiguous and ALIGN-aligned (aligned_empty)")
        if wait:
            self._write(first_block, data)
        else:
            self._pending = pool.submit(self._write, first_block, data)

    def _write(self, first_block: int, data: np.ndarray) -> None:
        n = data.shape[0]
        flat = data.reshape(-1).data  # a memoryview of the array's bytes
        offset = first_block * self.block_bytes
        done = 0
        while done < flat.nbytes:
            chunk = flat[done:done + _WRITE_CHUNK]
            written = os.pwrite(self.fd, chunk, offset + done)
            if written <= 0:
                raise OSError(f"disk tier: write at byte {offset + done} wrote nothing")
            # O_DIRECT writes come back whole or fail; a short buffered one goes again.
            done += written - written % SECTOR if self.direct else written
        self.num_block_writes += n

    def read_range(self, first_block: int, n: int, out: np.ndarray | None = None
                   ) -> np.ndarray:
        """Blocks ``first_block .. first_block + n - 1``, read sequentially (scans), into
        ``out`` (aligned ``uint8`` ``(n, block_bytes)``, reused by the caller) or a new
        array."""
        self._check_open()
        return self._read_range(first_block, n, out)

    def read_range_ahead(self, first_block: int, n: int, out: np.ndarray
                         ) -> Future[np.ndarray]:
        """:meth:`read_range` into ``out`` in a thread, while the caller works on the
        last range; the caller waits for it (``result()``) before its next call here."""
        return self._check_open().submit(self._read_range, first_block, n, out)

    def _read_range(self, first_block: int, n: int, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = aligned_empty((n, self.block_bytes))
        elif (out.shape != (n, self.block_bytes) or out.dtype != np.uint8
              or out.ctypes.data % ALIGN or not out.flags.c_contiguous):
            raise ValueError(f"out must be aligned uint8 of shape ({n}, {self.block_bytes})")
        flat = out.reshape(-1)
        offset = first_block * self.block_bytes
        done = 0
        while done < flat.nbytes:
            got = os.preadv(self.fd, [flat[done:done + _WRITE_CHUNK].data], offset + done)
            if got <= 0:
                raise OSError(f"disk tier: read at byte {offset + done} returned nothing")
            done += got
        self.num_bytes_read += flat.nbytes
        return out
