"""How a parameter-server replica starts when it keeps an update log: new (an empty log,
after the checkpoint it is given, if any), or again after a crash (the checkpoint its log
starts from, then the log applied again). See ``persia_py.servers.update_log``."""

from __future__ import annotations

import os
from pathlib import Path

from persia_py.checkpoint import layout as fmt
from persia_py.ops import safe_files
from persia_py.servers.checkpoint import load_replica
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.update_log import (
    DEFAULT_MAX_BYTES,
    UpdateLog,
    complete_checkpoint,
    replay_plan,
    updates,
)


def open_update_log(ps: ParameterServer, folder: str | os.PathLike, *, replay: bool,
                    checkpoint: str | os.PathLike | None, root: str | os.PathLike | None,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Give ``ps`` (new, nothing loaded) its update log in ``folder``; returns a line
    saying what it did.

    With ``replay`` and segments in ``folder`` (a restart after a crash): load the
    checkpoint the log starts from, apply the logged updates again and go on appending
    to the last segment; ``checkpoint`` is not used. Otherwise (a new start, or nothing
    logged yet): delete what ``folder`` holds, load ``checkpoint`` if given, and begin a
    new segment there. The checkpoints a log names must lie inside the checkpoint
    ``root`` (None: the current directory) or be ``checkpoint``, which the operator gave:
    ValueError naming the segment otherwise, before anything is loaded."""
    if ps.inference:
        raise ValueError("a serving (inference) replica keeps no update log: it applies no "
                         "updates")
    log = UpdateLog(folder, ps.replica_index, max_bytes=max_bytes)
    trusted = None if checkpoint is None else Path(os.path.realpath(checkpoint))
    plan = replay_plan(folder, safe_files.configured_root(root), trusted) if replay else []
    if not plan:  # begin() deletes what the folder held once the new segment is in place
        if checkpoint is None:
            log.begin("start", None)
            what = "a new update log"
        else:
            path = fmt.resolve(checkpoint)
            num_rows, _ = load_replica(ps, path)
            log.begin("load", path)
            what = f"{num_rows} rows from checkpoint {path}, a new update log{_on_disk(ps)}"
    else:
        base = None if plan[0].base is None else complete_checkpoint(plan[0].base)
        num_rows = 0 if base is None else load_replica(ps, base)[0]
        num_updates = 0
        for i, segment in enumerate(plan):
            for record in updates(segment, last=i == len(plan) - 1):
                if record["type"] == "configure":
                    ps.configure(**record["settings"])
                elif record["type"] == "lookup":
                    ps.lookup(record["requests"], training=True)
                else:
                    ps.update(record["requests"], worker_id=record["worker_id"],
                              sequence=record["sequence"], replayed=True)
                    num_updates += 1
        log.resume(plan[-1])
        what = (f"{num_rows} rows from " + (f"checkpoint {base}" if base else "no checkpoint")
                + f" and {num_updates} updates replayed from its update log{_on_disk(ps)}")
    ps.update_log = log
    return what


def _on_disk(ps: ParameterServer) -> str:
    """How many of the replica's rows its disk tiers hold ("" without a tier). The tiers
    start empty whatever a crash left (their files are unnamed): the rows on them now came
    from the checkpoint and the log just applied."""
    stats = ps.disk_stats()
    if not stats:
        return ""
    return f" ({sum(s['disk_rows'] for s in stats.values())} rows on its disk tier)"


__all__ = ["open_update_log"]
