"""A shared/exclusive lock: many holders share it, one holder excludes all others.

A serving replica's lookups share it and an incremental export is applied holding it
alone, so a lookup sees an increment wholly or not at all (its removed ids and its new
rows are two passes over the tables). A waiting exclusive holder keeps new shared holders
out, so a steady stream of lookups cannot starve an increment.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class SwapLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


__all__ = ["SwapLock"]
