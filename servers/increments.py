"""Incremental exports of a training parameter server, and a serving replica following them.

A training replica with ``checkpoint_config.incremental_dir`` set tracks the rows that
lookups insert and updates change (a per-shard log of ids, vectorized) and, every
``incremental_every_updates`` applied updates or ``incremental_every_sec`` seconds,
writes the rows changed since its last export as one *increment*::

    DIR/inc-<replica:04d>-<seq:012d>-<id>/
      manifest.json                   # written last: format, replica, seq
      ps-<r>.json                     # like a checkpoint's: tables and files
      ps-<r>-t<k>-{ids,weights,state,last_access}.npy

in the checkpoint format, by the checkpoint's own writer
(:func:`persia_py.servers.checkpoint.write_replica`): into a folder the server makes
itself in DIR (a random name), new files only, fsync'd, manifest last, then renamed.
``DIR`` is the checkpoint root or a folder directly in it. Sequence numbers of a replica
count 1, 2, ... (continuing after the largest already in DIR when a replica restarts). A
checkpoint records, per replica, the sequence number of the last increment exported
before it (``increment_seq`` in ``ps-<r>.json``).

**Failures never lose rows nor stop training.** Rows taken from the change log stay
pending in the exporter until an increment holding them is written; a failed write
(full disk, a folder gone) is retried with backoff, logged once per outage, and counted
(``persia_ps_increment_failures_total{kind="export"}``). The follower does the same
with increments it cannot apply (``kind="apply"``), and keeps serving meanwhile.

A serving replica (inference mode) loads a base checkpoint, then a follower thread polls
DIR and applies, in order per source replica, every increment after the one the base
recorded: each row overwrites (or adds) the stored one, re-sharded like a checkpoint's.
Rows removed on the training side (eviction, expiry) are not removed on the serving side.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persia_py import checkpoint_format as fmt
from persia_py.servers.checkpoint import read_replica, read_rows, write_replica
from persia_py.servers.parameter_server import ParameterServer, ReplicaState, Rows

logger = logging.getLogger(__name__)

INCREMENT_FORMAT = "persia_py-increment"
_NAME = re.compile(r"inc-(\d{4})-(\d{12})-[0-9a-f]+")
_COUNT_POLL_SEC = 0.1
"""How often the exporter checks the update count (when exporting by count)."""
FOLLOW_POLL_SEC = 0.5
"""How often a follower looks for new increments."""
RETRY_MIN_SEC, RETRY_MAX_SEC = 0.2, 30.0
"""Backoff between attempts after a failed export or apply (doubling)."""


def _increments(directory: Path) -> list[tuple[int, int, Path]]:
    """Increments in ``directory`` as (replica, seq, folder), sorted (links are skipped)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append((int(match.group(1)), int(match.group(2)), Path(entry.path)))
    return sorted(found)


