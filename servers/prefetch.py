"""``Prefetcher``: rows that will be looked up soon, brought from disk to RAM off the
lookup's path (issue 42).

An embedding worker knows a batch's ids as soon as a data loader puts the batch, up to
``forward_buffer_size`` batches before the NN worker looks it up (and ``embedding_staleness``
batches train meanwhile). With a disk tier on, it then sends every parameter-server
replica a ``Prefetch`` with the batch's ids per table; the replica answers at once and
one background thread per server brings the rows those ids have on disk back into RAM
(:meth:`persia_py.servers.shard.Shard.prefetch`), so that the lookup finds them there. A
lookup waits on disk only for what the thread has not reached yet: when the pipeline is
empty (a batch looked up as soon as it is put), or when the disk cannot keep up.

A hint is advisory: ids stored nowhere are not created (the lookup inserts them), and a
hint that finds ``max_pending`` hints still queued is not queued but counted
(:attr:`Prefetcher.num_dropped`): the lookup then reads those rows itself, as without
prefetch. Prefetch moves rows between disk and RAM only: values, the update log and
checkpoints are untouched by it. It reads the disk with the shard's lock released
(:mod:`persia_py.servers.tier_reads`), so the updates of the batches training meanwhile
go on; a lookup waits for a read in flight instead of reading the same rows again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from persia_py.servers.storage import EmbeddingTable
from persia_py.servers.swap_lock import SwapLock

__all__ = ["Prefetcher", "serve_hint"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """One background thread running queued prefetch work (each returns rows moved)."""

    def __init__(self, max_pending: int = 16) -> None:
        self._queue: queue.Queue[Callable[[], int] | None] = queue.Queue(max_pending)
        self.num_queued = 0
        """Hints queued."""
        self.num_dropped = 0
        """Hints not queued: ``max_pending`` were waiting."""
        self.num_rows = 0
        """Rows brought back to RAM by hints."""
        self.num_served = 0
        """Hints served (or failed, logged)."""
        self._served = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ps-prefetch", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], int]) -> bool:
        """Queue ``work``; False (counted) if ``max_pending`` are waiting."""
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            self.num_dropped += 1
            return False
        self.num_queued += 1
        return True

    def wait(self, served: int, timeout: float) -> bool:
        """Wait until ``served`` hints have been served in all; False on ``timeout``
        seconds (tests and benchmarks)."""
        with self._served:
            return self._served.wait_for(lambda: self.num_served >= served, timeout)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                self.num_rows += work()
            except Exception:  # a hint only: the lookup reads the rows itself
                logger.exception("prefetch failed; the lookups will read those rows")
            with self._served:
                self.num_served += 1
                self._served.notify_all()

    def close(self) -> None:
        """Serve what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()


def serve_hint(tables: list[EmbeddingTable], ids: list[np.ndarray], lock: SwapLock) -> int:
    """Bring the rows of ``ids[i]`` on ``tables[i]``'s disk tier back into RAM, holding
    ``lock`` shared as lookups do; returns how many came back."""
    with lock.shared():
        return sum(table.prefetch(i) for table, i in zip(tables, ids))
