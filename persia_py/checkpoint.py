"""Checkpoints of a training job: ``TrainCtx.dump_checkpoint`` / ``load_checkpoint``.

A checkpoint holds every parameter-server replica's rows with their optimizer state and
the optimizer settings, the dense model and its optimizer, torch's RNG state, and the
number of batches each NN-worker rank has trained (the data position). The format is in
:mod:`persia_py.checkpoint_format`.

**A consistent cut.** Before asking the servers to dump, every rank waits until the
servers have acknowledged each of its embedding updates (``TrainCtx.flush``) and the
ranks meet at a barrier; rank 0 then has every replica dump its tables (each internal
shard under its lock) and writes the dense state, and the ranks meet again once the
checkpoint is committed. No update is half in a checkpoint. Lookups of batches not yet
trained may still insert rows meanwhile; such rows hold only their deterministic initial
values, so whether they are in the checkpoint or not changes nothing.

**Where.** The servers write and read only inside the job's checkpoint root
(``checkpoint_config.root``, else the current directory): a checkpoint root given to
``dump_checkpoint`` (``ROOT`` or ``ROOT/NAME``) and a checkpoint given to
``load_checkpoint`` must lie there; the calls carry the names that lead to the folder.

**Resume.** ``persia-launcher local --resume DIR`` sets ``PERSIA_RESUME_DIR`` for the NN
workers (``TrainCtx`` loads the checkpoint on entry) and ``PERSIA_SKIP_BATCHES`` (the
batches already trained) for the data loaders (``DataCtx.send_data`` drops that many of
its first batches, each loader its share). That is exact with one data loader, as in
``reproducible`` mode; with several, which loader's batches were trained depends on
timing, and each loader skips an equal share.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from persia_py import checkpoint_format as fmt
from persia_py.config import CheckpointConfig, CommonConfig
from persia_py.proto import checkpoint_pb2 as pb
from persia_py.proto import checkpoint_pb2_grpc
from persia_py.rpc import call, create_channel, wait_for_ready
from persia_py.stateful import Stateful

logger = logging.getLogger(__name__)

ENV_RESUME_DIR = "PERSIA_RESUME_DIR"
"""A checkpoint (root or folder) that ``TrainCtx`` loads on entry."""


class PSCheckpointClient:
    """Dump and Load calls to the parameter-server replicas at ``addresses``.

    The servers read and write only inside their checkpoint root (``root``, the same
    folder: ``checkpoint_config.root``, else the current directory); the calls carry the
    names that lead from it to a checkpoint folder, never a path.
    """

    def __init__(self, addresses: list[str] | tuple[str, ...], common: CommonConfig,
                 root: str | os.PathLike | None = None) -> None:
        if not addresses:
            raise RuntimeError("no parameter-server addresses (PERSIA_PS_ADDRS is empty); "
                               "checkpoints need them")
        self.addresses = list(addresses)
        self.common = common
        self.root = fmt.configured_root(root)
        self._channels = [create_channel(a, common) for a in self.addresses]
        self._stubs = [checkpoint_pb2_grpc.ParameterServerCheckpointStub(c)
                       for c in self._channels]

    def wait_ready(self) -> None:
        for channel, address in zip(self._channels, self.addresses):
            wait_for_ready(channel, address, self.common.startup_timeout_sec)

    def _each(self, method: str, request) -> list:
        def one(i: int):
            return call(getattr(self._stubs[i], method), request,
                        timeout=self.common.rpc_timeout_sec, idempotent=True,
                        what=f"parameter server {self.addresses[i]}")

        with ThreadPoolExecutor(max_workers=len(self._stubs)) as pool:
            return list(pool.map(one, range(len(self._stubs))))

    def _names(self, folder: str | Path, what: str) -> dict[str, str]:
        *parent, checkpoint = fmt.names_in_root(self.root, folder, what)
        return {"folder": parent[0] if parent else "", "checkpoint": checkpoint}

    def dump(self, directory: str | Path) -> list[pb.DumpResponse]:
        """Every replica writes its tables into the checkpoint folder ``directory`` (in
        the checkpoint root); answers in replica order."""
        answers = self._each("Dump", pb.DumpRequest(**self._names(directory, "dump_checkpoint")))
        indices = [a.replica_index for a in answers]
        if indices != list(range(len(answers))) or any(
                a.replica_size != len(answers) for a in answers):
            raise RuntimeError(f"parameter servers answered as replicas {indices} of "
                               f"{[a.replica_size for a in answers]}; PERSIA_PS_ADDRS must list "
                               "replica 0, 1, ... in order")
        return answers

    def load(self, folder: str | Path) -> list[pb.LoadResponse]:
        """Every replica loads the complete checkpoint ``folder`` (in the checkpoint root)."""
        return self._each("Load", pb.LoadRequest(**self._names(folder, "load_checkpoint")))

    def close(self) -> None:
        for c in self._channels:
            c.close()


def _write_file(folder: Path, name: str, contents: bytes) -> None:
    """Write ``contents`` as the new file ``name`` in ``folder``, durably."""
    fmt.check_name(name, "file name")
    with open(folder / name, "xb") as f:
        f.write(contents)
        f.flush()
        os.fsync(f.fileno())


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _gather_steps(steps: int, device: torch.device) -> list[int]:
    rank, world = _world()
    if world == 1:
        return [steps]
    backend_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([steps], dtype=torch.int64, device=backend_device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


STATE_KEYS = ("model", "dense_optimizer", "train_state")
"""What a rank's ``states`` hold: the dense model, its optimizer and its
:class:`~persia_py.stateful.TrainState` (batches trained)."""


class Checkpointer:
    """Checkpoints of one training rank: the servers' tables plus the rank's ``states``.

    Args:
        states: :data:`STATE_KEYS` -> :class:`~persia_py.stateful.Stateful` (what
            ``TrainCtx.state_dict()`` returns); read and restored through that
            interface only.
        flush: waits until the servers have acknowledged every embedding update this
            rank sent (the consistent cut).
        ps_addrs: the parameter-server replicas, in replica order.
        common: deadlines and channel settings.
        config: checkpoint root, periodic folder and interval.
        device: where this rank's collectives run (for the step counts).
    """

    def __init__(self, states: Mapping[str, Stateful], *, flush: Callable[[], None],
                 ps_addrs: Sequence[str], common: CommonConfig, config: CheckpointConfig,
                 device: torch.device) -> None:
        missing = [k for k in STATE_KEYS if not isinstance(states.get(k), Stateful)]
        if missing:
            raise TypeError(f"states must map {list(STATE_KEYS)} to Stateful objects; "
                            f"missing or not Stateful: {missing}")
        self.states = dict(states)
        self._flush = flush
        self._ps_addrs = tuple(ps_addrs)
        self._common = common
        self._config = config
        self._device = device
        self.periodic_dir = config.dir
        self.every_steps = config.every_steps
        self._client: PSCheckpointClient | None = None

    @property
    def steps(self) -> int:
        """Batches this rank has trained, including those before the loaded checkpoint."""
        return self.states["train_state"].state_dict()["steps"]

    def _ps(self) -> PSCheckpointClient:
        if self._client is None:
            self._client = PSCheckpointClient(self._ps_addrs, self._common, self._config.root)
            self._client.wait_ready()
        return self._client

    def resume_if_asked(self) -> None:
        path = os.environ.get(ENV_RESUME_DIR)
        if path:
            logger.info("resuming from checkpoint %s", path)
            self.load(path)

    def after_step(self) -> None:
        if self.every_steps and self.steps % self.every_steps == 0:
            self.dump(self.periodic_dir)

    def dump(self, root: str | os.PathLike, *, extra_files: Mapping[str, bytes] | None = None
             ) -> Path | None:
        """Write a checkpoint into ``root``; returns its folder on rank 0 (None elsewhere).

        ``extra_files`` (name -> contents, e.g. a TorchScript of the model) are written
        into the checkpoint folder by rank 0 before it is committed."""
        started = time.perf_counter()
        self._flush()
        _barrier()  # every rank's updates are acknowledged: the cut is consistent
        rank_steps = _gather_steps(self.steps, self._device)
        rank, world = _world()
        final = None
        if rank == 0:
            final = self._write(Path(root), rank_steps, world, dict(extra_files or {}))
            logger.info("checkpoint %s written in %.2fs", final, time.perf_counter() - started)
        _barrier()
        return final

    def _write(self, root: Path, rank_steps: list[int], world: int,
               extra_files: dict[str, bytes]) -> Path:
        tmp = fmt.new_tmp_dir(root)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ps_answers = pool.submit(self._ps().dump, tmp)
            fmt.save_tensors(tmp, "dense-model", self.states["model"].state_dict())
            fmt.save_optimizer(tmp, "dense-optimizer", self.states["dense_optimizer"])
            fmt.save_array(tmp / "torch-rng-state.npy", torch.get_rng_state().numpy())
            for name, contents in extra_files.items():
                _write_file(tmp, name, contents)
            answers = ps_answers.result()
        manifest = {
            "num_ps_replicas": len(answers),
            "ps_rows": [a.num_rows for a in answers],
            "ps_bytes": [a.num_bytes for a in answers],
            "world_size": world,
            "rank_steps": rank_steps,
            "created_unix": time.time(),
        }
        return fmt.commit(tmp, manifest, step=sum(rank_steps))

    def load(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint (a root or one checkpoint folder) into the servers and the model."""
        started = time.perf_counter()
        folder = fmt.resolve(path)
        manifest = fmt.load_json(folder / fmt.MANIFEST)
        rank, world = _world()
        rank_steps = manifest["rank_steps"]
        if len(rank_steps) == world:
            steps = rank_steps[rank]
        else:  # a different number of ranks: each takes an equal share of the count
            total = sum(rank_steps)
            steps = total // world + (rank < total % world)
        if rank == 0:
            self._ps().load(folder)
        self.states["model"].load_state_dict(fmt.load_tensors(folder, "dense-model"))
        fmt.load_optimizer(folder, "dense-optimizer", self.states["dense_optimizer"])
        self.states["train_state"].load_state_dict({"steps": steps})
        rng = fmt.load_array(folder / "torch-rng-state.npy")
        torch.set_rng_state(torch.from_numpy(np.array(rng)))
        _barrier()  # no rank trains before the servers hold the checkpoint's rows
        logger.info("checkpoint %s (step %d) loaded in %.2fs", folder, manifest["step"],
                    time.perf_counter() - started)
        return manifest

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

