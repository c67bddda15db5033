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
Rows removed on the training side (eviction, expiry) since the last export travel in
the increment as removed ids (``ps-<r>-removed<k>.npy``, listed in the manifest) and the
follower removes them too. The manifest also records when it was written
(``created_unix``): the follower's freshness (:meth:`IncrementFollower.age_sec`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persia_py.checkpoint import layout as fmt
from persia_py.ids.routing import RESERVED_ID, replica_of
from persia_py.ops import safe_files
from persia_py.ops.background import BackgroundWorker, Follower, LagWarning, Outage
from persia_py.servers.checkpoint import one_row_dtype, read_replica, read_rows, write_replica
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.replica_state import ReplicaState, Rows

logger = logging.getLogger(__name__)

INCREMENT_FORMAT = "persia_py-increment"
_NAME = re.compile(r"inc-(\d{4})-(\d{12})-[0-9a-f]+")
_COUNT_POLL_SEC = 0.1
"""How often the exporter checks the update count (when exporting by count)."""
FOLLOW_POLL_SEC = 0.5
"""How often a follower looks for new increments."""


def _increments(directory: Path) -> list[tuple[int, int, Path]]:
    """Increments in ``directory`` as (replica, seq, folder), sorted (links are skipped)."""
    found: list[tuple[int, int, Path]] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append((int(match.group(1)), int(match.group(2)), Path(entry.path)))
    return sorted(found)


def _removed_file(replica_index: int, k: int) -> str:
    return f"ps-{replica_index}-removed{k}.npy"


