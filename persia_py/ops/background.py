"""Background jobs that retry: a thread owned by its creator, and the bookkeeping of an
outage (log once, count every failure, back off).

Used by the incremental exporter and follower of the parameter servers
(:mod:`persia_py.servers.increments`) and by the dense-model exporter and follower
(:mod:`persia_py.checkpoint.dense_export`): a failed write or read is retried with backoff and
never stops training or serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

RETRY_MIN_SEC, RETRY_MAX_SEC = 0.2, 30.0
"""Backoff between attempts after a failure (doubling)."""


class Outage:
    """Failures of one background job, logged once per outage (a WARNING with the first
    error, an INFO when it works again) and counted (``on_failure``)."""

    def __init__(self, what: str, on_failure: Callable[[], None] | None) -> None:
        self.what, self.on_failure = what, on_failure
        self.num_failures = 0
        self._since: float | None = None
        self.delay = RETRY_MIN_SEC

    def attempt(self, work: Callable[[], object]) -> None:
        """Run ``work``; an error is logged (once per outage) and counted, never raised:
        the caller tries again after ``delay``."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - retried; training or serving goes on
            self.failed(exc)
        else:
            self.recovered()

    def failed(self, exc: BaseException) -> None:
        self.num_failures += 1
        if self.on_failure is not None:
            self.on_failure()
        if self._since is None:
            self._since = time.monotonic()
            logger.warning("%s failed (%s: %s); retrying with backoff, nothing is lost",
                           self.what, type(exc).__name__, exc)
        else:
            self.delay = min(self.delay * 2, RETRY_MAX_SEC)

    def recovered(self) -> None:
        if self._since is not None:
            logger.info("%s works again after %.1f s", self.what, time.monotonic() - self._since)
            self._since, self.delay = None, RETRY_MIN_SEC

    @property
    def failing(self) -> bool:
        return self._since is not None


class BackgroundWorker:
    """A thread owned by its creator: started by ``start``, stopped and joined by ``close``,
    which re-raises the error that stopped it, if any. Subclasses write ``_loop``, which
    returns once ``_stop`` is set."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self):
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced by close()
            logger.exception("%s stopped", self._thread.name)
            self.error = exc

    def _loop(self) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"{self._thread.name} failed: {self.error}") from self.error


class LagWarning:
    """Logs a WARNING when a follower's copy gets older than ``warn_after_sec`` (once per
    episode) and an INFO when it is fresh again; ``None`` never warns."""

    def __init__(self, what: str, warn_after_sec: float | None) -> None:
        self.what, self.warn_after_sec = what, warn_after_sec
        self.behind = False

    def check(self, age_sec: float | None, detail: str = "") -> None:
        """Compare ``age_sec`` (None: nothing applied yet) with the threshold."""
        if self.warn_after_sec is None or age_sec is None:
            return
        if age_sec > self.warn_after_sec and not self.behind:
            self.behind = True
            logger.warning("%s is %.1f s old, over %.1f s (2 x its export interval): serving "
                           "falls behind%s", self.what, age_sec, self.warn_after_sec, detail)
        elif age_sec <= self.warn_after_sec and self.behind:
            self.behind = False
            logger.info("%s is fresh again (%.1f s old)", self.what, age_sec)


class Follower(BackgroundWorker):
    """A thread that polls for new versions of something (``poll_once``) every
    ``poll_sec``, backs off while that fails (``outage``) and warns when its copy gets old
    (``lag``, from ``age_sec``). Subclasses write ``poll_once`` and ``age_sec``."""

    def __init__(self, name: str, poll_sec: float, outage: Outage, lag: LagWarning) -> None:
        super().__init__(name)
        self.poll_sec, self.outage, self.lag = poll_sec, outage, lag

    def poll_once(self) -> object:
        raise NotImplementedError

    def age_sec(self) -> float | None:
        raise NotImplementedError

    def _loop(self) -> None:
        while True:
            self.outage.attempt(self.poll_once)
            self.lag.check(self.age_sec())
            if self._stop.wait(self.outage.delay if self.outage.failing else self.poll_sec):
                return
