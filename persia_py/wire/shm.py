"""Arrays between two processes of one host through shared memory instead of messages.

An NN worker and its embedding worker, or an embedding worker and a parameter server, on
the same machine move tens of MB per batch (the lookup answer one way, the gradients
back); as gRPC messages those bytes are copied into the message, by gRPC, through the
socket and joined again on the other side. Here the call itself stays a gRPC call (the
token interceptor, deadlines, retries, status codes), but its arrays lie in a segment
both processes map, and the message carries only where (the calls:
:mod:`persia_py.wire.shm_calls`).

Trust model. Segments are made only by the caller's side (:class:`SegmentPool`: the NN
worker, the embedding worker): a name ``persia-shm-<maker's PID>-<32 random hex>`` in
``/dev/shm``, created exclusively, mode 0600, its pages reserved at once
(``posix_fallocate``: a full ``/dev/shm`` fails here, not as a SIGBUS on a later write),
and a random nonce in its header. The server (:class:`SegmentCache`: the embedding
worker, the parameter server) opens nothing else: a name that is not of that form, a
file that is not a regular file of this user with no access for others, a size other
than the one described or above ``common_config.max_message_bytes``, or a header without
the nonce the caller sent (which proves that the caller made the segment, on this host)
is refused before or right after mapping. Once mapped and checked it unlinks the name, so
nothing is left in ``/dev/shm`` by either side dying later; the maker unlinks what was
never mapped, and a maker killed before its peer mapped one leaves a name that the next
pool on the host removes (:func:`remove_orphans`).
Every offset a peer names is checked against the mapping (:meth:`Segment.at`), and a
mapping is never unmapped by hand: dropping it drops a reference, and it is unmapped
when the last array viewing it is gone, so a wrong or stale descriptor is an error,
never a crash or a read of other memory.

A segment is lent for one call: the caller names a free one in a request and takes it
back when the answer is decoded (the arrays copied out by decoding, as they are from a
message; or, for a caller that only sends them on, once no view of them is left:
:meth:`SegmentPool.give_back_later`) or when the update is acknowledged. A call that
failed may still be running on the other side, so its segment is never lent again
(:meth:`SegmentPool.discard`).
"""

from __future__ import annotations

import errno
import hmac
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from persia_py.wire import codec