def write_increment(directory: str | Path, replica_index: int, replica_size: int, seq: int,
                    tables: dict[str, Rows], removed: dict[str, np.ndarray] | None = None,
                    *, num_updates: int = 0) -> Path:
    """Write ``tables``' rows and the ids in ``removed`` (by table: rows the training
    side evicted or expired) as increment ``seq`` of replica ``replica_index`` into
    ``directory``; returns its folder. ``num_updates``: update requests the replica had
    applied before its rows were read (a stream position). Crash-safe: written into a
    fresh folder, manifest last, then renamed."""
    r = replica_index
    state = ReplicaState(settings=None, tables=tables, increment_seq=seq)
    removed = {name: ids for name, ids in (removed or {}).items() if ids.shape[0]}
    final = f"inc-{r:04d}-{seq:012d}-{uuid.uuid4().hex[:8]}"
    with safe_files.opened_dir(None, directory) as dir_fd:
        name, fd = safe_files.new_dir_at(dir_fd, mode=0o750)
        try:
            _, num_rows, _ = write_replica(fd, state, r, replica_size)
            removed_files = {}
            for k, (table, ids) in enumerate(sorted(removed.items())):
                file = _removed_file(r, k)
                safe_files.save_array_at(fd, file, np.ascontiguousarray(ids, dtype=np.uint64))
                removed_files[table] = {"file": file, "num_ids": int(ids.shape[0])}
            safe_files.save_json_at(fd, fmt.MANIFEST, {
                "format": INCREMENT_FORMAT, "version": fmt.VERSION, "replica_index": r,
                "seq": seq, "num_rows": num_rows, "created_unix": time.time(),
                "num_updates": int(num_updates), "removed": removed_files})
            os.fsync(fd)
            os.rename(name, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        except BaseException:
            safe_files.remove_flat_dir(dir_fd, name, fd)
            raise
        os.close(fd)
    return Path(directory) / final


def _read_removed(fd: int, manifest: dict, where: str, tables: set[str],
                  keep: tuple[int, int]) -> dict[str, np.ndarray]:
    """The ids an increment says were removed, by table, checked (known tables, plain
    file names, 1-D uint64 arrays of the length stated, no reserved id), keeping those
    that route to replica ``keep[0]`` of ``keep[1]``. Older increments have none."""
    entries = manifest.get("removed", {})
    if not isinstance(entries, dict):
        raise safe_files.CheckpointError(f"{where}: 'removed' must map table names to files")
    out = {}
    for table, entry in entries.items():
        if table not in tables:
            raise safe_files.CheckpointError(f"{where}: removed ids of table {table!r}, which is "
                                      f"not on this server ({sorted(tables)})")
        at = f"{where}: removed ids of table {table!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("num_ids"), int):
            raise safe_files.CheckpointError(f"{at}: expected {{'file': name, 'num_ids': n}}")
        file = safe_files.check_name(entry.get("file"), f"{at}: file")
        ids = safe_files.load_array_at(fd, file, mmap=True)  # nothing read before the checks
        if ids.dtype != np.uint64 or ids.shape != (entry["num_ids"],):
            raise safe_files.CheckpointError(f"{at}: {file} holds {ids.dtype} {ids.shape}, the "
                                      f"manifest says uint64 ({entry['num_ids']},)")
        ids = np.array(ids)
        if bool((ids == RESERVED_ID).any()):
            raise safe_files.CheckpointError(f"{at}: {file} holds the reserved id 2**64-1")
        if keep[1] > 1:
            ids = ids[replica_of(ids, keep[1]) == keep[0]]
        out[table] = ids
    return out


def apply_increment(ps: ParameterServer, folder: str | Path, replica: int) -> tuple[int, dict]:
    """Store the rows of increment ``folder`` (of source ``replica``) that route to ``ps``
    and remove the rows it says the training side removed; every file is read and
    checked before any row is stored. Returns (rows stored, the increment's manifest)."""
    where = f"{folder}"
    with safe_files.opened_dir(None, folder) as fd:
        manifest = fmt.check_manifest(safe_files.load_json_at(fd, fmt.MANIFEST), where,
                                      INCREMENT_FORMAT)
        entry = read_replica(fd, replica)
        keep = (ps.replica_index, ps.replica_size)
        rows = {name: read_rows(fd, table, f"{folder}: table {name!r}", keep=keep)
                for name, table in entry["tables"].items()}
        removed = _read_removed(fd, manifest, where, set(ps.embedding_config.tables), keep)
    created = manifest.get("created_unix")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(
            created):
        raise safe_files.CheckpointError(f"{where}: 'created_unix' must be a finite number")
    # Rows and removed ids are disjoint (taken together under each shard's lock); removing
    # first makes room, as eviction did on the training side. A retry after a failure
    # removes and stores the same again.
    return ps.apply_increment(removed, rows), manifest


def _merge(new: dict[str, Rows], old: dict[str, Rows]) -> dict[str, Rows]:
    """Rows of ``new`` and ``old`` by table; where both hold an id, ``new``'s row."""
    out = dict(new)
    for name, rows in old.items():
        if name not in out:
            out[name] = rows
            continue
        pair, row_dtype = one_row_dtype([out[name], rows])
        both = {k: np.concatenate([pair[0][k], pair[1][k]])
                for k in ("ids", "weights", "state", "last_access")}
        _, first = np.unique(both["ids"], return_index=True)  # new rows come first
        merged: dict[str, object] = {k: a[first] for k, a in both.items()}
        merged["clock"] = max(out[name]["clock"], rows["clock"])
        merged["row_dtype"] = row_dtype
        out[name] = merged
    return out


def _merge_changes(new: tuple[dict[str, Rows], dict[str, np.ndarray]],
                   old: tuple[dict[str, Rows], dict[str, np.ndarray]]
                   ) -> tuple[dict[str, Rows], dict[str, np.ndarray]]:
    """Pending changes ``old`` followed by ``new`` as one: an id stored again since it was
    removed is a row, an id removed since its row was taken is a removal."""
    new_rows, new_removed = new
    old_rows, old_removed = old
    rows = _merge(new_rows, old_rows)
    removed = {}
    for name in set(new_removed) | set(old_removed):
        empty = np.zeros(0, np.uint64)
        again = new_rows[name]["ids"] if name in new_rows else empty
        earlier = old_removed.get(name, empty)
        removed[name] = np.union1d(earlier[~np.isin(earlier, again)],
                                   new_removed.get(name, empty))
        if name in rows and removed[name].shape[0]:
            kept = ~np.isin(rows[name]["ids"], removed[name])
            rows[name] = {k: (v[kept] if isinstance(v, np.ndarray) else v)
                          for k, v in rows[name].items()}
    return rows, removed


class IncrementalExporter(BackgroundWorker):
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
            fmt.names_in_root(safe_files.configured_root(root), directory,
                              "checkpoint_config.incremental_dir")
        self.ps, self.directory = ps, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_updates, self.every_sec = every_updates, every_sec
        mine = [seq for r, seq, _ in _increments(self.directory) if r == ps.replica_index]
        ps.increment_seq = max(mine, default=0)
        self._lock = threading.Lock()
        self._pending: tuple[dict[str, Rows], dict[str, np.ndarray]] = ({}, {})
        """Rows and removed ids taken from the change logs and not yet written in an
        increment."""
        self.outage = Outage(f"incremental export of replica {ps.replica_index} to "
                              f"{self.directory}", on_failure)
        ps.track_changes()

    def export_now(self) -> Path | None:
        """Write an increment now (None: no row changed since the last one). On failure
        the rows stay pending for the next attempt and the error is raised."""
        with self._lock:
            num_updates = self.ps.num_updates  # before the rows: they hold these updates
            self._pending = _merge_changes(self.ps.changed_rows(), self._pending)
            rows, removed = self._pending
            if not (any(t["ids"].shape[0] for t in rows.values())
                    or any(ids.shape[0] for ids in removed.values())):
                self._pending = ({}, {})
                return None
            seq = self.ps.increment_seq + 1
            final = write_increment(self.directory, self.ps.replica_index,
                                    self.ps.replica_size, seq, rows, removed,
                                    num_updates=num_updates)
            self._pending = ({}, {})
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


class IncrementFollower(Follower):
    """Applies the increments in ``directory`` to a serving replica as they appear.

    ``after``: per source replica, the last sequence number already in the rows (the base
    checkpoint's ``increment_seq``; see :func:`base_increment_seqs`). An increment that
    cannot be applied is retried with backoff (logged once, counted by ``on_failure``);
    the replica serves meanwhile. ``warn_after_sec``: log a WARNING when the newest
    applied increment gets older than this (None: never).
    """

    def __init__(self, ps: ParameterServer, directory: str | Path, *,
                 after: dict[int, int] | None = None, poll_sec: float = FOLLOW_POLL_SEC,
                 on_failure: Callable[[], None] | None = None,
                 warn_after_sec: float | None = None) -> None:
        super().__init__(
            f"increment-follower-{ps.replica_index}", poll_sec,
            Outage(f"applying increments from {directory} to serving replica "
                   f"{ps.replica_index}", on_failure),
            LagWarning(f"serving replica {ps.replica_index}: its newest applied increment",
                       warn_after_sec))
        self.ps, self.directory = ps, Path(directory)
        self.applied: dict[int, int] = dict(after or {})
        self.created_unix: dict[int, float] = {}
        """Per source replica, when its newest applied increment was written."""
        self.num_applied = 0
        self._changed = threading.Condition()

    def age_sec(self) -> float | None:
        """Seconds since the newest applied increment was written (of the source replica
        that is furthest behind); None until one is applied."""
        with self._changed:
            if not self.created_unix:
                return None
            oldest = min(self.created_unix.values())
        return max(0.0, time.time() - oldest)

    def apply_new(self) -> int:
        """Apply every increment not yet applied, in order; returns how many. Raises on
        the first that cannot be applied (those before it stay applied)."""
        count = 0
        for replica, seq, folder in _increments(self.directory):
            if seq != self.applied.get(replica, 0) + 1:
                continue  # applied already (or its predecessor is not there yet)
            num_rows, manifest = apply_increment(self.ps, folder, replica)
            with self._changed:
                self.applied[replica] = seq
                self.created_unix[replica] = float(manifest["created_unix"])
                self.num_applied += 1
                self._changed.notify_all()
            logger.info("replica %d applied increment %d of replica %d (%d rows, %d removed "
                        "ids)", self.ps.replica_index, seq, replica, num_rows,
                        sum(e["num_ids"] for e in manifest.get("removed", {}).values()))
            count += 1
        return count

    def wait_applied(self, replica: int, seq: int, timeout: float) -> bool:
        """Wait until increment ``seq`` of source ``replica`` is applied."""
        with self._changed:
            return self._changed.wait_for(lambda: self.applied.get(replica, 0) >= seq, timeout)

    poll_once = apply_new


def base_increment_seqs(checkpoint: str | Path) -> dict[int, int]:
    """Per replica, the last increment exported before checkpoint ``checkpoint`` was taken."""
    folder = fmt.resolve(checkpoint)
    with safe_files.opened_dir(None, folder) as fd:
        manifest = safe_files.load_json_at(fd, fmt.MANIFEST)
        return {r: int(read_replica(fd, r).get("increment_seq", 0))
                for r in range(int(manifest["num_ps_replicas"]))}


def increment_folders(directory: str | Path) -> list[tuple[int, int, Path]]:
    """Every increment in ``directory`` as (source replica, seq, folder), in order."""
    return _increments(Path(directory))


def newest_increments(directory: str | Path) -> dict[int, int]:
    """Per source replica, the largest sequence number in ``directory``."""
    out: dict[int, int] = {}
    for replica, seq, _ in _increments(Path(directory)):
        out[replica] = max(out.get(replica, 0), seq)
    return out


__all__ = ["IncrementalExporter", "IncrementFollower", "apply_increment",
           "base_increment_seqs", "increment_folders", "newest_increments", "write_increment"]
