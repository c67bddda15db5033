"""A data loader that follows a stream, resuming at the exact position after a restart.

    with DataCtx() as ctx:
        reader = StreamReader("incoming/", CsvFormat(config), pattern="*.csv")
        for part in follow(ctx, reader, batch_size=1024,
                           position_log=f"state/loader-{replica_index}.positions"):
            ctx.send_data(make_batch(part.records))   # exactly one send per part

**How positions work, and why this way.** Checkpoints already record, per loader, which
batch sequence numbers were trained (:mod:`persia_py.ids.positions`: every sequence
below ``next``, plus a few beyond it). For a finite input a restarted loader makes its
batches again from the start and skips those; an endless stream cannot be re-read from
its start. So the loader keeps a small **position log**: before a batch goes out, one
line ``{"seq", "start", "end"}`` (its :class:`~persia_py.input.stream_reader.StreamPosition`
range) is appended with one ``write`` and ``fsync``-ed. A batch that may be trained thus
always has its range on disk first. On restart the loader reads the checkpoint's
position for itself (``$PERSIA_DATA_POSITIONS``), and:

1. numbers its next batch ``next`` (:meth:`DataCtx.start_at`): nothing before it is read;
2. makes every batch the log holds from ``next`` on again from its recorded range
   (:meth:`StreamReader.read`), so the batch boundaries are those of the first run even
   where they depended on timing (a short batch after ``max_wait_sec``); the ones
   trained beyond ``next`` are skipped by ``send_data``, as for any loader;
3. reads on from the end of the last logged batch.

No sample is skipped and none trained twice. The alternative, carrying each batch's
range with it to the NN workers and into the checkpoint manifest, would change the wire
format and the checkpoint for what only this loader needs; the log stays the loader's
own. When the log is opened, records before ``next - 1`` are dropped (rewritten
atomically), so it holds only what a restart from that checkpoint or a later one needs:
a job resumed later from an *older* checkpoint than the last start used cannot find its
position and says so. A torn last line (the process died mid-write) belongs to a batch
never sent and is discarded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from persia_py.input.stream_reader import StreamBatch, StreamPosition, StreamReader
from persia_py.ops.private_files import open_private
from persia_py.ops.start_checks import Written, check_writable
from persia_py.workers.data_loader import DataCtx

__all__ = ["PositionLog", "follow"]


class PositionLog:
    """Append-only, crash-safe record of each batch's stream range (see the module doc)."""

    def __init__(self, path: str | os.PathLike, *, keep_from: int = 0) -> None:
        self.path = Path(path)
        # Before the loader's first batch: a ConfigError there is final (no restart would
        # write it: persia_py/ops/final_errors.py).
        check_writable([Written(self.path, "follow(position_log=...)", file=True)])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: dict[int, tuple[StreamPosition, StreamPosition]] = {}
        if self.path.exists():
            self._load_and_compact(keep_from)
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def _load_and_compact(self, keep_from: int) -> None:
        text = self.path.read_bytes()
        complete = text[:text.rfind(b"\n") + 1]  # a torn last line: its batch never went out
        kept = []
        for number, line in enumerate(complete.decode().splitlines(), 1):
            where = f"{self.path}:{number}"
            try:
                record = json.loads(line)
                seq = record["seq"]
                start = StreamPosition.from_json(record["start"], f"{where} start")
                end = StreamPosition.from_json(record["end"], f"{where} end")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{where}: not a position record ({exc})") from None
            if seq >= keep_from:
                self.records[seq] = (start, end)
                kept.append(line)
        seqs = sorted(self.records)
        if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            raise ValueError(f"{self.path}: batch sequence numbers are not contiguous")
        if len(kept) != complete.count(b"\n") or len(complete) != len(text):
            tmp = self.path.with_name(self.path.name + ".tmp")
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def append(self, seq: int, start: StreamPosition, end: StreamPosition) -> None:
        """Record batch ``seq``'s range durably (one write, then fsync)."""
        line = json.dumps({"seq": seq, "start": start.to_json(), "end": end.to_json()})
        os.write(self._fd, (line + "\n").encode())
        os.fsync(self._fd)
        self.records[seq] = (start, end)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def follow(ctx: DataCtx, reader: StreamReader, *, batch_size: int,
           position_log: str | os.PathLike) -> Iterator[StreamBatch]:
    """The stream's batches for ``ctx`` to send, from where this loader's trained batches
    end (see the module docstring). The caller sends exactly one batch per part, in
    order; anything else is a RuntimeError (the log would name the wrong ranges)."""
    done = ctx.resumed_position
    log = PositionLog(position_log, keep_from=max(done.next - 1, 0))
    try:
        seq = done.next
        if seq in log.records:
            pos = log.records[seq][0]
        elif seq == 0:
            pos = None
        elif seq - 1 in log.records:
            pos = log.records[seq - 1][1]
        else:
            raise RuntimeError(
                f"{position_log}: no record of batch {seq - 1} or {seq} of this loader, so "
                f"where batch {seq} starts in the stream is unknown (was the log removed, or "
                "is the job resumed from an older checkpoint than its last start?)")
        ctx.start_at(seq)
        while seq in log.records:  # made again exactly as in the run that logged them
            start, end = log.records[seq]
            yield _checked(ctx, seq, reader.read(start, end))
            seq, pos = seq + 1, end
        for part in reader.batches(batch_size, start=pos):
            log.append(seq, part.start, part.end)
            yield _checked(ctx, seq, part)
            seq += 1
        _expect(ctx, seq)
    finally:
        log.close()


def _checked(ctx: DataCtx, seq: int, part: StreamBatch) -> StreamBatch:
    _expect(ctx, seq)
    return part


def _expect(ctx: DataCtx, seq: int) -> None:
    if ctx.next_seq != seq:
        raise RuntimeError(f"follow(): the data loader numbers its next batch {ctx.next_seq}, "
                           f"the stream's is {seq}; send exactly one batch per stream batch")
