"""Checkpoint arrays at the disk's speed: ``.npy`` files written and read in large aligned
chunks, past the page cache where the file system allows.

A checkpoint's row arrays are plain ``.npy`` files (``numpy.load`` reads them), with two
choices that let them move at the device's rate rather than the page cache's:

* **A header of one page.** The header is padded with spaces to :data:`HEADER_BYTES`, so
  the data starts at an aligned offset and every chunk of :func:`chunk_rows` rows (a
  multiple of 4096 rows: a multiple of 4096 bytes whatever the row's size) starts at one.
* **O_DIRECT, whole chunks.** :class:`NpyWriter` gathers appended rows in one aligned
  buffer of a chunk and writes it with one ``pwrite`` when full (the last one padded to
  4096 bytes, then the file cut to its length); :class:`NpyReader` reads chunk by chunk
  into its own aligned buffers, the next chunk in a thread while the caller works on
  this one (the thread also hashes it and, for float32 and float16 files, checks that
  every value is finite; a table's files share one such thread, so that the device
  gets one sequential read at a time). Measured on this VM: buffered writes and
  ``fsync`` of 512 MB took 0.4-6.9 s, the same bytes with ``O_DIRECT`` 0.4 s
  (docs/benchmarks.md "Checkpoints"). Where the file system refuses ``O_DIRECT``
  (tmpfs), the same calls go through the page cache.

**Checksums.** Each chunk's bytes are hashed with ``lanes64``
(:mod:`persia_py.servers.record_sum`, memory speed) while they are in the buffer, and the
chunk hashes folded into one 64-bit sum per file (:func:`fold_sum`): the writer returns
it, the reader checks it after the last chunk (:meth:`NpyReader.check_sum`).

Files are created new and opened without following a link (:mod:`persia_py.ops.safe_files`).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numba import njit

from persia_py.ids.hashing import mix64_one
from persia_py.ops import safe_files
from persia_py.servers.page_file import ALIGN, aligned_empty
from persia_py.servers.record_sum import lanes64
from persia_py.wire.finite import F16_EXPONENT, halves_finite

__all__ = ["HEADER_BYTES", "NpyReader", "NpyWriter", "all_finite32", "chunk_rows",
           "fold_sum"]

HEADER_BYTES = 4096
"""Bytes of the header of a file written here: its data starts at an aligned offset."""
CHUNK_BYTES = 8 << 20
"""About the bytes of one chunk of the largest array of a table."""
_MAX_HEADER_READ = 1 << 16
"""Most bytes of header read (numpy's own limit on a header is 10,000 characters)."""
_FLAGS_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FLAGS_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk of a table whose largest row has ``row_bytes`` bytes: a multiple of
    4096 rows (so a chunk of any of its arrays is a multiple of 4096 bytes), about
    :data:`CHUNK_BYTES` of the largest."""
    return max(1, CHUNK_BYTES // max(row_bytes, 1) // ALIGN) * ALIGN


def fold_sum(total: int, chunk: int) -> int:
    """The running sum of a file after one more chunk whose ``lanes64`` is ``chunk``."""
    mixed = mix64_one(np.uint64(total) ^ np.uint64(chunk))
    return int(mixed)


@njit(cache=True, nogil=True)
def all_finite32(words: np.ndarray) -> bool:
    """Whether no float32 (given as its uint32 bits) is infinite or NaN (exponent all
    ones); one pass, no temporary (``numpy.isfinite`` writes a bool per value)."""
    bad = np.uint32(0)
    mask = np.uint32(0x7F800000)
    for i in range(words.shape[0]):
        bad |= np.uint32((words[i] & mask) == mask)
    return bad == 0


def _set_direct(fd: int) -> bool:
    """Turn on ``O_DIRECT`` for ``fd``; False where the file system refuses it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | direct)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def npy_header(dtype: np.dtype, shape: tuple[int, ...], size: int | None = HEADER_BYTES
               ) -> bytes:
    """A version 1.0 ``.npy`` header of exactly ``size`` bytes (None: the fewest, a
    multiple of 64, as ``numpy.save`` writes)."""
    described = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                 "fortran_order": False, "shape": tuple(int(s) for s in shape)}
    text = repr(described).encode("latin1")
    prefix = b"\x93NUMPY\x01\x00"
    if size is None:
        size = -(-(len(prefix) + 2 + len(text) + 1) // 64) * 64
    length = size - len(prefix) - 2
    if len(text) + 1 > length:
        raise ValueError(f"a .npy header of {len(text)} bytes does not fit {size}")
    return prefix + length.to_bytes(2, "little") + text.ljust(length - 1) + b"\n"


class NpyWriter:
    """A new ``.npy`` file ``name`` in folder ``dir_fd`` of ``dtype`` rows shaped
    ``row_shape``, filled by :meth:`append` in order; :meth:`close` writes the header
    (the row count is known then), fsyncs and returns ``(bytes, sum)``. A writer not
    closed leaves a file without a valid header: callers write into a private folder
    (:func:`safe_files.private_dir`), removed on failure."""

    def __init__(self, dir_fd: int, name: str, dtype: np.dtype, row_shape: tuple[int, ...],
                 rows_per_chunk: int) -> None:
        safe_files.check_name(name, "file name")
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise TypeError(f"{name}: object arrays cannot be checkpointed")
        self.name, self.row_shape = name, tuple(row_shape)
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(name, _FLAGS_WRITE, 0o640, dir_fd=dir_fd)
        try:
            self.direct = _set_direct(self.fd)
            size = max(rows_per_chunk, 1) * max(self.row_bytes, 1)  # whole rows
            self._buffers = [aligned_empty((size,)), aligned_empty((size,))]
        except BaseException:
            os.close(self.fd)
            raise
        self.buffer = self._buffers[0]
        self.fill = 0
        self.offset = HEADER_BYTES
        self.num_rows = 0
        self.sum = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npy-write")
        self._pending: Future | None = None
        """The write of the other buffer, in flight (returns its chunk's lanes64)."""

    def append(self, rows: np.ndarray) -> None:
        """Append ``rows`` (``(k, *row_shape)`` of the file's dtype; any strides: they are
        copied once, into the chunk buffer)."""
        if rows.dtype != self.dtype or rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.name}: rows must be {self.dtype} (k, *{self.row_shape}),"
                             f" got {rows.dtype} {rows.shape}")
        if self.row_bytes == 0:
            self.num_rows += rows.shape[0]
            return
        per_chunk = self.buffer.shape[0] // self.row_bytes
        done = 0
        while done < rows.shape[0]:
            at = self.fill // self.row_bytes
            take = min(per_chunk - at, rows.shape[0] - done)
            end = self.fill + take * self.row_bytes
            self.buffer[self.fill:end].view(self.dtype).reshape(take, *self.row_shape)[:] = (
                rows[done:done + take])
            self.fill = end
            done += take
            if at + take == per_chunk:
                self._flush()
        self.num_rows += rows.shape[0]

    def _flush(self) -> None:
        """Hand the buffer's ``fill`` bytes to the writer thread (which hashes them and
        writes them at ``offset``, padded to 4096 bytes with O_DIRECT: only the last chunk
        can be short, and :meth:`close` cuts the file); fill the other buffer meanwhile."""
        self._wait()
        self._pending = self._pool.submit(self._write_chunk, self.buffer, self.fill,
                                          self.offset)
        self.offset += self.fill
        self.fill = 0
        self.buffer = self._buffers[1] if self.buffer is self._buffers[0] else self._buffers[0]

    def _write_chunk(self, buffer: np.ndarray, fill: int, offset: int) -> int:
        chunk_sum = lanes64(buffer[:fill])
        length = -(-fill // ALIGN) * ALIGN if self.direct else fill
        buffer[fill:length] = 0
        _write_all(self.fd, buffer[:length], offset, self.name)
        return chunk_sum

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.sum = fold_sum(self.sum, pending.result())

    def close(self) -> tuple[int, int]:
        """Finish the file: the last chunk, the header, its length, fsync; returns
        ``(bytes, sum)``. The descriptor is closed whatever happens."""
        try:
            if self.offset == HEADER_BYTES and self._pending is None:
                return self._close_small()
            if self.fill:
                self._flush()
            self._wait()
            header = aligned_empty((HEADER_BYTES,))
            header[:] = np.frombuffer(npy_header(self.dtype, (self.num_rows, *self.row_shape)),
                                      np.uint8)
            _write_all(self.fd, header, 0, self.name)
            os.ftruncate(self.fd, self.offset)
            os.fsync(self.fd)
            return self.offset, self.sum
        finally:
            self.abort()

    def _close_small(self) -> tuple[int, int]:
        """A file of one chunk or less (never flushed): numpy's short header, written
        through the page cache (a page of padding would double a small file)."""
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL,
                        fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
        data = self.buffer[:self.fill]
        header = npy_header(self.dtype, (self.num_rows, *self.row_shape), None)
        _write_all(self.fd, np.frombuffer(header + data.tobytes(), np.uint8), 0, self.name)
        os.fsync(self.fd)
        chunk_sum = fold_sum(0, lanes64(data)) if self.fill else 0
        return len(header) + self.fill, chunk_sum

    def abort(self) -> None:
        """Join the writer thread and close the descriptor (the file stays, incomplete)."""
        self._pool.shutdown(wait=True)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _write_all(fd: int, data: np.ndarray, offset: int, name: str) -> None:
    view = data.data
    done = 0
    while done < view.nbytes:
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(f"{name}: a write at byte {offset + done} wrote nothing")
        done += written


class NpyReader:
    """The ``.npy`` file ``name`` in folder ``dir_fd``: its header checked, its rows read
    chunk by chunk (:meth:`chunks`). CheckpointError says what is wrong with the file.
    ``reads``: the one thread that reads the files of a table in turn (one sequential
    read at a time is the device's fastest here: docs/benchmarks.md), shut down by its
    owner before :meth:`close`; None: a thread of its own."""

    def __init__(self, dir_fd: int, name: str, field: str = "file name",
                 reads: ThreadPoolExecutor | None = None) -> None:
        safe_files.check_name(name, field)
        try:
            self.fd = os.open(name, _FLAGS_READ, dir_fd=dir_fd)
        except FileNotFoundError:
            raise safe_files.CheckpointError(f"checkpoint file {name} is missing") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise safe_files.CheckpointError(f"checkpoint file {name} is a link; "
                                                 "refused") from None
            raise
        self.name = name
        self._pool: ThreadPoolExecutor | None = reads
        self._own_pool = reads is None
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> None:
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode):
            raise safe_files.CheckpointError(f"checkpoint file {self.name} is not a regular "
                                             "file")
        head = io.BytesIO(os.pread(self.fd, _MAX_HEADER_READ, 0))
        try:
            version = np.lib.format.read_magic(head)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(head)
        except (ValueError, OSError, EOFError, SyntaxError) as exc:
            raise safe_files.CheckpointError(f"checkpoint file {self.name} is not a valid .npy "
                                             f"file: {exc}") from None
        if dtype.hasobject or (fortran and len(shape) > 1):
            raise safe_files.CheckpointError(f"checkpoint file {self.name}: object or "
                                             "Fortran-ordered arrays are not read")
        self.dtype, self.shape, self.data_offset = dtype, tuple(shape), head.tell()
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * dtype.itemsize
        nbytes = (self.shape[0] if self.shape else 1) * self.row_bytes
        if info.st_size != self.data_offset + nbytes:
            raise safe_files.CheckpointError(
                f"checkpoint file {self.name} has {info.st_size} bytes, its header says "
                f"{self.data_offset + nbytes} (truncated or damaged)")
        self.direct = self.data_offset % ALIGN == 0 and _set_direct(self.fd)
        self.sum = 0
        self.finite: bool | None = None
        """Of the chunk :meth:`chunks` gave last (float32 and float16 files; None: not
        checked)."""

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def read_all(self, rows_per_chunk: int) -> np.ndarray:
        """The whole array (for the small ones: ids, stamps), read in chunks of
        ``rows_per_chunk`` rows (the writer's, for the sum)."""
        rows = self.num_rows
        out = np.empty((rows, *self.shape[1:]), self.dtype)
        for first, chunk in self.chunks(rows_per_chunk):
            out[first:first + chunk.shape[0]] = chunk
        return out.reshape(self.shape)

    def chunks(self, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, rows)`` for consecutive chunks of ``rows_per_chunk`` rows (a
        multiple of 4096): a view into a buffer that is read into again once the next chunk
        is asked for, so the caller copies what it keeps first.
        The next chunk is read in a thread meanwhile; each chunk goes into the file's sum."""
        n = self.num_rows
        if n == 0 or self.row_bytes == 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npy-read")
        chunk_bytes = rows_per_chunk * self.row_bytes
        size = -(-chunk_bytes // ALIGN) * ALIGN
        buffers = [aligned_empty((size,)), aligned_empty((size,))]
        pending: Future | None = self._pool.submit(self._read, 0, min(rows_per_chunk, n),
                                                   buffers[0])
        for k, first in enumerate(range(0, n, rows_per_chunk)):
            assert pending is not None
            count = min(rows_per_chunk, n - first)
            data = pending.result()
            nxt = first + rows_per_chunk
            pending = (self._pool.submit(self._read, nxt, min(rows_per_chunk, n - nxt),
                                         buffers[(k + 1) % 2]) if nxt < n else None)
            data, chunk_sum, finite = data
            self.sum = fold_sum(self.sum, chunk_sum)
            self.finite = finite
            yield first, data.view(self.dtype).reshape(count, *self.shape[1:])

    def _read(self, first: int, count: int, buffer: np.ndarray
              ) -> tuple[np.ndarray, int, bool | None]:
        """Rows ``first .. first + count - 1`` into ``buffer``; returns their bytes, their
        ``lanes64`` and (float32 and float16 files) whether every value is finite."""
        offset = self.data_offset + first * self.row_bytes
        nbytes = count * self.row_bytes
        length = -(-nbytes // ALIGN) * ALIGN if self.direct else nbytes
        view = buffer[:length].data
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise safe_files.CheckpointError(f"checkpoint file {self.name}: a read at byte "
                                                 f"{offset + done} came back empty")
            done += got
        data = buffer[:nbytes]
        finite = None
        if self.dtype == np.float32:
            finite = bool(all_finite32(data.view(np.uint32)))
        elif self.dtype == np.float16:  # (bfloat16 rows are stored as their uint16 bits)
            finite = halves_finite(data, F16_EXPONENT)
        return data, lanes64(data), finite

    def check_sum(self, expected: int | None) -> None:
        """CheckpointError unless every row was read and their sum is ``expected``
        (None: a file written before sums were kept)."""
        if expected is not None and self.sum != expected:
            raise safe_files.CheckpointError(f"checkpoint file {self.name}: its checksum does "
                                             "not match (damaged)")

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._own_pool:
            pool.shutdown(wait=True)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
