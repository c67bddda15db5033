"""Going back to a checkpoint when torchrun, not the launcher, restarted the NN ranks.

A dead NN rank loses the dense state and the batches in flight, so the training goes back
to its last checkpoint. ``persia-launcher local`` can do that itself (it stops and
restarts every training role, see ``persia_py/launcher/recovery.py``). Under torchrun's
own restarts (``--max-restarts``, as on Kubernetes, where the embedding workers and data
loaders run in pods of their own) the ranks come back alone, and nobody else knows. So
rank 0 of a restarted training, before anything is trained:

1. asks every data loader to **rewind** (``Rewind``): the loader writes the checkpoint's
   data positions beside its handover log, with the stream that log names, and exits
   with :data:`EXIT_CODE`; started again by its supervisor (``local``, a StatefulSet),
   it finds them, starts a new handover log and a new stream, and makes exactly the
   batches the checkpoint does not hold as trained. Only a restart takes them, and only
   when they name the stream of the log it replays: positions this job's loader wrote
   during this run. A file left by another run, or planted, is removed, not honoured;
2. asks every embedding worker to **restart** (``Restart``): it exits and comes back
   empty, holding no batch of the stream before;
3. waits until each of them answers ``Health`` as a new process (:data:`INSTANCE`
   differs), then loads the checkpoint into the parameter servers and the dense tower as
   any resumed training does.

Both calls are authenticated like every other; they are answered before the process
exits, so a caller is never left guessing whether it was heard.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import grpc

from persia_py.config import CommonConfig
from persia_py.ids.positions import DataPositions, Position
from persia_py.ops import safe_files
from persia_py.ops.private_files import open_private
from persia_py.proto import common_pb2, data_loader_pb2_grpc, embedding_worker_pb2_grpc
from persia_py.telemetry.events import Event, emit
from persia_py.wire.rpc import call, create_channel

logger = logging.getLogger(__name__)

EXIT_CODE = 75
"""How a data loader or embedding worker exits to be started again (EX_TEMPFAIL): its
supervisor restarts it without counting a failure."""
INSTANCE = secrets.token_hex(8)
"""This process's identity in ``Health`` answers: random per start."""
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun restarted this rank's training (0: a first start)."""
    text = os.environ.get(ENV_RESTART_COUNT, "")
    return int(text) if text.isdigit() else 0


def restarted_by_torchrun() -> bool:
    return restart_count() > 0


def rewind_file(handover_log: str | os.PathLike) -> Path:
    """Where a rewound loader finds the positions it goes on from."""
    return Path(f"{handover_log}.rewind")


