"""A parameter-server replica's update log: what it applied since its last checkpoint cut,
so that a replica restarted after a crash comes back with every update it acknowledged.

Without it a restarted replica loads its newest checkpoint and the updates its rows got
since then are lost. With ``--update-log DIR`` every update is appended to a log in a
folder the server owns, after it is applied and before it is acknowledged; a restart with
``--replay-update-log`` loads the checkpoint the log starts from and applies the log
again, rebuilding the exactly-once window with it, so the embedding workers' retries of
unacknowledged updates are applied once and acknowledged ones are not applied again.

**Segments.** The log is a sequence of files ``<n>.log`` (n counts up). A segment's first
record says what it continues:

* ``start``: an empty replica (no checkpoint loaded yet);
* ``load``: the replica loaded checkpoint ``base`` (a training rollback or a start from a
  checkpoint): what earlier segments hold is another timeline, and they are deleted;
* ``cut``: a checkpoint ``base`` was cut (Dump): the state at the cut is the previous
  segment's end. Until ``base`` is complete (its manifest written by the training), the
  previous segments stay: a restart walks back to the newest segment whose ``base`` is
  complete (or a ``load``/``start`` one), loads it and replays from there.

Then ``configure`` records (the embedding optimizer's settings), ``lookup`` records (a
training lookup's ids: the rows it inserted, which the update after it needs; a crash
between the two must not lose them) and ``update`` records (worker id, sequence number,
and each table's ids and gradients), in the order they were applied.

**Records** are framed ``<length u32><check u32><payload>`` and padded with zeros to a
multiple of 4 KiB (the header's ``block``; segments written before padding have none).
The check is a crc32 for the header record and the header's ``sum`` for the records
after it: ``lanes64``, a checksum that runs at memory speed (``servers/record_sum.py``;
segments written before it have none: crc32 throughout). A
record cut short by a crash (the process died inside the write) fails its check and is
dropped with what follows it, at the end of the newest segment only (it was never
acknowledged; elsewhere it is an error). A record is one ``write`` to a file opened for
appending, with ``O_DIRECT`` where the file system takes it (``servers/block_append.py``:
a buffered write of the records cost more CPU than the update itself): it has left the
process before the update is acknowledged, so the log survives the process's death. It
is not fsynced per update: a machine's crash may lose the tail the device had not made
durable.

**Failure.** If appending fails (a full disk), or the log would outgrow ``max_bytes`` (no
checkpoint cut it for that long), the log is deleted and logging stops until the next
checkpoint cut or load: a restart then falls back to the checkpoint (logged), and never
replays a log with a hole in it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from persia_py.checkpoint import layout as fmt
from persia_py.ops import safe_files
from persia_py.ops.private_files import open_private
from persia_py.servers.block_append import BLOCK, FRAME, BlockAppender, padded
from persia_py.servers.record_sum import CRC32, LANES64, SUMS

logger = logging.getLogger(__name__)

_META = struct.Struct("<I")  # length of the JSON part of a payload
_SEGMENT = re.compile(r"(\d{12})\.log")
DEFAULT_MAX_BYTES = 8 << 30
"""Most bytes the log holds; past that (no checkpoint cut it for that long) it is deleted
and logging stops until the next checkpoint, so disk use stays bounded."""
MAX_RECORD_BYTES = 1 << 31
"""A record longer than this is taken for a damaged frame."""
SEGMENT_KINDS = ("start", "load", "cut")


@dataclass(frozen=True)
class Segment:
    number: int
    path: Path
    kind: str
    base: str | None
    """The checkpoint folder this segment continues (None for ``start``)."""
    block: int = 1
    """Records are padded to a multiple of this (1: written before padding)."""
    check: str = CRC32
    """The check of the records after the header (a key of ``record_sum.SUMS``)."""


class UpdateLog:
    """The appending side: one open segment at a time, written by many threads."""

    def __init__(self, folder: str | os.PathLike, replica_index: int, *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.replica_index = replica_index
        self.max_bytes = max_bytes
        self._bytes = 0  # in the segments a restart may need
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._out: BlockAppender | None = None
        self._number = max((s.number for s in segment_files(self.folder)), default=-1)

    # -- segments ------------------------------------------------------------------

    def begin(self, kind: str, base: str | os.PathLike | None) -> None:
        """Start a new segment of ``kind`` continuing checkpoint ``base`` (see the module
        docstring). ``load`` and ``start`` delete the earlier segments, once the new one is
        in place; ``cut`` deletes those no restart can need any more."""
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"kind must be one of {SEGMENT_KINDS}, got {kind!r}")
        with self._lock:
            self._close_segment()
            self._number += 1
            path = self.folder / _segment_name(self._number)
            fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
            out = BlockAppender(fd)
            try:
                header = {"kind": kind, "base": None if base is None else str(base),
                          "replica_index": self.replica_index, "block": BLOCK,
                          "sum": LANES64}
                out.append(_payload(json.dumps(header).encode(), []))
                out.check = LANES64
                os.fsync(fd)
                safe_files.fsync_dir(self.folder)
            except BaseException:
                out.close()
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            self._fd, self._out = fd, out
            self._prune(kind)
            self._bytes = sum(f.path.stat().st_size for f in segment_files(self.folder))

    def resume(self, segment: Segment) -> None:
        """Append to ``segment`` (the last one, replayed after a restart)."""
        with self._lock:
            self._close_segment()
            self._fd = open_private(segment.path, os.O_WRONLY | os.O_APPEND)
            self._out = BlockAppender(self._fd, block=segment.block, check=segment.check)
            self._number = max(self._number, segment.number)
            self._bytes = sum(f.path.stat().st_size for f in segment_files(self.folder))

    def _prune(self, kind: str) -> None:
        segments = read_segments(self.folder)
        keep_from = self._number
        if kind == "cut":  # keep back to the newest segment a restart could start from
            older = [s for s in segments if s.number < self._number]
            keep_from = next((s.number for s in reversed(older) if _can_start(s)),
                             older[0].number if older else self._number)
        for segment in segments:
            if segment.number < keep_from:
                segment.path.unlink(missing_ok=True)

    def _close_segment(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None

    # -- records -------------------------------------------------------------------

    def configure(self, settings: dict) -> None:
        """Log the embedding optimizer's settings (``ParameterServer.configure``)."""
        self._append({"type": "configure", "settings": settings}, [])

    def lookup(self, requests: list[tuple[str, np.ndarray]]) -> None:
        """Log a training lookup's ids (``(table, ids uint64 [n])``): the rows it inserted
        are there again on replay, before the update that follows it is retried."""
        meta = {"type": "lookup", "tables": [[name, int(ids.shape[0])] for name, ids in requests]}
        self._append(meta, [ids for _, ids in requests])

    def update(self, requests: list[tuple[str, np.ndarray, np.ndarray]], worker_id: str,
               sequence: int) -> None:
        """Log one applied update: ``(table, ids uint64 [n], grads [n, dim])``, the
        gradients in the float type they arrived in (float16 from a float16 wire: half the
        bytes, and replay widens them exactly as the update did)."""
        meta = {"type": "update", "worker_id": worker_id, "sequence": int(sequence),
                "tables": [[name, int(ids.shape[0]), int(grads.shape[1]), grads.dtype.name]
                           for name, ids, grads in requests]}
        arrays = [a for _, ids, grads in requests for a in (ids, grads)]
        self._append(meta, arrays)

    def _append(self, meta: dict, arrays: list[np.ndarray]) -> None:
        payload = _payload(json.dumps(meta).encode(), arrays)
        size = FRAME.size + sum(len(piece) for piece in payload)
        with self._lock:
            if self._fd is None or self._out is None:
                return  # logging stopped after a failure, until the next cut or load
            whole = padded(size, self._out.block)
            if self._bytes + whole > self.max_bytes:
                self._give_up(f"it would outgrow {self.max_bytes} bytes (no checkpoint cut it "
                              "for that long: set checkpoint_config.every_steps)")
                return
            try:
                written = self._out.append(payload)
                if written != whole:
                    raise OSError(f"short write ({written} of {whole} bytes)")
            except OSError as exc:
                self._give_up(f"appending failed: {exc}")
                return
            self._bytes += whole

    def _give_up(self, why: str) -> None:
        """A log with a hole must never be replayed: delete it (unlinking needs no space)."""
        logger.error("parameter server %d: update log in %s: %s; the log is deleted and "
                     "logging stops until the next checkpoint: a restart before then loses "
                     "the updates since the checkpoint", self.replica_index, self.folder, why)
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        for segment in segment_files(self.folder):
            segment.path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._close_segment()


