"""A data loader's handover log: which batches it handed to which NN-worker request, and
which of them the NN workers finished, so that a data loader restarted after a crash
goes on where it left off, without rolling the training back.

One JSON line per event, each appended with one ``write`` (the log survives the
process's death; it is not fsynced, so a machine's crash is not covered: the training
rollback is the answer to that):

* ``{"stream": S}`` first: the identity of the loader's batches at the embedding workers
  and parameter servers. A restarted loader keeps it, so a batch its predecessor had put
  on an embedding worker is found there again (a put with an identity is idempotent) and
  an update is never applied under two identities.
* ``{"handed": seq, "rank": r, "consumer": hex, "request": n}`` before a NextBatch answer
  carrying batch ``seq`` leaves; a request retried after the restart is answered with the
  same batch.
* ``{"done": [seq, ...]}``: batches the NN workers finished (their ID features need not
  be kept any more).
* ``{"ended": r}``: rank ``r`` was told the stream ended.

A line cut short by the crash is ignored: its event had not been answered, so nothing
depends on it (a ``done`` is sent again with the NN worker's retried request).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handover:
    """One batch handed to one NN-worker request."""

    seq: int
    rank: int
    consumer: bytes
    request_seq: int


@dataclass
class Handovers:
    """What a handover log says the dead loader did."""

    stream: str | None = None
    finished: list[int] = field(default_factory=list)
    """Batches handed over and finished (sequence numbers)."""
    in_training: dict[int, Handover] = field(default_factory=dict)
    """Batches handed over, not finished (by sequence number)."""
    last: dict[int, Handover] = field(default_factory=dict)
    """Each rank's last handover: the only one its retried request can ask for again."""
    ended: set[int] = field(default_factory=set)


class HandoverLog:
    """The appending side (thread-safe); see the module docstring."""

    def __init__(self, path: str | os.PathLike, *, replay: bool) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered = read_handovers(self.path) if replay else Handovers()
        # A new start (not a replay) begins a new log: what was there is another run's.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if replay else os.O_TRUNC)
        self._fd = os.open(self.path, flags, 0o600)
        self._lock = threading.Lock()
        if replay and self.path.stat().st_size:
            self._terminate_torn_line()

    def _terminate_torn_line(self) -> None:
        """A line cut short is left behind; a newline keeps the next one whole."""
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                os.write(self._fd, b"\n")

    def stream(self, stream: str) -> None:
        self._append({"stream": stream})

    def handed(self, handover: Handover) -> None:
        self._append({"handed": handover.seq, "rank": handover.rank,
                      "consumer": handover.consumer.hex(), "request": handover.request_seq})

    def done(self, seqs: list[int]) -> None:
        if seqs:
            self._append({"done": seqs})

    def ended(self, rank: int) -> None:
        self._append({"ended": rank})

    def _append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return
            written = os.write(self._fd, line)
        if written != len(line):  # a full disk: a restart would not know this event
            raise OSError(f"{self.path}: short write ({written} of {len(line)} bytes)")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_handovers(path: str | os.PathLike) -> Handovers:
    """The state a handover log describes (empty if there is none)."""
    state = Handovers()
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return state
    handed: dict[int, Handover] = {}
    done: list[int] = []
    for number, raw in enumerate(text.split(b"\n"), 1):
        if not raw:
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            logger.info("%s line %d: cut short; ignored", path, number)
            continue
        if "stream" in record:
            state.stream = record["stream"]
        elif "handed" in record:
            h = Handover(record["handed"], record["rank"], bytes.fromhex(record["consumer"]),
                         record["request"])
            handed[h.seq] = h
            state.last[h.rank] = h
        elif "done" in record:
            done.extend(record["done"])
        elif "ended" in record:
            state.ended.add(record["ended"])
    finished = set(done) & handed.keys()
    state.finished = sorted(finished)
    state.in_training = {s: h for s, h in handed.items() if s not in finished}
    return state


__all__ = ["Handover", "HandoverLog", "Handovers", "read_handovers"]
