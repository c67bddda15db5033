"""Incremental exports of a training parameter server, and a serving replica following them.

A training replica with ``checkpoint_config.incremental_dir`` set tracks the rows that
lookups insert and updates change (a per-shard log of ids, vectorized) and, every
``incremental_every_updates`` applied updates or ``incremental_every_sec`` seconds,
writes the rows changed since its last export as one *increment*::

    DIR/inc-<replica:04d>-<seq:012d>-<id>/
      manifest.json                   # written last: format, replica, seq
      ps-<r>.json                     # like a checkpoint's: settings, tables and files
      ps-<r>-t<k>-{ids,weights,state,last_access}.npy

in the checkpoint format (``.npy`` + JSON, written into ``DIR/tmp-<uuid>``, fsync'd,
manifest last, then renamed). Sequence numbers of a replica count 1, 2, ... (continuing
after the largest already in DIR when a replica restarts). A checkpoint records, per
replica, the sequence number of the last increment exported before it
(``increment_seq`` in ``ps-<r>.json``).

A serving replica (inference mode) loads a base checkpoint, then a follower thread polls
DIR and applies, in order per source replica, every increment after the one the base
recorded: each row overwrites (or adds) the stored one, re-sharded like a checkpoint's.
Rows removed on the training side (eviction, expiry) are not removed on the serving side.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from pathlib import Path

from persia_py import checkpoint_format as fmt
from persia_py.routing import replica_of
from persia_py.servers.parameter_server import ParameterServer

logger = logging.getLogger(__name__)

INCREMENT_FORMAT = "persia_py-increment"
_NAME = re.compile(r"^inc-(\d{4})-(\d{12})-[0-9a-f]+$")
_COUNT_POLL_SEC = 0.1
"""How often the exporter checks the update count (when exporting by count)."""
FOLLOW_POLL_SEC = 0.5
"""How often a follower looks for new increments."""


def _increments(directory: Path) -> list[tuple[int, int, Path]]:
    """Complete increments in ``directory`` as (replica, seq, folder), sorted."""
    found = []
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match and (path / fmt.MANIFEST).is_file():
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found)


def write_increment(ps: ParameterServer, directory: str | Path, seq: int) -> Path | None:
    """Write the rows of ``ps`` changed since the last call as increment ``seq``; None
    (nothing written) when no row changed."""
    directory = Path(directory)
    r = ps.replica_index
    changed = {name: table.export_changed_rows() for name, table in sorted(ps._tables.items())}
    if not any(rows["ids"].shape[0] for rows in changed.values()):
        return None
    tmp = fmt.new_tmp_dir(directory)
    tables, num_rows = {}, 0
    for t, (name, rows) in enumerate(changed.items()):
        table = ps._tables[name]
        files = {}
        for key in ("ids", "weights", "state", "last_access"):
            files[key] = f"ps-{r}-t{t}-{key}.npy"
            fmt.save_array(tmp / files[key], rows[key])
        num_rows += rows["ids"].shape[0]
        tables[name] = {"dim": table.dim, "state_width": table.state_width,
                        "num_rows": int(rows["ids"].shape[0]), "clock": rows["clock"],
                        "files": files}
    fmt.save_json(tmp / f"ps-{r}.json", {"replica_index": r, "replica_size": ps.replica_size,
                                         "tables": tables})
    fmt.save_json(tmp / fmt.MANIFEST, {"format": INCREMENT_FORMAT, "version": fmt.VERSION,
                                       "replica_index": r, "seq": seq, "num_rows": num_rows,
                                       "created_unix": time.time()})
    fmt.fsync_dir(tmp)
    final = directory / f"inc-{r:04d}-{seq:012d}-{uuid.uuid4().hex[:8]}"
    tmp.rename(final)
    fmt.fsync_dir(directory)
    return final


def apply_increment(ps: ParameterServer, folder: Path, replica: int) -> int:
    """Store the rows of increment ``folder`` (of source ``replica``) that route to ``ps``."""
    entry = fmt.load_json(folder / f"ps-{replica}.json")
    num_rows = 0
    for name, table_entry in entry["tables"].items():
        table = ps._tables.get(name)
        if table is None:
            raise fmt.CheckpointError(f"increment {folder} has table {name!r}, which this "
                                      "server lacks")
        arrays = {k: fmt.load_array(folder / f) for k, f in table_entry["files"].items()}
        if ps.replica_size > 1:
            mine = replica_of(arrays["ids"], ps.replica_size) == ps.replica_index
            arrays = {k: a[mine] for k, a in arrays.items()}
        table.import_rows(arrays["ids"], arrays["weights"], arrays["state"],
                          arrays["last_access"], table_entry["clock"])
        num_rows += arrays["ids"].shape[0]
    return num_rows


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
    """Writes increments of ``ps`` into ``directory`` by update count and/or time."""

    def __init__(self, ps: ParameterServer, directory: str | Path, *, every_updates: int = 0,
                 every_sec: float = 0.0) -> None:
        if not (every_updates or every_sec):
            raise ValueError("set every_updates or every_sec (> 0)")
        super().__init__(f"incremental-exporter-{ps.replica_index}")
        self.ps, self.directory = ps, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_updates, self.every_sec = every_updates, every_sec
        mine = [seq for r, seq, _ in _increments(self.directory) if r == ps.replica_index]
        ps.increment_seq = max(mine, default=0)
        self._lock = threading.Lock()
        ps.track_changes()

    def export_now(self) -> Path | None:
        """Write an increment now (None: no row changed since the last one)."""
        with self._lock:
            final = write_increment(self.ps, self.directory, self.ps.increment_seq + 1)
            if final is not None:
                self.ps.increment_seq += 1
                logger.info("replica %d exported increment %d to %s", self.ps.replica_index,
                            self.ps.increment_seq, final)
            return final

    def _loop(self) -> None:
        poll = min(self.every_sec or float("inf"),
                   _COUNT_POLL_SEC if self.every_updates else float("inf"))
        last_updates, last_time = self.ps.num_updates, time.monotonic()
        while not self._stop.wait(poll):
            if not self.ps.configured:
                continue
            due_count = (self.every_updates
                         and self.ps.num_updates - last_updates >= self.every_updates)
            due_time = self.every_sec and time.monotonic() - last_time >= self.every_sec
            if due_count or due_time:
                last_updates, last_time = self.ps.num_updates, time.monotonic()
                self.export_now()


class IncrementFollower(_Worker):
    """Applies the increments in ``directory`` to a serving replica as they appear.

    ``after``: per source replica, the last sequence number already in the rows (the base
    checkpoint's ``increment_seq``; see :func:`base_increment_seqs`).
    """

    def __init__(self, ps: ParameterServer, directory: str | Path, *,
                 after: dict[int, int] | None = None, poll_sec: float = FOLLOW_POLL_SEC) -> None:
        super().__init__(f"increment-follower-{ps.replica_index}")
        self.ps, self.directory, self.poll_sec = ps, Path(directory), poll_sec
        self.applied: dict[int, int] = dict(after or {})
        self._changed = threading.Condition()

    def apply_new(self) -> int:
        """Apply every increment not yet applied, in order; returns how many."""
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
            self.apply_new()
            if self._stop.wait(self.poll_sec):
                return


def base_increment_seqs(checkpoint: str | Path) -> dict[int, int]:
    """Per replica, the last increment exported before checkpoint ``checkpoint`` was taken."""
    folder = fmt.resolve(checkpoint)
    manifest = fmt.load_json(folder / fmt.MANIFEST)
    return {r: int(fmt.load_json(folder / f"ps-{r}.json").get("increment_seq", 0))
            for r in range(int(manifest["num_ps_replicas"]))}


def newest_increments(directory: str | Path) -> dict[int, int]:
    """Per source replica, the largest sequence number complete in ``directory``."""
    out: dict[int, int] = {}
    for replica, seq, _ in _increments(Path(directory)):
        out[replica] = max(out.get(replica, 0), seq)
    return out


__all__ = ["IncrementalExporter", "IncrementFollower", "apply_increment",
           "base_increment_seqs", "newest_increments", "write_increment"]