# -- reading ------------------------------------------------------------------------------


def _segment_name(number: int) -> str:
    return f"{number:012d}.log"


def _payload(meta: bytes, arrays: list[np.ndarray]) -> list:
    """A record's payload as pieces: the JSON part's length, the JSON, the arrays' own
    memory (copied once, into the appender's staging buffer)."""
    return [_META.pack(len(meta)), meta,
            *(np.ascontiguousarray(a).data.cast("B") for a in arrays)]


@dataclass(frozen=True)
class SegmentFile:
    number: int
    path: Path


def segment_files(folder: Path) -> list[SegmentFile]:
    """The segment files of ``folder``, oldest first (headers not read)."""
    files = []
    for entry in os.scandir(folder):
        match = _SEGMENT.fullmatch(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            files.append(SegmentFile(int(match[1]), Path(entry.path)))
    return sorted(files, key=lambda f: f.number)


def read_segments(folder: str | os.PathLike) -> list[Segment]:
    """The segments in ``folder``, oldest first, with their headers (a segment whose
    header is unreadable was cut short at its creation: it is skipped)."""
    segments = []
    for file in segment_files(Path(folder)):
        with open(file.path, "rb") as f:
            header = next(_records(f, file.path, tolerate_tail=True), None)
        if header is None:
            continue
        meta = header[0]
        if meta.get("kind") not in SEGMENT_KINDS:
            raise ValueError(f"{file.path}: not an update-log segment (header {meta!r})")
        segments.append(Segment(file.number, file.path, meta["kind"], meta.get("base"),
                                _block(meta, file.path), _check(meta, file.path)))
    return segments


def _block(header: dict, path: Path) -> int:
    block = header.get("block", 1)  # segments written before padding: none
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= 1 << 20:
        raise ValueError(f"{path}: the header's block {block!r} is not an int in [1, 2**20]")
    return block


def _check(header: dict, path: Path) -> str:
    check = header.get("sum", CRC32)  # segments written before lanes64: crc32
    if check not in SUMS:
        raise ValueError(f"{path}: the header's sum {check!r} is not one of {sorted(SUMS)}")
    return check


def _records(f, path: Path, *, tolerate_tail: bool) -> Iterator[tuple[dict, bytes, int]]:
    """``(meta, array bytes, end offset)`` of each record of an open segment, the end
    past the record's padding (the header's ``block``), each record checked with the
    header's ``sum`` (the header itself with crc32). A damaged or incomplete record ends
    the reading when ``tolerate_tail``; else ValueError."""
    offset, block, check = 0, 1, SUMS[CRC32]
    while True:
        frame = f.read(FRAME.size)
        if not frame:
            return
        problem = None
        if len(frame) < FRAME.size:
            problem = "a record's frame is cut short"
        else:
            length, expected = FRAME.unpack(frame)
            payload = f.read(length) if _META.size <= length <= MAX_RECORD_BYTES else b""
            if len(payload) != length or length < _META.size or check(payload) != expected:
                problem = "a record is cut short or damaged"
        if problem is not None:
            if tolerate_tail:
                return
            raise ValueError(f"{path} at byte {offset}: {problem}")
        (meta_len,) = _META.unpack_from(payload)
        meta = json.loads(payload[_META.size:_META.size + meta_len])
        if offset == 0:
            block, check = _block(meta, path), SUMS[_check(meta, path)]
        offset = padded(offset + FRAME.size + length, block)
        f.seek(offset)
        yield meta, payload[_META.size + meta_len:], offset


def complete_checkpoint(base: str | os.PathLike) -> Path | None:
    """The complete checkpoint a segment's ``base`` became: the folder itself once it has
    its manifest, or the folder of its root whose manifest says it was written as
    ``base`` (the training renames a checkpoint's folder when it completes it); None if
    there is none (not completed, or pruned since)."""
    path = Path(base)
    if (path / fmt.MANIFEST).is_file():
        return path
    try:
        candidates = sorted(path.parent.glob("ckpt-*"), reverse=True)
    except OSError:
        return None
    for candidate in candidates:
        try:
            manifest = json.loads((candidate / fmt.MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("written_as") == path.name:
            return candidate
    return None


def _can_start(segment: Segment) -> bool:
    """Whether a restart can begin with ``segment``: a ``start``, or its base complete."""
    return segment.kind == "start" or (segment.base is not None
                                       and complete_checkpoint(segment.base) is not None)


def _check_base(segment: Segment, root: Path, trusted: Path | None) -> None:
    """ValueError naming the segment's file and offset unless its ``base`` lies inside
    ``root`` or is (inside) ``trusted``, links resolved and nothing opened: a header is
    read from a file, and a restart opens the checkpoint it names."""
    if segment.base is None:
        return
    if not isinstance(segment.base, str) or not os.path.isabs(segment.base):
        raise ValueError(f"{segment.path} at byte 0: the header's checkpoint {segment.base!r} "
                         "is not an absolute path")
    real = Path(os.path.realpath(segment.base))
    if not ((real.is_relative_to(root) and real != root)
            or (trusted is not None and real.is_relative_to(trusted))):
        raise ValueError(f"{segment.path} at byte 0: the header names checkpoint "
                         f"{segment.base!r}, outside the checkpoint root {root}; a restart "
                         "opens no checkpoint outside it")


def replay_plan(folder: str | os.PathLike, root: Path,
                trusted: Path | None = None) -> list[Segment]:
    """The segments a restart loads and replays: from the newest one a restart can begin
    with (see :func:`_can_start`) to the last. Empty when the folder holds none. Every
    segment's checkpoint must lie inside the checkpoint ``root`` or be the ``trusted``
    one (real paths; see :func:`_check_base`), checked before any of them is opened."""
    segments = read_segments(folder)
    for segment in segments:
        _check_base(segment, root, trusted)
    for i in range(len(segments) - 1, -1, -1):
        if _can_start(segments[i]):
            return segments[i:]
    if segments:
        raise ValueError(f"{folder}: no segment of the update log can be started from (each "
                         "continues a checkpoint that is not complete)")
    return []


def updates(segment: Segment, *, last: bool) -> Iterator[dict]:
    """The records after ``segment``'s header, as dicts: ``configure`` (``settings``),
    ``lookup`` (``requests`` of (table, ids)) and ``update`` (``worker_id``, ``sequence``,
    ``requests`` of (table, ids, grads)). The
    ``last`` segment may end in a record cut short; it is dropped and the file truncated
    to what is whole, so that appending goes on after a whole record."""
    with open(segment.path, "rb") as f:
        records = _records(f, segment.path, tolerate_tail=last)
        _, _, end = next(records)  # the header (read_segments read it)
        for meta, data, offset in records:
            end = offset
            if meta["type"] == "update":
                meta["requests"] = _arrays(meta["tables"], data, segment.path)
            elif meta["type"] == "lookup":
                meta["requests"] = _ids(meta["tables"], data, segment.path)
            yield meta
    if last:
        with open(segment.path, "r+b") as f:
            f.truncate(end)


def _ids(tables: list, data: bytes, path: Path) -> list[tuple[str, np.ndarray]]:
    out, offset = [], 0
    for name, n in tables:
        out.append((name, np.frombuffer(data, dtype=np.uint64, count=n, offset=offset)))
        offset += 8 * n
    if offset != len(data):
        raise ValueError(f"{path}: a lookup record's ids do not match its tables")
    return out


def _arrays(tables: list, data: bytes, path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    out, offset = [], 0
    for name, n, dim, *dtype in tables:  # logs written before float16 records: float32
        grads_dtype = np.dtype(dtype[0] if dtype else "float32")
        if grads_dtype.name not in ("float16", "float32"):
            raise ValueError(f"{path}: an update record's gradients have dtype {grads_dtype}")
        ids = np.frombuffer(data, dtype=np.uint64, count=n, offset=offset)
        offset += ids.nbytes
        grads = np.frombuffer(data, dtype=grads_dtype, count=n * dim, offset=offset)
        offset += grads.nbytes
        out.append((name, ids, grads.reshape(n, dim)))
    if offset != len(data):
        raise ValueError(f"{path}: an update record's arrays do not match its tables")
    return out


__all__ = ["Segment", "SegmentFile", "UpdateLog", "complete_checkpoint", "read_segments", "replay_plan",
           "segment_files", "updates"]
