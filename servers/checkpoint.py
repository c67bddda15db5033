"""Dump and load the tables of one parameter-server replica (see ``persia_py.checkpoint.layout``).

A replica writes ``ps-<r>.json`` (its index, the replica count, the optimizer settings,
each table's dim, state width, row storage type, row count, files and their checksums,
the exactly-once window) and four ``.npy`` files per table, streamed from the live table
and read back chunk by chunk (:mod:`persia_py.servers.table_files`); weights are written
as stored (float16 rows: half the bytes; bfloat16 rows as their uint16 bits), and a
table loads into whatever storage type its slot has now, converted once. Loading reads
every replica's files of a checkpoint and keeps the rows whose ``replica_of(id, M)`` is
this replica's index, so a checkpoint taken with N replicas loads into M: re-sharding
needs nothing more. Rows keep their optimizer state and LRU clock, so training continues
as if never stopped; the exactly-once window of ``(worker id, sequence)`` is saved and
restored with them. Only the replica's state interface is used
(``ParameterServer.state_dict`` / ``load_state_dict``).

**Trust.** Over gRPC a server reads and writes only inside its checkpoint root
(:class:`CheckpointRoot`: ``--checkpoint-root``, else ``checkpoint_config.root``, else its
current directory): Dump and Load name a checkpoint folder in it by plain names, never a
path, and every folder on the way is opened without following a link. Dump writes into
a private folder of its own inside the checkpoint, then renames its files into place
(``ps-<r>.json`` last). Load checks every file (plain names in the JSON, dtypes, shapes,
values, distinct ids) while building new tables, and swaps them in only when all is
well: a failed Load changes nothing. Serving replicas do not offer the service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from persia_py.checkpoint import layout as fmt
from persia_py.ops import safe_files
from persia_py.proto import checkpoint_pb2 as pb
from persia_py.proto import checkpoint_pb2_grpc
from persia_py.servers import row_types
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.replica_state import ReplicaState, Rows
from persia_py.servers.row_stream import RowChunks
from persia_py.servers.table_files import ARRAYS, TableFiles, check_sums, row_chunks, write_table
from persia_py.wire.rpc import FailedPrecondition, grpc_method

logger = logging.getLogger(__name__)

_ARRAYS = ARRAYS  # the planner's name for them (persia_py.launcher.plan)
MAX_REPLICAS = 4096
"""Most parameter-server replicas a checkpoint may say it was taken with."""


def replica_file(index: int) -> str:
    return f"ps-{index}.json"


class CheckpointRoot:
    """The folder a server's checkpoint calls name things in (created if missing)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = safe_files.configured_root(path)
        self.path.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def open(self, *names: tuple[str, str]) -> Iterator[int]:
        """A descriptor of ``ROOT/name/...`` for ``(name, field)`` pairs, each checked as a
        plain name (InvalidName names ``field``) and opened without following a link."""
        checked = [safe_files.check_name(value, field) for value, field in names]
        with contextlib.ExitStack() as stack:
            fd = stack.enter_context(safe_files.opened_dir(None, self.path))
            for name in checked:
                fd = stack.enter_context(safe_files.opened_dir(fd, name))
            yield fd


@contextlib.contextmanager
def _folder(directory: int | str | os.PathLike) -> Iterator[int]:
    """A descriptor of ``directory``: given (not closed here), or opened from a path."""
    if isinstance(directory, int):
        yield directory
    else:
        with safe_files.opened_dir(None, directory) as fd:
            yield fd


# -- writing ------------------------------------------------------------------------------


def write_replica(dir_fd: int, state: ReplicaState, replica_index: int,
                  replica_size: int, window: Callable[[], dict[str, np.ndarray]] | None = None
                  ) -> tuple[list[str], int, int]:
    """Write ``state`` as replica ``replica_index``'s files into folder ``dir_fd`` (new
    files only; a table's rows a dict of arrays, or the live table, streamed:
    :func:`persia_py.servers.table_files.write_table`); returns (the file names,
    ``ps-<r>.json`` last; rows; bytes). The one writer of checkpoints and incremental
    exports. ``window``: the exactly-once window to write, taken once the rows are
    written (live tables are streamed: as a copy, the window comes after the rows);
    None: ``state.seen``."""
    r = replica_index
    names: list[str] = []
    tables, num_rows, num_bytes = {}, 0, 0
    for t, (name, rows) in enumerate(sorted(state.tables.items())):
        if isinstance(rows, RowChunks):
            raise TypeError(f"table {name!r}: rows being loaded cannot be written")
        description, size = write_table(dir_fd, f"ps-{r}-t{t}", rows)
        names.extend(description["files"][key] for key in ARRAYS)
        num_rows += description["num_rows"]
        num_bytes += size
        tables[name] = description
    # The exactly-once window, least recently updating worker first. File names are
    # numbered: a worker id is a value in the JSON, never part of a name.
    seen = []
    for k, (worker_id, sequences) in enumerate((state.seen if window is None
                                                else window()).items()):
        file = f"ps-{r}-seen{k}.npy"
        num_bytes += safe_files.save_array_at(dir_fd, file, sequences)
        names.append(file)
        seen.append([worker_id, file])
    safe_files.save_json_at(dir_fd, replica_file(r), {
        "replica_index": r, "replica_size": replica_size, "settings": state.settings,
        "tables": tables, "seen": seen, "increment_seq": int(state.increment_seq)})
    names.append(replica_file(r))
    return names, num_rows, num_bytes


