"""``ReplicaState``: what one parameter-server replica holds, as plain values.

Checkpoints and incremental exports move a replica's state only through these
(:meth:`persia_py.servers.parameter_server.ParameterServer.state_dict` and
``load_state_dict``), never through the tables themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from persia_py.servers.row_stream import RowChunks
    from persia_py.servers.storage import EmbeddingTable

__all__ = ["ReplicaState", "Rows"]

Rows = dict
"""One table's rows as plain arrays: ``ids`` (uint64 [n]), ``weights`` ([n, dim], as
stored), ``state`` (float32 [n, state width]), ``last_access`` (int64 [n]), ``clock``
(int) and ``row_dtype`` (how ``weights`` are stored; float32 when absent), as
:meth:`EmbeddingTable.export_rows` gives them."""


@dataclass(kw_only=True)
class ReplicaState:
    """What one replica holds, as plain values (see ``ParameterServer.state_dict``)."""

    settings: dict | None
    """The ``configure`` arguments (None: not configured yet)."""
    tables: Mapping[str, Rows | EmbeddingTable | RowChunks]
    """Every table's rows, by table name: a dict of arrays (``export_rows``); the live
    table (``state_dict(stream=True)``, for a writer to stream); rows to load chunk by
    chunk (:class:`persia_py.servers.row_stream.RowChunks`, a checkpoint's files)."""
    seen: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """The exactly-once window: worker id -> its remembered sequence numbers (uint64),
    least recently updating worker first."""
    increment_seq: int = 0
    """Sequence number of the last incremental export taken before these rows."""
