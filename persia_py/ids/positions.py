"""Exact data positions: which batches of each data loader have been trained.

A data loader numbers the batches it makes 0, 1, 2, ... (its *sequence*; a batch's id
is ``loader << 40 | seq``), counting every batch its script builds, so a restarted
loader that runs its script again from the start meets the same numbers. The NN
workers consume one loader's batches in no fixed order across ranks, so what has been
trained is not a prefix: a position is ``next`` (every sequence below it is done) plus
``also`` (the few done beyond it). Checkpoints store one position per loader; a loader
that resumes from one skips exactly those batches: none dropped, none repeated.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from persia_py.config.checks import load_json

SEQ_BITS = 40
"""Low bits of a batch id that hold the loader's sequence number."""
_SEQ_MASK = (1 << SEQ_BITS) - 1

MAX_LOADERS = 1 << (64 - SEQ_BITS)
"""Loader indexes a batch id can hold."""
MAX_POSITIONS_BYTES = 1 << 20
"""Largest positions text (:meth:`DataPositions.to_text`) read from the environment, a
rewind file or a ``Rewind`` call."""
_POSITIONS_DEPTH = 3  # {loader: {"next": n, "also": [...]}}

ENV_DATA_POSITIONS = "PERSIA_DATA_POSITIONS"
"""JSON ``{loader index: {"next": int, "also": [int, ...]}}`` a resumed job's data
loaders skip (set by ``persia-launcher`` from the checkpoint it resumes)."""


def batch_id(loader: int, seq: int) -> int:
    """The id of batch ``seq`` of data loader ``loader``."""
    return (loader << SEQ_BITS) | seq


def loader_of(batch: int) -> int:
    """The data loader of batch id ``batch``."""
    return batch >> SEQ_BITS


def seq_of(batch: int) -> int:
    """The sequence number of batch id ``batch`` within its loader."""
    return batch & _SEQ_MASK


def split_batch_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(loader, sequence) of each batch id."""
    ids = np.asarray(ids, dtype=np.uint64)
    return (ids >> np.uint64(SEQ_BITS)).astype(np.int64), \
        (ids & np.uint64(_SEQ_MASK)).astype(np.int64)


@dataclass
class Position:
    """One loader's batches done: every sequence below ``next``, and those in ``also``."""

    next: int = 0
    also: frozenset[int] = field(default_factory=frozenset)

    def done(self, seq: int) -> bool:
        return seq < self.next or seq in self.also

    def advanced(self, seqs: Iterable[int]) -> Position:
        """This position with ``seqs`` done too (``next`` moved over every gap closed)."""
        done = set(self.also)
        done.update(s for s in seqs if s >= self.next)
        nxt = self.next
        while nxt in done:
            done.discard(nxt)
            nxt += 1
        return Position(nxt, frozenset(done))

    def merged(self, other: Position) -> Position:
        """The batches done in either position."""
        base, extra = (self, other) if self.next >= other.next else (other, self)
        return base.advanced(extra.also)  # extra's sequences below its next are below base's

    def to_json(self) -> dict:
        return {"next": self.next, "also": sorted(self.also)}

    @classmethod
    def from_json(cls, data: object, where: str) -> Position:
        if (not isinstance(data, dict) or set(data) != {"next", "also"}
                or not _count(data["next"]) or not isinstance(data["also"], list)
                or not all(_count(s) and s > data["next"] for s in data["also"])):
            raise ValueError(f"{where}: expected {{'next': int >= 0, 'also': [ints above "
                             f"next]}}, got {_shown(data)}")
        return cls(data["next"], frozenset(data["also"]))


def _shown(data: object) -> str:
    text = repr(data)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << SEQ_BITS


class DataPositions:
    """Every loader's :class:`Position` (a loader never seen has done nothing)."""

    def __init__(self, positions: Mapping[int, Position] | None = None) -> None:
        self.positions = dict(positions or {})

    def of(self, loader: int) -> Position:
        return self.positions.get(loader, Position())

    def advanced(self, ids: Iterable[int]) -> DataPositions:
        """These positions with the batches ``ids`` done too."""
        loaders, seqs = split_batch_ids(np.fromiter(ids, dtype=np.uint64))
        result = dict(self.positions)
        for loader in np.unique(loaders).tolist():
            result[loader] = self.of(loader).advanced(seqs[loaders == loader].tolist())
        return DataPositions(result)

    def to_json(self) -> dict[str, dict]:
        return {str(k): p.to_json() for k, p in sorted(self.positions.items())}

    @classmethod
    def from_json(cls, data: object, where: str = "data_positions") -> DataPositions:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of loader index to position, "
                             f"got {_shown(data)}")
        positions = {}
        for key, value in data.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()
                    and len(key) <= 8 and int(key) < MAX_LOADERS):
                raise ValueError(f"{where}: loader index {_shown(key)} is not a number "
                                 f"below {MAX_LOADERS}")
            positions[int(key)] = Position.from_json(value, f"{where}[{key}]")
        return cls(positions)

    def to_text(self) -> str:
        """Compact JSON: how positions travel (``$PERSIA_DATA_POSITIONS``, a rewind file,
        a ``Restart`` call)."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str | None, where: str) -> DataPositions:
        """Positions from their :meth:`to_text` form, bounded in bytes and depth before
        parsing (``where`` names its source in errors); empty or None: no positions."""
        if not text:
            return cls()
        return cls.from_json(load_json(text, where, max_bytes=MAX_POSITIONS_BYTES,
                                       max_depth=_POSITIONS_DEPTH), where)