def dump_replica(ps: ParameterServer, directory: int | str | os.PathLike, *,
                 path: str | os.PathLike | None = None) -> tuple[int, int]:
    """Write ``ps``'s state into the checkpoint folder ``directory`` (an open descriptor,
    or a path; ``path`` names a descriptor's folder for the update log); returns (rows,
    bytes). The files are written into a private folder inside it, then renamed into
    it, ``ps-<r>.json`` last.

    Each internal shard's rows are streamed to the files under its lock (no copy: its
    lookups wait meanwhile); the caller makes the cut consistent across tables and
    replicas by dumping only when no update is in flight (``TrainCtx.dump_checkpoint``
    flushes and barriers first).
    """
    started = time.perf_counter()
    if not isinstance(directory, int):
        path = directory
    if not ps.configured:
        raise FailedPrecondition("nothing to dump: no embedding optimizer configured yet")
    with _folder(directory) as fd:
        if _exists(fd, fmt.MANIFEST):
            raise FailedPrecondition(f"the checkpoint is complete (it has {fmt.MANIFEST}): "
                                     "Dump writes only into a checkpoint being written")
        if ps.update_log is not None and path is not None:
            # Cut the log before copying: an update caught in both is in the copied
            # exactly-once window too, so a replay from this checkpoint skips it.
            ps.update_log.begin("cut", Path(path).absolute())
        state = ps.state_dict(stream=True)
        with safe_files.private_dir(fd) as private:
            names, num_rows, num_bytes = write_replica(private, state, ps.replica_index,
                                                       ps.replica_size, ps.export_seen)
            safe_files.move_into(private, fd, names)
    logger.info("replica %d dumped %d rows (%.1f MB) in %.2fs", ps.replica_index, num_rows,
                num_bytes / 1e6, time.perf_counter() - started)
    return num_rows, num_bytes