__all__ = ["HEADER_BYTES", "Descriptor", "Segment", "SegmentCache", "SegmentPool",
           "ShmError", "ShmUnavailable", "layout", "remove_orphans"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64
"""Magic (16 bytes), the maker's nonce (16), the rest zero; arrays start after it."""
_MAGIC = b"persia-shm-v1\0\0\0"
_ALIGN = 64
_NAME = re.compile(r"persia-shm-(\d{1,10})-[0-9a-f]{32}")
"""The maker's PID, then 128 random bits."""
_ORPHAN_AGE_SEC = 60.0
"""A segment whose maker is gone is removed by the next pool made on this host once it is
this old (a maker killed between making one and its peer mapping it leaves it behind)."""
_NONCE = re.compile(r"[0-9a-f]{32}")


class ShmError(ValueError):
    """A descriptor or offset that cannot be used (malformed, out of bounds, too big)."""


class ShmUnavailable(ShmError):
    """The segment is not here: another host, a restarted process, or no ``/dev/shm``.
    Not the caller's fault: it sends its arrays in the message instead."""


@dataclass(frozen=True)
class Descriptor:
    """What a message says of a segment."""

    name: str
    nonce: str  # 32 hex digits
    size: int  # bytes, header included


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(specs: list[tuple[str, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Offsets of arrays (``(dtype name, shape)`` each) laid out after the header, aligned,
    and the segment size they need."""
    offsets, end = [], HEADER_BYTES
    for dtype_name, shape in specs:
        offsets.append(end)
        end = _align(end + math.prod(shape) * np.dtype(dtype_name).itemsize)
    return offsets, end


class Segment:
    """One mapped segment."""

    def __init__(self, descriptor: Descriptor, mapping: mmap.mmap, linked: bool) -> None:
        self.descriptor = descriptor
        self._mapping = mapping
        self._view = memoryview(mapping)
        self.linked = linked
        """Whether its name is still in ``/dev/shm`` (unlinked once the peer mapped it)."""
        self.used = False
        """Whether a peer used it (has it mapped): the maker then tells it to forget it."""

    @property
    def size(self) -> int:
        return self.descriptor.size

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new segment of ``size`` bytes (header included), its pages reserved."""
        name = f"persia-shm-{os.getpid()}-{secrets.token_hex(16)}"
        nonce = secrets.token_bytes(16)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapping[:HEADER_BYTES] = (_MAGIC + nonce).ljust(HEADER_BYTES, b"\0")
        return cls(Descriptor(name, nonce.hex(), size), mapping, linked=True)

    @classmethod
    def open(cls, descriptor: Descriptor, max_bytes: int) -> Segment:
        """Map the segment a peer made on this host; checks in the module docstring."""
        name, size = descriptor.name, descriptor.size
        if not _NAME.fullmatch(name):
            raise ShmError(f"segment name {name[:80]!r} is not persia-shm-, a PID, - and 32 "
                           "hex digits")
        if not _NONCE.fullmatch(descriptor.nonce):
            raise ShmError(f"segment {name}: nonce is not 32 hex digits")
        if not HEADER_BYTES <= size <= max_bytes + HEADER_BYTES:
            raise ShmError(f"segment {name}: size {size} outside [{HEADER_BYTES}, "
                           f"{max_bytes + HEADER_BYTES}] (common_config.max_message_bytes)")
        try:
            dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"no {SHM_DIR} here ({exc.strerror})") from None
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                             | os.O_NOCTTY, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise ShmUnavailable(f"segment {name} is not on this host (another host, "
                                         "or this process restarted since it was mapped)") from None
                raise ShmUnavailable(f"segment {name} cannot be opened ({exc.strerror})") from None
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise ShmError(f"segment {name} is not a regular file")
                if info.st_uid != os.geteuid() or info.st_mode & 0o077:
                    raise ShmError(f"segment {name} is not this user's alone (mode "
                                   f"{stat.S_IMODE(info.st_mode):o}, uid {info.st_uid})")
                if info.st_size != size:
                    raise ShmError(f"segment {name} has {info.st_size} bytes, not {size}")
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            expected = _MAGIC + bytes.fromhex(descriptor.nonce)
            if not hmac.compare_digest(mapping[:len(expected)], expected):
                mapping.close()
                raise ShmUnavailable(f"segment {name}: its header lacks the caller's nonce "
                                     "(not the caller's segment)")
            try:  # both sides have it mapped: its name is not needed any more
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        finally:
            os.close(dir_fd)
        return cls(descriptor, mapping, linked=False)

    def at(self, offset: int, num_bytes: int, *, writable: bool = False) -> memoryview:
        """``num_bytes`` at ``offset``, both checked against the data part of the mapping."""
        if not (HEADER_BYTES <= offset and 0 <= num_bytes
                and offset + num_bytes <= self.descriptor.size):
            raise ShmError(f"segment {self.descriptor.name}: bytes [{offset}, "
                           f"{offset + num_bytes}) outside its data [{HEADER_BYTES}, "
                           f"{self.descriptor.size})")
        piece = self._view[offset:offset + num_bytes]
        return piece if writable else piece.toreadonly()

    def tensor_data(self, tensor, offset: int) -> memoryview:
        """The bytes of ``tensor`` (a Tensor message without data: dtype and shape) at
        ``offset``; :func:`codec.decode` with ``data=`` then checks dtype and shape."""
        if getattr(tensor, "lz4", False):
            raise ShmError(f"segment {self.descriptor.name}: arrays in shared memory are "
                           "never lz4-compressed")
        return self.at(offset, codec.claimed_bytes(tensor))

    def array(self, offset: int, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A writable array at ``offset`` (bounds checked), for the side that writes."""
        dtype = np.dtype(dtype_name).newbyteorder("<")
        count = math.prod(shape)
        return np.frombuffer(self.at(offset, count * dtype.itemsize, writable=True), dtype,
                             count=count).reshape(shape)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.descriptor.name))
            except FileNotFoundError:
                pass

    def name_gone(self) -> bool:
        """Whether the name was unlinked by someone else (the peer, after mapping it)."""
        return not os.path.exists(os.path.join(SHM_DIR, self.descriptor.name))


_MIN_SEGMENT_BYTES = 1 << 20


class SegmentPool:
    """A caller's segments for one peer and one direction, lent one call at a time.

    Sizes follow what the calls needed (the largest seen, plus a quarter); at most
    ``max_segments`` exist (beyond, a call sends its arrays in the message).
    """

    def __init__(self, max_bytes: int, max_segments: int) -> None:
        self._max_bytes = max_bytes
        self._max_segments = max_segments
        self._free: list[Segment] = []
        self._lent: set[Segment] = set()
        self._forget: list[Descriptor] = []
        self._returned: deque[tuple[Segment, bool]] = deque()
        self._wanted = _MIN_SEGMENT_BYTES
        self._lock = threading.Lock()
        self.enabled = True
        """False once the peer proved not to be on this host, or ``/dev/shm`` failed."""
        self.num_made = 0
        """Segments made so far."""
        self._finalizer = weakref.finalize(self, _unlink_all, self._free, self._lent)
        remove_orphans()

    def acquire(self, num_bytes: int = 0) -> Segment | None:
        """A segment of at least ``num_bytes`` (or of the size answers needed so far),
        or None (arrays then travel in the message)."""
        with self._lock:
            self._take_returned()
            if not self.enabled:
                return None
            wanted = max(num_bytes, self._wanted)
            if wanted > self._max_bytes + HEADER_BYTES:
                return None
            while self._free:
                segment = self._free.pop()
                if segment.size >= wanted:
                    self._lent.add(segment)
                    return segment
                self._retire(segment)
            if len(self._lent) >= self._max_segments:
                return None
            try:
                segment = Segment.create(min(wanted + wanted // 4, self._max_bytes
                                             + HEADER_BYTES))
            except OSError as exc:
                self.enabled = False
                logger.warning("shared memory unavailable (%s); arrays travel in messages", exc)
                return None
            self.num_made += 1
            self._lent.add(segment)
            return segment

    def give_back(self, segment: Segment) -> None:
        """The call that used ``segment`` is over and its arrays read: lend it again."""
        with self._lock:
            self._lent.discard(segment)
            self._free.append(segment)

    def give_back_later(self, segment: Segment, lend_again: bool) -> None:
        """:meth:`give_back` (or, not ``lend_again``, :meth:`discard`) at the next
        :meth:`acquire`; takes no lock, so a finalizer may call it from any thread at any
        point (the garbage collector's included). A segment discarded meanwhile stays so."""
        self._returned.append((segment, lend_again))

    def _take_returned(self) -> None:
        """Under the lock: the segments given back later."""
        while self._returned:
            segment, lend_again = self._returned.popleft()
            if segment in self._lent:
                self._lent.discard(segment)
                if lend_again:
                    self._free.append(segment)
                else:
                    self._retire(segment)

    def discard(self, segment: Segment) -> None:
        """Never lend ``segment`` again (its call failed, or it is too small)."""
        with self._lock:
            self._lent.discard(segment)
            self._retire(segment)

    def _retire(self, segment: Segment) -> None:
        segment.unlink()
        if segment.used and len(self._forget) < 64:
            self._forget.append(segment.descriptor)

    def need(self, num_bytes: int) -> None:
        """A call needed ``num_bytes`` of segment: later segments are made that big."""
        with self._lock:
            self._wanted = max(self._wanted, num_bytes)

    def disable(self, reason: str) -> None:
        with self._lock:
            if self.enabled:
                logger.info("shared memory not used: %s; arrays travel in messages", reason)
            self.enabled = False

    def take_forget(self) -> list[Descriptor]:
        """Segments the peer mapped that are retired: the next request tells it."""
        with self._lock:
            forget, self._forget = self._forget, []
        return forget

    def refused(self, segment: Segment, reason: str) -> None:
        """The peer could not use ``segment``: if its name is still there, the peer is
        elsewhere (off for good); if gone, it mapped it and lost it since (it restarted,
        or dropped it idle): so did it every other segment it mapped, so all of those are
        retired too, and new ones made next time."""
        gone = segment.name_gone()
        self.discard(segment)
        if not gone:
            self.disable(reason)
            return
        with self._lock:
            stale = [s for s in self._free if s.used]
            self._free[:] = [s for s in self._free if not s.used]  # the finalizer's list
            for s in stale:
                self._retire(s)

    def close(self) -> None:
        self._finalizer()


def remove_orphans(now: float | None = None) -> list[str]:
    """Unlink this user's segments in ``/dev/shm`` whose maker is no longer running and
    that are older than :data:`_ORPHAN_AGE_SEC` (by ``now``, default the time); returns
    their names. A PID of another PID namespace sharing ``/dev/shm`` may look dead here:
    its segment then costs its maker one call through messages (:meth:`SegmentPool.refused`)."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
                    and now - info.st_mtime > _ORPHAN_AGE_SEC):
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone meanwhile
            continue
    if removed:
        logger.info("removed %d shared-memory segments left by processes that ended",
                    len(removed))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_all(free: list[Segment], lent: set[Segment]) -> None:
    for segment in [*free, *lent]:
        segment.unlink()


class SegmentCache:
    """A server's mappings of its callers' segments, by name, the least recently used
    dropped beyond ``max_segments`` or ``max_total_bytes``."""

    def __init__(self, max_bytes: int, *, max_segments: int = 256,
                 max_total_bytes: int | None = None, max_idle_sec: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_bytes = max_bytes
        self._max_segments = max_segments
        self._max_total = max_total_bytes if max_total_bytes is not None else 4 * max_bytes
        self._max_idle_sec = max_idle_sec
        self._clock = clock
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self._last_used: dict[str, float] = {}
        self._total = 0
        self._lock = threading.Lock()

    def get(self, descriptor: Descriptor) -> Segment:
        with self._lock:
            segment = self._segments.get(descriptor.name)
            if segment is not None:
                if not (hmac.compare_digest(segment.descriptor.nonce, descriptor.nonce)
                        and segment.size == descriptor.size):
                    raise ShmError(f"segment {descriptor.name}: nonce or size differ from "
                                   "the segment mapped under that name")
                self._segments.move_to_end(descriptor.name)
                self._last_used[descriptor.name] = self._clock()
                return segment
        segment = Segment.open(descriptor, self._max_bytes)
        now = self._clock()
        with self._lock:
            old = self._segments.pop(descriptor.name, None)
            if old is not None:
                self._total -= old.size
            self._segments[descriptor.name] = segment
            self._last_used[descriptor.name] = now
            self._total += segment.size
            # The least recently used first: beyond the bounds, or idle (a dead NN
            # worker's segments, whose memory the mapping alone keeps).
            while self._segments:
                name, oldest = next(iter(self._segments.items()))
                if (len(self._segments) <= self._max_segments and self._total <= self._max_total
                        and now - self._last_used[name] <= self._max_idle_sec):
                    break
                self._drop(name)
        return segment

    def _drop(self, name: str) -> None:
        """Under the lock: unmapped once no array views it any more."""
        segment = self._segments.pop(name)
        del self._last_used[name]
        self._total -= segment.size

    def forget(self, descriptors: list[Descriptor]) -> None:
        with self._lock:
            for d in descriptors:
                segment = self._segments.get(d.name)
                if segment is not None and hmac.compare_digest(segment.descriptor.nonce, d.nonce):
                    self._drop(d.name)

    def __len__(self) -> int:
        return len(self._segments)
