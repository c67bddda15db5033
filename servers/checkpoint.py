"""Dump and load the tables of one parameter-server replica (see ``persia_py.checkpoint_format``).

A replica writes ``ps-<r>.json`` (its index, the replica count, the optimizer settings,
each table's dim, state width, row count and files) and four ``.npy`` files per table.
Loading reads every replica's files of a checkpoint and keeps the rows whose
``replica_of(id, M)`` is this replica's index, so a checkpoint taken with N replicas
loads into M: re-sharding needs nothing more. Rows keep their optimizer state and LRU
clock, so training continues as if never stopped; the exactly-once window of
``(worker id, sequence)`` is saved and restored with them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import grpc
import numpy as np

from persia_py import checkpoint_format as fmt
from persia_py.proto import checkpoint_pb2 as pb
from persia_py.proto import checkpoint_pb2_grpc
from persia_py.routing import replica_of
from persia_py.rpc import FailedPrecondition, grpc_method
from persia_py.servers.parameter_server import ParameterServer

logger = logging.getLogger(__name__)

_ARRAYS = ("ids", "weights", "state", "last_access")


def replica_file(index: int) -> str:
    return f"ps-{index}.json"


def dump_replica(ps: ParameterServer, directory: str | Path) -> tuple[int, int]:
    """Write ``ps``'s tables into ``directory``; returns (rows, bytes).

    Each internal shard is copied under its lock; the caller makes the cut consistent
    across tables and replicas by dumping only when no update is in flight
    (``TrainCtx.dump_checkpoint`` flushes and barriers first).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    if ps._settings is None:
        raise FailedPrecondition("nothing to dump: no embedding optimizer configured yet")
    started = time.perf_counter()
    # Read before any row is copied: increments after this one hold rows at least as new.
    increment_seq = ps.increment_seq
    tables, num_rows, num_bytes = {}, 0, 0
    r = ps.replica_index
    for t, (name, table) in enumerate(sorted(ps._tables.items())):
        rows = table.export_rows()
        files = {}
        for key in _ARRAYS:
            files[key] = f"ps-{r}-t{t}-{key}.npy"
            num_bytes += fmt.save_array(directory / files[key], rows[key])
        num_rows += rows["ids"].shape[0]
        tables[name] = {"dim": table.dim, "state_width": table.state_width,
                        "num_rows": int(rows["ids"].shape[0]), "clock": rows["clock"],
                        "files": files}
    # The exactly-once window of (worker id, sequence), so that an update applied before
    # the checkpoint and retried after a restore from it is not applied twice.
    seen = {}
    for k, (worker_id, sequences) in enumerate(sorted(ps.export_seen().items())):
        seen[worker_id] = f"ps-{r}-seen{k}.npy"
        num_bytes += fmt.save_array(directory / seen[worker_id], sequences)
    fmt.save_json(directory / replica_file(r), {
        "replica_index": r, "replica_size": ps.replica_size,
        "settings": dataclasses.asdict(ps._settings), "tables": tables, "seen": seen,
        "increment_seq": increment_seq,
    })
    logger.info("replica %d dumped %d rows (%.1f MB) to %s in %.2fs", r, num_rows,
                num_bytes / 1e6, directory, time.perf_counter() - started)
    return num_rows, num_bytes


def _reset_tables(ps: ParameterServer, settings: dict) -> None:
    """Empty tables configured with ``settings`` (those of the checkpoint)."""
    with ps._lock:
        old, ps._tables, ps._settings = ps._tables, {}, None
    for table in old.values():
        table.close()
    ps.configure(**settings)


def load_replica(ps: ParameterServer, path: str | Path) -> tuple[int, int]:
    """Replace ``ps``'s tables by the rows of checkpoint ``path`` that route to it.

    The optimizer settings come from the checkpoint; a server already configured with
    other settings refuses (FailedPrecondition). Returns (rows loaded, bytes read).
    """
    started = time.perf_counter()
    folder = fmt.resolve(path)
    manifest = fmt.load_json(folder / fmt.MANIFEST)
    num_replicas = int(manifest["num_ps_replicas"])
    replicas = [fmt.load_json(folder / replica_file(i)) for i in range(num_replicas)]
    settings = replicas[0]["settings"]
    if ps._settings is not None and dataclasses.asdict(ps._settings) != settings:
        raise FailedPrecondition(
            f"this server is configured with {dataclasses.asdict(ps._settings)}, the checkpoint "
            f"{folder} with {settings}; use the checkpoint's embedding optimizer and settings")
    unknown = sorted(set(replicas[0]["tables"]) - set(ps.embedding_config.tables))
    if unknown:
        raise fmt.CheckpointError(f"checkpoint {folder} has tables {unknown} that the "
                                  f"embedding config lacks ({sorted(ps.embedding_config.tables)})")
    _reset_tables(ps, settings)
    num_rows = num_bytes = 0
    for replica in replicas:
        for name, entry in replica["tables"].items():
            table = ps._tables[name]
            if (entry["dim"], entry["state_width"]) != (table.dim, table.state_width):
                raise fmt.CheckpointError(
                    f"table {name!r}: checkpoint rows have dim {entry['dim']}, state width "
                    f"{entry['state_width']}; this server's {table.dim}, {table.state_width}")
            arrays = {k: fmt.load_array(folder / f, mmap=True) for k, f in entry["files"].items()}
            ids = np.asarray(arrays["ids"])
            mine = (np.flatnonzero(replica_of(ids, ps.replica_size) == ps.replica_index)
                    if ps.replica_size > 1 else None)
            rows = {k: (np.asarray(a) if mine is None else a[mine]) for k, a in arrays.items()}
            table.import_rows(rows["ids"], rows["weights"], rows["state"],
                              rows["last_access"], entry["clock"])
            num_rows += rows["ids"].shape[0]
            num_bytes += sum(a.nbytes for a in rows.values())
        # Sequence numbers are unique per worker across replicas: the union is safe after
        # re-sharding too. (Checkpoints without a window: nothing to remember.)
        ps.import_seen({w: fmt.load_array(folder / f) for w, f in replica.get("seen", {}).items()})
    logger.info("replica %d of %d loaded %d rows from %s (taken with %d replicas) in %.2fs",
                ps.replica_index, ps.replica_size, num_rows, folder, num_replicas,
                time.perf_counter() - started)
    return num_rows, num_bytes


class CheckpointServicer(checkpoint_pb2_grpc.ParameterServerCheckpointServicer):
    def __init__(self, ps: ParameterServer) -> None:
        self.ps = ps

    @grpc_method
    def Dump(self, request, context):
        num_rows, num_bytes = dump_replica(self.ps, request.directory)
        return pb.DumpResponse(num_rows=num_rows, num_bytes=num_bytes,
                               replica_index=self.ps.replica_index,
                               replica_size=self.ps.replica_size)

    @grpc_method
    def Load(self, request, context):
        num_rows, num_bytes = load_replica(self.ps, request.directory)
        return pb.LoadResponse(num_rows=num_rows, num_bytes=num_bytes)


def add_checkpoint_service(ps: ParameterServer, server: grpc.Server) -> None:
    checkpoint_pb2_grpc.add_ParameterServerCheckpointServicer_to_server(
        CheckpointServicer(ps), server)