def _exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` (a file, folder or link) is in folder ``dir_fd``."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


# -- reading ------------------------------------------------------------------------------


_T = TypeVar("_T")


def _value(data: object, key: str, kind: type[_T], where: str) -> _T:
    """``data[key]`` if ``data`` is a mapping holding a ``kind`` there; CheckpointError if not."""
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise safe_files.CheckpointError(f"{where}: {key!r} is missing or not a "
                                  f"{getattr(kind, '__name__', kind)}")
    return value


def _int(data: object, key: str, where: str, low: int, high: int) -> int:
    value = _value(data, key, int, where)
    if not low <= value <= high:
        raise safe_files.CheckpointError(f"{where}: {key!r} = {value} is not in [{low}, {high}]")
    return value


def read_replica(dir_fd: int, index: int, replica_size: int | None = None) -> dict:
    """The description ``ps-<index>.json`` in ``dir_fd``, its structure checked (file
    names are plain names; CheckpointError says what is wrong)."""
    where = replica_file(index)
    entry = safe_files.load_json_at(dir_fd, where)
    if _int(entry, "replica_index", where, 0, MAX_REPLICAS) != index:
        raise safe_files.CheckpointError(f"{where}: says it is replica {entry['replica_index']}")
    if replica_size is not None and _int(entry, "replica_size", where, 1,
                                         MAX_REPLICAS) != replica_size:
        raise safe_files.CheckpointError(f"{where}: taken with {entry['replica_size']} replicas, "
                                  f"the manifest says {replica_size}")
    for name, table in _value(entry, "tables", dict, where).items():
        at = f"{where}: table {name!r}"
        files = _value(table, "files", dict, at)
        if set(files) != set(ARRAYS):
            raise safe_files.CheckpointError(f"{at}: files must be exactly {sorted(ARRAYS)}")
        for key, file in files.items():
            safe_files.check_name(file, f"{at}: files.{key}")
        check_sums(table, at)
        _int(table, "dim", at, 1, 2**20)
        _int(table, "state_width", at, 0, 2**21)
        _int(table, "num_rows", at, 0, 2**62)
        _int(table, "clock", at, 0, 2**62)
        # Written before rows had storage types: float32.
        row_dtype = table.setdefault("row_dtype", "float32")
        if row_dtype not in row_types.ROW_DTYPES:
            raise safe_files.CheckpointError(f"{at}: row_dtype {str(row_dtype)[:32]!r} is not one of "
                                      f"{list(row_types.ROW_DTYPES)}")
    seen = entry.get("seen", [])
    if isinstance(seen, dict):  # written before the window kept its order
        seen = sorted(seen.items())
    if not isinstance(seen, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in seen):
        raise safe_files.CheckpointError(f"{where}: 'seen' must list [worker id, file] pairs")
    for worker_id, file in seen:
        safe_files.check_name(file, f"{where}: seen file of {worker_id[:128]!r}")
    entry["seen"] = seen
    return entry


def read_rows(dir_fd: int, table: dict, where: str, keep: tuple[int, int] | None) -> Rows:
    """One table's rows from its files (``table`` as :func:`read_replica` checked it):
    dtypes, shapes and checksums must match the description. ``keep`` = (replica index,
    replica count): only the rows that route to that replica."""
    with contextlib.ExitStack() as stack:
        files = TableFiles(dir_fd, table, where, keep, stack)
        parts = [(w.copy(), s.copy()) for w, s, _ in files.chunks()]
    width = table["state_width"]
    weights = row_types.numpy_dtype(table["row_dtype"])
    rows: Rows = {
        "ids": files.ids, "last_access": files.last_access,
        "weights": (np.concatenate([w for w, _ in parts]) if parts
                    else np.zeros((0, table["dim"]), weights)),
        "state": (np.concatenate([s for _, s in parts]) if parts
                  else np.zeros((0, width), np.float32))}
    rows["clock"] = table["clock"]
    rows["row_dtype"] = table["row_dtype"]
    return rows


def one_row_dtype(parts: list[Rows]) -> tuple[list[Rows], str]:
    """``parts`` with their weights in one storage type, and that type: theirs if they
    agree, else float32 (which holds every type exactly)."""
    kinds = {p.get("row_dtype", "float32") for p in parts}
    if len(kinds) == 1:
        return parts, kinds.pop()
    return [dict(p, weights=row_types.to_float32(p["weights"], p.get("row_dtype", "float32")),
                 row_dtype="float32") for p in parts], "float32"


def read_state(dir_fd: int, replica_index: int, replica_size: int,
               stack: contextlib.ExitStack) -> tuple[ReplicaState, int]:
    """The state of replica ``replica_index`` of ``replica_size`` in the complete checkpoint
    folder ``dir_fd`` (rows of every replica that route to it), and the bytes it holds:
    each table's ids and stamps read, its weights and state to be read chunk by chunk as
    the table loads them (:class:`persia_py.servers.row_stream.RowChunks`; the files stay
    open until ``stack`` closes)."""
    manifest = fmt.check_manifest(safe_files.load_json_at(dir_fd, fmt.MANIFEST), fmt.MANIFEST)
    num_replicas = _int(manifest, "num_ps_replicas", fmt.MANIFEST, 1, MAX_REPLICAS)
    entries = [read_replica(dir_fd, i, num_replicas) for i in range(num_replicas)]
    settings = entries[0].get("settings")
    if any(e.get("settings") != settings for e in entries):
        raise safe_files.CheckpointError("the replicas' optimizer settings differ")
    parts: dict[str, list[TableFiles]] = {}
    windows: dict[str, list[np.ndarray]] = {}
    num_bytes = 0
    for i, entry in enumerate(entries):
        for name, table in entry["tables"].items():
            files = TableFiles(dir_fd, table, f"{replica_file(i)}: table {name!r}",
                               (replica_index, replica_size), stack)
            row_bytes = sum(r.row_bytes for r in files.readers.values())
            num_bytes += files.ids.shape[0] * row_bytes
            parts.setdefault(name, []).append(files)
        # Sequence numbers are unique per worker across replicas: the union is safe after
        # re-sharding too.
        for worker_id, file in entry["seen"]:
            windows.setdefault(worker_id, []).append(safe_files.load_array_at(dir_fd, file))
    tables = {name: row_chunks(p) for name, p in parts.items()}
    seen = {}
    for worker_id, arrays in windows.items():
        if any(a.ndim != 1 or a.dtype not in (np.uint64, np.int64) for a in arrays):
            raise safe_files.CheckpointError(f"the window of worker {worker_id[:128]!r} is not a 1-D "
                                      "integer array")
        seen[worker_id] = np.unique(np.concatenate([a.astype(np.uint64) for a in arrays]))
    return ReplicaState(settings=settings, tables=tables, seen=seen), num_bytes


def load_replica(ps: ParameterServer, checkpoint: int | str | os.PathLike, *,
                 path: str | os.PathLike | None = None) -> tuple[int, int]:
    """Replace ``ps``'s state by the rows of ``checkpoint`` that route to it: an open
    descriptor of a complete checkpoint folder (``path`` names it for the update log),
    or a path (a root: its ``LATEST``; or a folder). The optimizer settings come from
    the checkpoint; a server already configured with other settings refuses
    (FailedPrecondition). All or nothing. Returns (rows loaded, bytes read)."""
    started = time.perf_counter()
    if not isinstance(checkpoint, int):
        checkpoint = path = fmt.resolve(checkpoint)
    with contextlib.ExitStack() as stack:
        with _folder(checkpoint) as fd:
            state, num_bytes = read_state(fd, ps.replica_index, ps.replica_size, stack)
        try:
            num_rows = ps.load_state_dict(state)
        except safe_files.CheckpointError:
            raise
        except ValueError as exc:
            raise safe_files.CheckpointError(f"checkpoint does not fit: {exc}") from None
    if ps.update_log is not None and path is not None:
        # What the log held before is another timeline now.
        ps.update_log.begin("load", Path(path).absolute())
    logger.info("replica %d of %d loaded %d rows in %.2fs", ps.replica_index, ps.replica_size,
                num_rows, time.perf_counter() - started)
    return num_rows, num_bytes


# -- the service --------------------------------------------------------------------------


def _names(request: pb.DumpRequest | pb.LoadRequest) -> list[tuple[str, str]]:
    folder = [(request.folder, "folder")] if request.folder else []
    return [*folder, (request.checkpoint, "checkpoint")]


@contextlib.contextmanager
def _file_errors(what: str) -> Iterator[None]:
    """The file system's refusals (permissions, a full disk) as FailedPrecondition."""
    try:
        yield
    except OSError as exc:
        raise FailedPrecondition(f"{what}: {exc.strerror or exc}") from None


class CheckpointServicer(checkpoint_pb2_grpc.ParameterServerCheckpointServicer):
    """Dump and Load of one replica, inside ``root``."""

    def __init__(self, ps: ParameterServer, root: CheckpointRoot) -> None:
        self.ps, self.root = ps, root

    def _path(self, names: list[tuple[str, str]]) -> Path:
        """The folder ``names`` open (checked by ``root.open``), for the update log."""
        return self.root.path.joinpath(*(name for name, _ in names))

    @grpc_method
    def Dump(self, request: pb.DumpRequest, context: grpc.ServicerContext) -> pb.DumpResponse:
        names = _names(request)
        with _file_errors("Dump"), self.root.open(*names) as fd:
            num_rows, num_bytes = dump_replica(self.ps, fd, path=self._path(names))
        return pb.DumpResponse(num_rows=num_rows, num_bytes=num_bytes,
                               replica_index=self.ps.replica_index,
                               replica_size=self.ps.replica_size)

    @grpc_method
    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        names = _names(request)
        with _file_errors("Load"), self.root.open(*names) as fd:
            num_rows, num_bytes = load_replica(self.ps, fd, path=self._path(names))
        return pb.LoadResponse(num_rows=num_rows, num_bytes=num_bytes)


def add_checkpoint_service(ps: ParameterServer, server: grpc.Server,
                           root: CheckpointRoot | str | os.PathLike | None) -> None:
    """Serve Dump and Load of ``ps`` inside ``root`` (None: the current directory); a
    serving (inference) replica offers neither (UNIMPLEMENTED)."""
    if ps.inference:
        return
    if not isinstance(root, CheckpointRoot):
        root = CheckpointRoot(root or os.getcwd())
    checkpoint_pb2_grpc.add_ParameterServerCheckpointServicer_to_server(
        CheckpointServicer(ps, root), server)


__all__ = ["CheckpointRoot", "add_checkpoint_service", "dump_replica", "load_replica",
           "read_replica", "read_rows", "read_state", "write_replica"]
