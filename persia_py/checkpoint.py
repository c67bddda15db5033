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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from persia_py import checkpoint_format as fmt
from persia_py.config import CommonConfig
from persia_py.proto import checkpoint_pb2 as pb
from persia_py.proto import checkpoint_pb2_grpc
from persia_py.rpc import call, create_channel, wait_for_ready

if TYPE_CHECKING:
    from persia_py.ctx import TrainCtx

logger = logging.getLogger(__name__)

ENV_RESUME_DIR = "PERSIA_RESUME_DIR"
"""A checkpoint (root or folder) that ``TrainCtx`` loads on entry."""


class PSCheckpointClient:
    """Dump and Load calls to the parameter-server replicas at ``addresses``."""

    def __init__(self, addresses: list[str] | tuple[str, ...], common: CommonConfig) -> None:
        if not addresses:
            raise RuntimeError("no parameter-server addresses (PERSIA_PS_ADDRS is empty); "
                               "checkpoints need them")
        self.addresses = list(addresses)
        self.common = common
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

    def dump(self, directory: str | Path) -> list[pb.DumpResponse]:
        """Every replica writes its tables into ``directory``; answers in replica order."""
        answers = self._each("Dump", pb.DumpRequest(directory=str(Path(directory).resolve())))
        indices = [a.replica_index for a in answers]
        if indices != list(range(len(answers))) or any(
                a.replica_size != len(answers) for a in answers):
            raise RuntimeError(f"parameter servers answered as replicas {indices} of "
                               f"{[a.replica_size for a in answers]}; PERSIA_PS_ADDRS must list "
                               "replica 0, 1, ... in order")
        return answers

    def load(self, path: str | Path) -> list[pb.LoadResponse]:
        return self._each("Load", pb.LoadRequest(directory=str(Path(path).resolve())))

    def close(self) -> None:
        for c in self._channels:
            c.close()


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


class Checkpointer:
    """The checkpoint side of one :class:`~persia_py.ctx.TrainCtx`."""

    def __init__(self, ctx: TrainCtx) -> None:
        self.ctx = ctx
        self.base_steps = 0
        """Batches this rank had trained when the loaded checkpoint was taken."""
        cfg = ctx.global_config.checkpoint_config
        self.periodic_dir = cfg.dir
        self.every_steps = cfg.every_steps
        self._client: PSCheckpointClient | None = None

    @property
    def steps(self) -> int:
        """Batches this rank has trained, including those before the loaded checkpoint."""
        return self.base_steps + self.ctx._num_steps

    def _ps(self) -> PSCheckpointClient:
        if self._client is None:
            self._client = PSCheckpointClient(self.ctx.env.ps_addrs, self.ctx.common)
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

    def dump(self, root: str | os.PathLike) -> Path | None:
        """Write a checkpoint into ``root``; returns its folder on rank 0 (None elsewhere)."""
        started = time.perf_counter()
        ctx = self.ctx
        ctx.flush()
        _barrier()  # every rank's updates are acknowledged: the cut is consistent
        rank_steps = _gather_steps(self.steps, ctx.device)
        rank, world = _world()
        final = None
        if rank == 0:
            final = self._write(Path(root), rank_steps, world)
            logger.info("checkpoint %s written in %.2fs", final, time.perf_counter() - started)
        _barrier()
        return final

    def _write(self, root: Path, rank_steps: list[int], world: int) -> Path:
        ctx = self.ctx
        tmp = fmt.new_tmp_dir(root)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ps_answers = pool.submit(self._ps().dump, tmp)
            fmt.save_tensors(tmp, "dense-model", ctx.model.state_dict())
            fmt.save_optimizer(tmp, "dense-optimizer", ctx.dense_optimizer)
            fmt.save_array(tmp / "torch-rng-state.npy", torch.get_rng_state().numpy())
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
        ctx = self.ctx
        folder = fmt.resolve(path)
        manifest = fmt.load_json(folder / fmt.MANIFEST)
        rank, world = _world()
        rank_steps = manifest["rank_steps"]
        if len(rank_steps) == world:
            self.base_steps = rank_steps[rank]
        else:  # a different number of ranks: each takes an equal share of the count
            total = sum(rank_steps)
            self.base_steps = total // world + (rank < total % world)
        if rank == 0:
            self._ps().load(folder)
        ctx.model.load_state_dict(fmt.load_tensors(folder, "dense-model"))
        fmt.load_optimizer(folder, "dense-optimizer", ctx.dense_optimizer)
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

