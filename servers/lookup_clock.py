"""``LookupClock``: a table's logical clock, one tick per lookup call, and its expiry sweeps.

Rows are stamped with the clock on every lookup and update (per shard in 2 bytes: see
:mod:`persia_py.servers.access_clock`); LRU eviction and expiry compare stamps. Expiry
is by steps (lookup calls) or seconds: the seconds are turned into a clock cutoff by
remembering when recent ticks happened (one tick per 1/1024 of the period: a row may go
that much late, never early, and a long period costs at most ~1024 entries). Sweeps run
once 1/16 of the period has passed since the last one, so that a sweep (a pass over every
shard) is amortized. A table has up to two expiries on one clock: its slot's TTL, and
the TTL of its disk tier (:mod:`persia_py.servers.disk_expiry`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

# Expiry sweeps run once 1/_EXPIRE_LAG of the expiry period has passed since the last
# one, so a row goes at most that much later than its period says.
_EXPIRE_LAG = 16
# Ticks remembered per seconds period: one per 1/_SAMPLES of it.
_SAMPLES = 1024


class _Expiry:
    """One TTL (steps and / or seconds) on a table's clock; its owner holds the lock."""

    def __init__(self, steps: int | None, seconds: float | None, now: float) -> None:
        self.steps = steps
        self.seconds = seconds
        self._tick_times: collections.deque[tuple[float, int]] = collections.deque()
        self._seconds_cutoff = 0
        self._last_sweep_tick = 0
        self._last_sweep_time = now

    def cutoff(self, tick: int, now: Callable[[], float]) -> int:
        """The cutoff of a sweep due at ``tick`` (rows last touched before it go), or 0."""
        cutoff = 0
        due = False
        if self.steps is not None:
            cutoff = tick - self.steps
            due = tick - self._last_sweep_tick >= max(1, self.steps // _EXPIRE_LAG)
        if self.seconds is not None:
            at = now()
            times = self._tick_times
            if not times or at - times[-1][0] >= self.seconds / _SAMPLES:
                times.append((at, tick))
            horizon = at - self.seconds
            while times and times[0][0] <= horizon:
                self._seconds_cutoff = times.popleft()[1] + 1
            cutoff = max(cutoff, self._seconds_cutoff)
            due = due or at - self._last_sweep_time >= self.seconds / _EXPIRE_LAG
        if not due or cutoff <= 0:
            return 0
        self._last_sweep_tick = tick
        if self.seconds is not None:
            self._last_sweep_time = now()
        return cutoff


class LookupClock:
    """The clock of one table; thread-safe."""

    def __init__(self, *, expire_after_steps: int | None, expire_after_seconds: float | None,
                 now: Callable[[], float], disk_expire_after_steps: int | None = None,
                 disk_expire_after_seconds: float | None = None) -> None:
        self.expire_after_steps = expire_after_steps
        self.expire_after_seconds = expire_after_seconds
        self._value = 0
        self._lock = threading.Lock()
        self._now = now
        at = now()
        self._expiry = _Expiry(expire_after_steps, expire_after_seconds, at)
        self._disk_expiry = _Expiry(disk_expire_after_steps, disk_expire_after_seconds, at)

    def current(self) -> int:
        """The clock now (the last tick given out, or a later value restored)."""
        with self._lock:
            return self._value

    def advance_to(self, value: int) -> None:
        """Run the clock on to ``value`` (kept if it is past that already)."""
        with self._lock:
            self._value = max(self._value, value)

    def tick(self) -> tuple[int, int, int]:
        """Advance the clock (one step per lookup); returns ``(tick, expiry cutoff, disk
        expiry cutoff)``.

        A cutoff is 0 unless a sweep of that expiry is due now; then rows last touched
        before it are to be removed (the disk's: rows on disk).
        """
        with self._lock:
            self._value += 1
            tick = self._value
            return (tick, self._expiry.cutoff(tick, self._now),
                    self._disk_expiry.cutoff(tick, self._now))
