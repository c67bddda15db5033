"""A byte budget: the rate limiter of a pipeline stage.

A stage holds at most ``capacity`` bytes of data it produced and has not yet handed on.
A producer asks for room before keeping more and waits while the stage is full
(backpressure); nothing is ever dropped. One item larger than the whole budget is let in
when the stage holds nothing, so an oversized batch slows the pipeline but cannot stall it.
"""

from __future__ import annotations

import threading


class ByteBudget:
    """At most ``capacity`` bytes held; ``acquire`` waits for room, ``release`` gives it back."""

    def __init__(self, capacity: int, what: str) -> None:
        if capacity < 1:
            raise ValueError(f"{what}: byte budget must be >= 1, got {capacity}")
        self.capacity = capacity
        self.what = what
        self._used = 0
        self._peak = 0
        self._changed = threading.Condition()

    def _fits(self, num_bytes: int) -> bool:
        return self._used + num_bytes <= self.capacity or self._used == 0

    def try_acquire(self, num_bytes: int, timeout: float = 0.0) -> bool:
        """Take ``num_bytes`` if they fit within ``timeout`` seconds; False otherwise."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._fits(num_bytes), timeout=timeout):
                return False
            self._used += num_bytes
            self._peak = max(self._peak, self._used)
            return True

    def acquire(self, num_bytes: int, stop: threading.Event) -> bool:
        """Wait until ``num_bytes`` fit (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            if self.try_acquire(num_bytes, timeout=0.2):
                return True
        return False

    def release(self, num_bytes: int) -> None:
        with self._changed:
            self._used -= num_bytes
            assert self._used >= 0, f"{self.what}: released more bytes than held"
            self._changed.notify_all()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        """Most bytes held at once (at most ``capacity`` unless one item alone exceeded it)."""
        return self._peak
