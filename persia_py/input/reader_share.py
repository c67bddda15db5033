"""Which part of an input file a data loader reads: its share, by loader index.

With ``n`` data loaders, loader ``i`` (``PERSIA_DATA_LOADER_REPLICA_INDEX`` /
``PERSIA_DATA_LOADER_REPLICA_SIZE``, which ``persia-launcher`` and the Kubernetes
manifests set for the data-loader role) reads share ``i`` of ``n`` of every file. A file's
shares are byte ranges, as Hadoop splits text files: the file is cut at ``k * size // n``
and a line belongs to the share in which its first byte lies. So every line is read by
exactly one loader, a loader parses only its own lines, and the shares of a file are
equal in size to within a line. (Finding a share's bounds reads a line's worth of bytes
at each cut; the CSV reader also counts the newlines before its share, to give the file's
line numbers.)

This needs one record per line: a quoted field holding a newline would be cut between two
loaders (the CSV reader refuses such a record when the file is shared; read it whole with
``ReaderShare.whole()``). Outside a data-loader process (an NN worker reading its test
set, a script) the default share is the whole file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from persia_py.env import PersiaEnv

_SCAN_BYTES = 1 << 16
"""How much is read at a time to find the end of the line a cut falls in."""


@dataclass(frozen=True)
class ReaderShare:
    """Share ``index`` of ``count`` of each file read."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"ReaderShare.count: expected an int >= 1, got {self.count!r}")
        if (isinstance(self.index, bool) or not isinstance(self.index, int)
                or not 0 <= self.index < self.count):
            raise ValueError(f"ReaderShare.index: expected an int in [0, {self.count}), got "
                             f"{self.index!r}")

    @classmethod
    def whole(cls) -> ReaderShare:
        """The whole file (share 0 of 1)."""
        return cls(0, 1)

    @classmethod
    def of_this_process(cls, env: PersiaEnv | None = None) -> ReaderShare:
        """This data loader's share (its replica index of the replica count); the whole
        file in a process that is not a data loader."""
        env = env or PersiaEnv.from_environ()
        return cls(env.data_loader_replica_index, env.data_loader_replica_size)

    @property
    def is_whole(self) -> bool:
        return self.count == 1

    def byte_range(self, path: str | os.PathLike) -> tuple[int, int]:
        """``(start, end)``: the bytes of ``path`` holding this share's lines; ``start``
        is a line's first byte (or the file's size)."""
        size = os.path.getsize(path)
        if self.is_whole:
            return 0, size
        with open(path, "rb") as f:
            return (_line_start_at(f, self.index * size // self.count, size),
                    _line_start_at(f, (self.index + 1) * size // self.count, size))


def _line_start_at(f, cut: int, size: int) -> int:
    """The first byte of the first line starting at or after ``cut``: just past the first
    newline at or after ``cut - 1`` (0 for a cut at 0, ``size`` when there is none)."""
    if cut <= 0:
        return 0
    position = cut - 1
    f.seek(position)
    while position < size:
        chunk = f.read(_SCAN_BYTES)
        if not chunk:
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
    return size
