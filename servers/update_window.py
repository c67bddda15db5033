"""A parameter server's exactly-once window: the ``(worker id, sequence)`` pairs of the
updates it applied, so that a retried update is acknowledged, not applied again.

Every worker id (an embedding worker's random id per process start, or a data loader's
random stream) has a window of its own, bounded: its last :data:`SEEN_PER_WORKER`
sequence numbers. At most :data:`MAX_UPDATE_WORKERS` windows are kept. A window is *live*
while its worker id updated within the last :data:`IDLE_WINDOW_SEC`: retries of its
updates may still come. A new worker id past the cap takes the place of the window idle
longest; when every window is live, the new worker id is refused (FailedPrecondition)
rather than forgetting a live window, since a victim whose window was pushed out would
have its retried updates applied twice, and a caller holding the job's token could push
out any window by updating under a few hundred made-up ids.

A replayed update log (``servers/replica_start.py``) holds only updates the server
accepted when they came; replaying them forgets the least recently updating window
when full, as the running server may have forgotten an idle one.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Callable

import numpy as np

from persia_py.wire.rpc import FailedPrecondition

SEEN_PER_WORKER = 65536
"""How many recent sequence numbers per worker id are remembered."""
MAX_UPDATE_WORKERS = 128
"""How many worker ids the window remembers: bounds its memory at about 128 x 65536
sequence numbers."""
IDLE_WINDOW_SEC = 3600.0
"""A worker id that has not updated for this long may be forgotten for a new one: far
longer than any retry of an update takes (``rpc_timeout_sec``, or an embedding worker
restarted and a batch rerouted to its successor)."""


MAX_WORKER_ID_CHARS = 128
_WORKER_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")


def check_worker_id(worker_id: object, field: str = "worker_id") -> str:
    """``worker_id`` if it is 1 to 128 characters out of letters, digits and ``_.:-`` (not
    starting with ``.``, ``:`` or ``-``); ValueError naming ``field`` otherwise."""
    if (not isinstance(worker_id, str) or not 0 < len(worker_id) <= MAX_WORKER_ID_CHARS
            or not _WORKER_ID.fullmatch(worker_id)):
        shown = worker_id[:MAX_WORKER_ID_CHARS] if isinstance(worker_id, str) else worker_id
        raise ValueError(f"{field}: {shown!r} is not a worker id (1 to {MAX_WORKER_ID_CHARS} "
                         "letters, digits, '_', '.', ':' or '-')")
    return worker_id


class WindowFull(FailedPrecondition):
    """A new worker id came while every remembered one is live."""


class UpdateWindow:
    """The windows of every worker id (thread-safe); see the module docstring."""

    def __init__(self, *, max_workers: int = MAX_UPDATE_WORKERS,
                 idle_sec: float = IDLE_WINDOW_SEC,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_workers = max_workers
        self.idle_sec = idle_sec
        self._clock = clock
        self._lock = threading.Lock()
        # worker id -> its sequence numbers, least recently updating worker id first
        self._seen: collections.OrderedDict[str, collections.OrderedDict[int, None]] = (
            collections.OrderedDict())
        self._last_update: dict[str, float] = {}

    def seen_before(self, worker_id: str, sequence: int, *, replayed: bool = False) -> bool:
        """Whether ``(worker_id, sequence)`` is in the window; remembers it if not.
        WindowFull for a new worker id when every window is live (unless ``replayed``)."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(worker_id)
            if seen is None:
                self._make_room(worker_id, now, replayed)
                seen = self._seen[worker_id] = collections.OrderedDict()
            else:
                self._seen.move_to_end(worker_id)
            self._last_update[worker_id] = now
            if sequence in seen:
                return True
            seen[sequence] = None
            if len(seen) > SEEN_PER_WORKER:
                seen.popitem(last=False)
            return False

    def _make_room(self, worker_id: str, now: float, replayed: bool) -> None:
        """Forget the window idle longest if the window is full; under the lock."""
        if len(self._seen) < self.max_workers:
            return
        oldest = next(iter(self._seen))
        idle = now - self._last_update[oldest]
        if idle < self.idle_sec and not replayed:
            raise WindowFull(
                f"worker id {worker_id[:40]!r}: this parameter server already remembers the "
                f"updates of {self.max_workers} worker ids, each of which updated within the "
                f"last {self.idle_sec:.0f} s (the least recent {idle:.0f} s ago); a new one "
                "is refused rather than forgetting one whose retries may still come. Every "
                "embedding worker start and every data loader stream takes a new id: fewer "
                "of them, or wait until one is idle")
        self._seen.popitem(last=False)
        del self._last_update[oldest]

    def forget(self, worker_id: str, sequence: int) -> None:
        """Take ``(worker_id, sequence)`` out (an update that failed to apply)."""
        with self._lock:
            self._seen.get(worker_id, collections.OrderedDict()).pop(sequence, None)

    def export(self) -> dict[str, np.ndarray]:
        """Worker id -> its remembered sequence numbers (uint64), oldest first; the least
        recently updating worker id first."""
        with self._lock:
            return {w: np.fromiter(seen, dtype=np.uint64, count=len(seen))
                    for w, seen in self._seen.items()}

    def replace(self, windows: collections.OrderedDict[str, collections.OrderedDict]) -> None:
        """Take ``windows`` (checked, from a checkpoint) as the whole window; each counts
        as having updated now."""
        now = self._clock()
        with self._lock:
            self._seen = windows
            self._last_update = dict.fromkeys(windows, now)


def checked_window(windows: object) -> collections.OrderedDict:
    """The exactly-once window ``windows`` describes (worker id -> sequence numbers),
    checked: valid worker ids, at most ``MAX_UPDATE_WORKERS`` of them, each with at most
    ``SEEN_PER_WORKER`` distinct non-negative integer sequence numbers."""
    if not isinstance(windows, dict):
        raise ValueError(f"seen: expected a mapping of worker ids, got {type(windows).__name__}")
    if len(windows) > MAX_UPDATE_WORKERS:
        raise ValueError(f"seen: {len(windows)} worker ids, over the {MAX_UPDATE_WORKERS} "
                         "a replica remembers")
    out: collections.OrderedDict = collections.OrderedDict()
    for worker_id, sequences in windows.items():
        check_worker_id(worker_id, "seen: worker id")
        if (not isinstance(sequences, np.ndarray) or sequences.ndim != 1
                or sequences.dtype not in (np.uint64, np.int64)):
            raise ValueError(f"seen[{worker_id!r}]: expected a 1-D uint64 or int64 array")
        if sequences.dtype == np.int64 and bool((sequences < 0).any()):
            raise ValueError(f"seen[{worker_id!r}]: negative sequence numbers")
        unique = np.unique(sequences.astype(np.uint64))
        if unique.size != sequences.size or unique.size > SEEN_PER_WORKER:
            raise ValueError(f"seen[{worker_id!r}]: {sequences.size} sequence numbers, "
                             f"{unique.size} distinct; at most {SEEN_PER_WORKER}, all distinct")
        out[worker_id] = collections.OrderedDict.fromkeys(unique.tolist())
    return out


__all__ = ["IDLE_WINDOW_SEC", "MAX_UPDATE_WORKERS", "SEEN_PER_WORKER", "UpdateWindow",
           "WindowFull", "check_worker_id", "checked_window"]