def write_increment(directory: str | Path, replica_index: int, replica_size: int, seq: int,
                    tables: dict[str, Rows]) -> Path:
    """Write ``tables``' rows as increment ``seq`` of replica ``replica_index`` into
    ``directory``; returns its folder. Crash-safe: written into a fresh folder, manifest
    last, then renamed."""
    r = replica_index
    state = ReplicaState(settings=None, tables=tables, increment_seq=seq)
    final = f"inc-{r:04d}-{seq:012d}-{uuid.uuid4().hex[:8]}"
    with fmt.opened_dir(None, directory) as dir_fd:
        name, fd = fmt.new_dir_at(dir_fd, mode=0o750)
        try:
            _, num_rows, _ = write_replica(fd, state, r, replica_size)
            fmt.save_json_at(fd, fmt.MANIFEST, {
                "format": INCREMENT_FORMAT, "version": fmt.VERSION, "replica_index": r,
                "seq": seq, "num_rows": num_rows, "created_unix": time.time()})
            os.fsync(fd)
            os.rename(name, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        except BaseException:
            fmt.remove_flat_dir(dir_fd, name, fd)
            raise
        os.close(fd)
    return Path(directory) / final


def apply_increment(ps: ParameterServer, folder: str | Path, replica: int) -> int:
    """Store the rows of increment ``folder`` (of source ``replica``) that route to ``ps``;
    every file is read and checked before any row is stored."""
    with fmt.opened_dir(None, folder) as fd:
        fmt.check_manifest(fmt.load_json_at(fd, fmt.MANIFEST), f"{folder}", INCREMENT_FORMAT)
        entry = read_replica(fd, replica)
        rows = {name: read_rows(fd, table, f"{folder}: table {name!r}",
                                keep=(ps.replica_index, ps.replica_size))
                for name, table in entry["tables"].items()}
    return ps.apply_rows(rows)


def _merge(new: dict[str, Rows], old: dict[str, Rows]) -> dict[str, Rows]:
    """Rows of ``new`` and ``old`` by table; where both hold an id, ``new``'s row."""
    out = dict(new)
    for name, rows in old.items():
        if name not in out:
            out[name] = rows
            continue
        both = {k: np.concatenate([out[name][k], rows[k]])
                for k in ("ids", "weights", "state", "last_access")}
        _, first = np.unique(both["ids"], return_index=True)  # new rows come first
        merged = {k: a[first] for k, a in both.items()}
        merged["clock"] = max(out[name]["clock"], rows["clock"])
        out[name] = merged
    return out


class _Outage:
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


class _Worker:
    """A thread owned by its creator: started by ``start``, stopped and joined by ``close``,
    which re-raises the error that stopped it, if any."""

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


class IncrementalExporter(_Worker):
    """Writes increments of ``ps`` into ``directory`` by update count and/or time.

    ``root``: the server's checkpoint root; ``directory`` must lie in it (ROOT/NAME or
    ROOT/NAME/NAME). ``on_failure`` is called on every failed export (a metric).
    """

    def __init__(self, ps: ParameterServer, directory: str | Path, *, every_updates: int = 0,
                 every_sec: float = 0.0, root: str | Path | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        if not (every_updates or every_sec):
            raise ValueError("set every_updates or every_sec (> 0)")
        super().__init__(f"incremental-exporter-{ps.replica_index}")
        if root is not None:
            fmt.names_in_root(fmt.configured_root(root), directory,
                              "checkpoint_config.incremental_dir")
        self.ps, self.directory = ps, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_updates, self.every_sec = every_updates, every_sec
        mine = [seq for r, seq, _ in _increments(self.directory) if r == ps.replica_index]
        ps.increment_seq = max(mine, default=0)
        self._lock = threading.Lock()
        self._pending: dict[str, Rows] = {}
        """Rows taken from the change log and not yet written in an increment."""
        self.outage = _Outage(f"incremental export of replica {ps.replica_index} to "
                              f"{self.directory}", on_failure)
        ps.track_changes()

    def export_now(self) -> Path | None:
        """Write an increment now (None: no row changed since the last one). On failure
        the rows stay pending for the next attempt and the error is raised."""
        with self._lock:
            self._pending = rows = _merge(self.ps.changed_rows(), self._pending)
            if not any(t["ids"].shape[0] for t in rows.values()):
                self._pending = {}
                return None
            seq = self.ps.increment_seq + 1
            final = write_increment(self.directory, self.ps.replica_index,
                                    self.ps.replica_size, seq, rows)
            self._pending = {}
            self.ps.increment_seq = seq
            logger.info("replica %d exported increment %d to %s", self.ps.replica_index,
                        seq, final)
            return final

    def _loop(self) -> None:
        poll = min(self.every_sec or float("inf"),
                   _COUNT_POLL_SEC if self.every_updates else float("inf"))
        last_updates, last_time = self.ps.num_updates, time.monotonic()
        while not self._stop.wait(self.outage.delay if self.outage.failing else poll):
            if not self.ps.configured:
                continue
            due_count = (self.every_updates
                         and self.ps.num_updates - last_updates >= self.every_updates)
            due_time = self.every_sec and time.monotonic() - last_time >= self.every_sec
            if due_count or due_time or self.outage.failing:
                last_updates, last_time = self.ps.num_updates, time.monotonic()
                self.outage.attempt(self.export_now)


class IncrementFollower(_Worker):
    """Applies the increments in ``directory`` to a serving replica as they appear.

    ``after``: per source replica, the last sequence number already in the rows (the base
    checkpoint's ``increment_seq``; see :func:`base_increment_seqs`). An increment that
    cannot be applied is retried with backoff (logged once, counted by ``on_failure``);
    the replica serves meanwhile.
    """

    def __init__(self, ps: ParameterServer, directory: str | Path, *,
                 after: dict[int, int] | None = None, poll_sec: float = FOLLOW_POLL_SEC,
                 on_failure: Callable[[], None] | None = None) -> None:
        super().__init__(f"increment-follower-{ps.replica_index}")
        self.ps, self.directory, self.poll_sec = ps, Path(directory), poll_sec
        self.applied: dict[int, int] = dict(after or {})
        self._changed = threading.Condition()
        self.outage = _Outage(f"applying increments from {self.directory} to serving replica "
                              f"{ps.replica_index}", on_failure)

    def apply_new(self) -> int:
        """Apply every increment not yet applied, in order; returns how many. Raises on
        the first that cannot be applied (those before it stay applied)."""
        count = 0
        for replica, seq, folder in _increments(self.directory):
            if seq != self.applied.get(replica, 0) + 1:
                continue  # applied already (or its predecessor is not there yet)
            num_rows = apply_increment(self.ps, folder, replica)
            with self._changed:
                self.applied[replica] = seq
                self._changed.notify_all()
            logger.info("replica %d applied increment %d of replica %d (%d rows)",
                        self.ps.replica_index, seq, replica, num_rows)
            count += 1
        return count

    def wait_applied(self, replica: int, seq: int, timeout: float) -> bool:
        """Wait until increment ``seq`` of source ``replica`` is applied."""
        with self._changed:
            return self._changed.wait_for(lambda: self.applied.get(replica, 0) >= seq, timeout)

    def _loop(self) -> None:
        while True:
            self.outage.attempt(self.apply_new)
            if self._stop.wait(self.outage.delay if self.outage.failing else self.poll_sec):
                return


def base_increment_seqs(checkpoint: str | Path) -> dict[int, int]:
    """Per replica, the last increment exported before checkpoint ``checkpoint`` was taken."""
    folder = fmt.resolve(checkpoint)
    with fmt.opened_dir(None, folder) as fd:
        manifest = fmt.load_json_at(fd, fmt.MANIFEST)
        return {r: int(read_replica(fd, r).get("increment_seq", 0))
                for r in range(int(manifest["num_ps_replicas"]))}


def newest_increments(directory: str | Path) -> dict[int, int]:
    """Per source replica, the largest sequence number in ``directory``."""
    out: dict[int, int] = {}
    for replica, seq, _ in _increments(Path(directory)):
        out[replica] = max(out.get(replica, 0), seq)
    return out


__all__ = ["IncrementalExporter", "IncrementFollower", "apply_increment",
           "base_increment_seqs", "newest_increments", "write_increment"]
