"""``LookupClock``: a table's logical clock, one tick per lookup call, and its expiry sweeps.

Rows are stamped with the clock on every lookup and update (per shard in 2 bytes: see
:mod:`persia_py.servers.access_clock`); LRU eviction and expiry compare stamps. Expiry
is by steps (lookup calls) or seconds: the seconds are turned into a clock cutoff by
remembering when each recent tick happened. Sweeps run once 1/16 of the period has
passed since the last one, so that a sweep (a pass over every shard) is amortized.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

# Expiry sweeps run once 1/_EXPIRE_LAG of the expiry period has passed since the last
# one, so a row goes at most that much later than its period says.
_EXPIRE_LAG = 16


class LookupClock:
    """The clock of one table; thread-safe."""

    def __init__(self, *, expire_after_steps: int | None, expire_after_seconds: float | None,
                 now: Callable[[], float]) -> None:
        self.expire_after_steps = expire_after_steps
        self.expire_after_seconds = expire_after_seconds
        self._value = 0
        self._lock = threading.Lock()
        self._now = now
        self._tick_times: collections.deque[tuple[float, int]] = collections.deque()
        self._seconds_cutoff = 0
        self._last_sweep_tick = 0
        self._last_sweep_time = now()

    def current(self) -> int:
        """The clock now (the last tick given out, or a later value restored)."""
        with self._lock:
            return self._value

    def advance_to(self, value: int) -> None:
        """Run the clock on to ``value`` (kept if it is past that already)."""
        with self._lock:
            self._value = max(self._value, value)

    def tick(self) -> tuple[int, int]:
        """Advance the clock (one step per lookup); returns ``(tick, expiry cutoff)``.

        The cutoff is 0 unless an expiry sweep is due now; then rows last touched
        before it are to be removed.
        """
        with self._lock:
            self._value += 1
            tick = self._value
            cutoff = 0
            due = False
            if self.expire_after_steps is not None:
                cutoff = tick - self.expire_after_steps
                due = tick - self._last_sweep_tick >= max(
                    1, self.expire_after_steps // _EXPIRE_LAG)
            if self.expire_after_seconds is not None:
                now = self._now()
                self._tick_times.append((now, tick))
                horizon = now - self.expire_after_seconds
                while self._tick_times and self._tick_times[0][0] <= horizon:
                    self._seconds_cutoff = self._tick_times.popleft()[1] + 1
                cutoff = max(cutoff, self._seconds_cutoff)
                due = due or now - self._last_sweep_time >= (
                    self.expire_after_seconds / _EXPIRE_LAG)
            if not due or cutoff <= 0:
                return tick, 0
            self._last_sweep_tick = tick
            if self.expire_after_seconds is not None:
                self._last_sweep_time = self._now()
            return tick, cutoff
