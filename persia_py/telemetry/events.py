"""Job events: what the roles tell the launcher, as records, never as log text.

Every role of a ``persia-launcher`` job appends its events to the job's training log
(``$PERSIA_TRAIN_LOG``, JSON lines; rank 0 writes its step records there too) with
:func:`emit`: one record per line, each appended in one ``write`` of an ``O_APPEND`` file,
so the records of concurrent processes never interleave. ``persia-launcher local`` reads
them back (:func:`read_events`) for its closing summary (``launcher/recovery.py``); the log
lines the roles print beside them are for people, and may be reworded freely.

A process without ``$PERSIA_TRAIN_LOG`` (a role started by hand, a Kubernetes pod) emits
nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from persia_py.ops.private_files import append_private

__all__ = ["ENV_TRAIN_LOG", "Event", "emit", "read_events"]

logger = logging.getLogger(__name__)

ENV_TRAIN_LOG = "PERSIA_TRAIN_LOG"
"""Path of the job's JSON-lines training log (``persia-launcher`` sets it)."""


class Event:
    """The events a role emits (the ``event`` key of a record) and their fields."""

    LOADER_FINISHED = "loader_finished"
    """A data loader's run ended: ``loader``, ``sent``, ``skipped`` (trained before the
    checkpoint it resumed, or handed over by its predecessor), ``resent``."""
    BATCH_RESENT = "batch_resent"
    """A data loader put a kept batch's ID features on a restarted embedding worker
    again: ``batch``, ``embedding_worker``."""
    TRAINING_REWOUND = "training_rewound"
    """torchrun restarted the NN ranks and rank 0 took the job back to a checkpoint:
    ``restart``, ``checkpoint``."""
    RESTART = "restart"
    """The launcher restarted the training side: ``role``, ``reason``, ``checkpoint``."""


def emit(event: str, *, to: str | os.PathLike | None = None, **fields: object) -> None:
    """Append one event record to the job's training log (``to``, else
    ``$PERSIA_TRAIN_LOG``; nothing without one). An event that cannot be written is
    logged and dropped: it is never worth a role."""
    path = to or os.environ.get(ENV_TRAIN_LOG)
    if not path:
        return
    record = json.dumps({"event": event, **fields, "time": time.time()})
    try:
        with append_private(path) as f:
            f.write(record + "\n")
    except OSError as exc:
        logger.warning("event %s not written to the training log %s: %s", event, path, exc)


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """The event records of a training log, in order (step records skipped). A line
    that is not JSON (a process killed mid-line) is logged and skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            logger.warning("%s line %d: not a JSON record; skipped", path, number)
            continue
        if isinstance(record, dict) and "event" in record:
            yield record