def write_rewind(handover_log: str | os.PathLike, positions: DataPositions,
                 stream: str | None) -> None:
    """Write ``positions`` for the next start of this loader, tagged with the ``stream``
    its handover log names: whole or not at all, readable by its owner only."""
    path = rewind_file(handover_log)
    tmp = path.with_name(path.name + ".tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, json.dumps({"stream": stream, "positions": positions.to_text()}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_rewind(handover_log: str | os.PathLike, *, stream: str | None) -> DataPositions | None:
    """The positions a ``Rewind`` left for this start (None: there are none). ``stream``:
    the stream of the handover log this start replays (None on a first start). Positions
    that name another stream (another run's, or planted) are not honoured: the file is
    removed and None returned."""
    path = rewind_file(handover_log)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        named, positions = record["stream"], record["positions"]
    except (ValueError, KeyError, TypeError):
        named = positions = None
    if stream is None or named != stream:
        logger.warning("%s: not positions of the stream this start replays (%s); removed, "
                       "not honoured", path, stream or "none: a first start")
        path.unlink(missing_ok=True)
        return None
    return DataPositions.from_text(positions, str(path))


def check_made(position: Position, loader: int, num_made: int) -> None:
    """ValueError unless ``position`` (loader ``loader``'s, from a ``Rewind``) names only
    batches this loader's stream has made: sequence numbers below ``num_made``.

    A checkpoint holds as trained only batches that were trained, so only batches the
    loader made: every checkpoint of this stream passes. Positions past what was made
    would have the loader skip batches nobody trained (with numbers far enough ahead, its
    whole input), and a stream's position log drop the records of the batches to come
    (:mod:`persia_py.stream_source`). Whether a checkpoint recorded these very positions
    the loader cannot tell: checkpoints live with the NN ranks, often on another host."""
    beyond = [s for s in position.also if s >= num_made]
    if position.next > num_made or beyond:
        raise ValueError(
            f"RestartRequest.positions[{loader}]: data loader {loader} has made only the "
            f"batches of sequence numbers below {num_made}, so no checkpoint of its stream "
            f"holds a later one as trained; got next={position.next}"
            + (f", also {beyond[:5]}{'...' if len(beyond) > 5 else ''}" if beyond else ""))


def exit_after_answer(context: grpc.ServicerContext, what: str) -> None:
    """Exit with :data:`EXIT_CODE` once this call's answer is on its way."""

    def stop() -> None:
        logger.warning("%s: exiting to be started again (code %d)", what, EXIT_CODE)
        logging.shutdown()
        os._exit(EXIT_CODE)

    # The callback runs when the call is over; the short delay lets the answer leave.
    context.add_callback(lambda: threading.Timer(0.2, stop).start())


def rewind_roles(*, loaders: list[str], embedding_workers: list[str], positions: DataPositions,
                 common: CommonConfig, reason: str) -> None:
    """Steps 1-3 of the module docstring, from rank 0 of a restarted training."""
    request = common_pb2.RestartRequest(reason=reason, positions=positions.to_text())
    channels = {a: create_channel(a, common) for a in [*loaders, *embedding_workers]}
    targets = ([("data loader", a, data_loader_pb2_grpc.DataLoaderStub(channels[a]), "Rewind")
                for a in loaders]
               + [("embedding worker", a, embedding_worker_pb2_grpc.EmbeddingWorkerStub(
                   channels[a]), "Restart") for a in embedding_workers])
    try:
        _restart_and_wait(targets, request, common, reason)
    finally:
        for channel in channels.values():
            channel.close()


def _restart_and_wait(targets, request, common: CommonConfig, reason: str) -> None:
    before = {}
    for kind, address, stub, method in targets:  # loaders first: they feed the workers
        answer = call(getattr(stub, method), request, timeout=common.rpc_timeout_sec,
                      idempotent=True, what=f"{kind} {address}")
        before[address] = answer.instance
    deadline = time.monotonic() + common.startup_timeout_sec
    for kind, address, stub, _ in targets:
        while True:
            try:
                health = stub.Health(common_pb2.HealthRequest(), timeout=5)
                if health.instance and health.instance != before[address]:
                    break
            except grpc.RpcError:
                pass  # exiting, or not started again yet
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {kind} at {address} did not come back within "
                    f"common_config.startup_timeout_sec ({common.startup_timeout_sec} s) after "
                    f"it was asked to restart for a rewind ({reason}): it needs a supervisor "
                    "that starts it again (persia-launcher local, a Kubernetes StatefulSet)")
            time.sleep(0.2)
        logger.info("%s %s is back as a new process", kind, address)


def rewind_after_restart(*, periodic_dir: str | None, loaders: list[str],
                         embedding_workers: list[str], common: CommonConfig,
                         rank: int) -> str | None:
    """When torchrun restarted this training: the checkpoint it goes back to (rank 0 has
    rewound the data loaders and embedding workers to it; the caller barriers the ranks
    after this); None on a first start. Raises when there is no checkpoint to go back to."""
    if not restarted_by_torchrun():
        return None
    from persia_py.checkpoint import layout as fmt

    folder = fmt.latest(periodic_dir) if periodic_dir else None
    count = os.environ.get(ENV_RESTART_COUNT)
    if folder is None:
        raise RuntimeError(
            f"torchrun restarted the NN ranks (restart {count}), but there is no checkpoint "
            "to go back to: the parameter servers and data loaders hold what the dead "
            "training did. Set checkpoint_config.dir and every_steps (a restart before the "
            "first periodic checkpoint cannot be healed), or restart the whole job")
    if rank == 0:
        manifest = safe_files.load_json(Path(folder) / fmt.MANIFEST)
        positions = DataPositions.from_json(fmt.data_positions(manifest), f"{folder} data_positions")
        logger.warning("NN ranks restarted by torchrun (restart %s): going back to checkpoint "
                       "%s; rewinding %d data loaders and restarting %d embedding workers",
                       count, folder, len(loaders), len(embedding_workers))
        emit(Event.TRAINING_REWOUND, restart=count, checkpoint=str(folder))
        rewind_roles(loaders=loaders, embedding_workers=embedding_workers, positions=positions,
                     common=common, reason=f"torchrun restart {count}: back to {folder}")
    return str(folder)
