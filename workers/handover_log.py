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

**Compaction.** Every ``COMPACT_EVERY`` lines the log is rewritten as what it says (the
stream, ``{"finished": position}``, the handovers still in training, the ranks ended),
into a new file fsynced and renamed over it, so a loader that streams for weeks keeps a
log the size of what is in flight.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from persia_py.checkpoint import rewind
from persia_py.ids.positions import Position
from persia_py.ops.private_files import open_private
from persia_py.ops.safe_files import fsync_dir

logger = logging.getLogger(__name__)

COMPACT_EVERY = 100_000
"""Lines appended between two rewrites of the log as its state."""


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
    finished: Position = field(default_factory=Position)
    """Batches handed over and finished, with those trained before the log began."""
    in_training: dict[int, Handover] = field(default_factory=dict)
    """Batches handed over, not finished (by sequence number)."""
    last: dict[int, Handover] = field(default_factory=dict)
    """Each rank's last handover: the only one its retried request can ask for again."""
    ended: set[int] = field(default_factory=set)


class HandoverLog:
    """The appending side (thread-safe); see the module docstring."""

    def __init__(self, path: str | os.PathLike, *, replay: bool,
                 trained: Position | None = None, compact_every: int = COMPACT_EVERY) -> None:
        """``trained``: the loader's batches trained before the checkpoint the job
        resumed (they count as finished)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trained = trained or Position()
        self.recovered = read_handovers(self.path) if replay else Handovers()
        self.recovered.finished = self.recovered.finished.merged(trained)
        # What the log says now (for compaction), starting from what it said.
        self._state = Handovers(self.recovered.stream, self.recovered.finished,
                                dict(self.recovered.in_training), dict(self.recovered.last),
                                set(self.recovered.ended))
        # A new start (not a replay) begins a new log: what was there is another run's.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if replay else os.O_TRUNC)
        fd = open_private(self.path, flags)
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self._compact_every = compact_every
        self._lines = 0
        if replay and self.path.stat().st_size:
            self._terminate_torn_line(fd)

    def _terminate_torn_line(self, fd: int) -> None:
        """A line cut short is left behind; a newline keeps the next one whole."""
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                os.write(fd, b"\n")

    @property
    def recorded_stream(self) -> str | None:
        """The stream this log names (None: none yet)."""
        return self._state.stream

    def stream(self, stream: str) -> None:
        self._append({"stream": stream}, lambda st: setattr(st, "stream", stream))

    def handed(self, handover: Handover) -> None:
        def note(state: Handovers) -> None:
            state.in_training[handover.seq] = handover
            state.last[handover.rank] = handover
        self._append(_handed_record(handover), note)

    def done(self, seqs: list[int]) -> None:
        def note(state: Handovers) -> None:
            finished = [s for s in seqs if state.in_training.pop(s, None) is not None]
            state.finished = state.finished.advanced(finished)
        if seqs:
            self._append({"done": seqs}, note)

    def ended(self, rank: int) -> None:
        self._append({"ended": rank}, lambda st: st.ended.add(rank))

    def _append(self, record: dict, note) -> None:
        line = _line(record)
        with self._lock:
            if self._fd is None:
                return
            written = os.write(self._fd, line)
            if written != len(line):  # a full disk: a restart would not know this event
                raise OSError(f"{self.path}: short write ({written} of {len(line)} bytes)")
            note(self._state)
            self._lines += 1
            if self._lines >= self._compact_every:
                self._compact()

    def _compact(self) -> None:
        """Rewrite the log as its state (see the module docstring); under the lock."""
        state = self._state
        records: list[dict] = [{"stream": state.stream}] if state.stream is not None else []
        records.append({"finished": state.finished.to_json()})
        records += [_handed_record(h) for _, h in sorted(state.in_training.items())]
        records += [{"ended": r} for r in sorted(state.ended)]
        tmp = self.path.with_name(f".{self.path.name}.compacting")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(b"".join(_line(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        assert self._fd is not None, "compacted only by _append, which holds the log open"
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._lines = 0

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _line(record: dict) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _handed_record(h: Handover) -> dict:
    return {"handed": h.seq, "rank": h.rank, "consumer": h.consumer.hex(),
            "request": h.request_seq}


class HandoverLogError(ValueError):
    """A handover log holds a record a loader never writes; the message names the file,
    the line and its byte offset."""


_KINDS = {"stream": {"stream"}, "finished": {"finished"},
          "handed": {"handed", "rank", "consumer", "request"}, "done": {"done"},
          "ended": {"ended"}}
"""Each record kind (its first key) and the keys it has, exactly."""


def _number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _checked(record: object, where: str) -> tuple[str, dict]:
    """``(kind, record)`` of one decoded line, each field checked; HandoverLogError naming
    ``where`` otherwise (a log a loader wrote never has one)."""
    kind = next((k for k in _KINDS if k in record), None) if isinstance(record, dict) else None
    if kind is None or not isinstance(record, dict) or set(record) != _KINDS[kind]:
        raise HandoverLogError(f"{where}: not a handover record ({_shown(record)}); expected "
                               f"one of {[sorted(keys) for keys in _KINDS.values()]}")
    if kind == "stream":
        ok = isinstance(record["stream"], str) and 0 < len(record["stream"]) <= 64
    elif kind == "handed":
        consumer = record["consumer"]
        ok = (all(_number(record[k]) for k in ("handed", "rank", "request"))
              and isinstance(consumer, str) and len(consumer) <= 128
              and re.fullmatch(r"(?:[0-9a-f]{2})*", consumer) is not None)
    elif kind == "done":
        ok = isinstance(record["done"], list) and all(_number(s) for s in record["done"])
    elif kind == "ended":
        ok = _number(record["ended"])
    else:  # finished: Position.from_json checks it
        ok = True
    if not ok:
        raise HandoverLogError(f"{where}: a {kind!r} record with fields of the wrong type or "
                               f"range ({_shown(record)})")
    return kind, record


def _shown(record: object) -> str:
    text = repr(record)
    return text if len(text) <= 200 else text[:200] + "..."


def read_handovers(path: str | os.PathLike) -> Handovers:
    """The state a handover log describes (empty if there is none). A line cut short is
    skipped; a whole line that is not a record a loader writes raises HandoverLogError
    naming the file, line and byte offset."""
    state = Handovers()
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return state
    handed: dict[int, Handover] = {}
    done: list[int] = []
    offset = 0
    for number, raw in enumerate(text.split(b"\n"), 1):
        where, offset = f"{path} line {number} (byte {offset})", offset + len(raw) + 1
        if not raw:
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            logger.info("%s: cut short; ignored", where)
            continue
        kind, record = _checked(record, where)
        if kind == "stream":
            state.stream = record["stream"]
        elif kind == "finished":  # a compacted log's start
            try:
                state.finished = Position.from_json(record["finished"], where)
            except ValueError as exc:
                raise HandoverLogError(str(exc)) from None
        elif kind == "handed":
            h = Handover(record["handed"], record["rank"], bytes.fromhex(record["consumer"]),
                         record["request"])
            handed[h.seq] = h
            state.last[h.rank] = h
        elif kind == "done":
            done.extend(record["done"])
        else:
            state.ended.add(record["ended"])
    state.finished = state.finished.advanced(set(done) & handed.keys())
    state.in_training = {s: h for s, h in handed.items() if not state.finished.done(s)}
    state.last = {r: h for r, h in state.last.items() if h.seq in state.in_training}
    return state


def take_rewind(path: str | os.PathLike, *, replayed: bool, index: int) -> Position | None:
    """Loader ``index``'s positions that a ``Rewind`` left beside its handover log
    ``path`` (persia_py/checkpoint/rewind.py), or None. Only a restart (``replayed``) takes them, and
    only when they name the stream of that log; any other file is removed unread."""
    if not rewind.rewind_file(path).exists():
        return None
    stream = read_handovers(path).stream if replayed else None
    positions = rewind.read_rewind(path, stream=stream)
    if positions is None:
        return None
    done = positions.of(index)
    logger.warning("data loader %d rewound to the training's checkpoint: batches below %d "
                   "(and %d more) trained; a new stream", index, done.next, len(done.also))
    return done


__all__ = ["Handover", "HandoverLog", "HandoverLogError", "Handovers", "read_handovers",
           "take_rewind"]
