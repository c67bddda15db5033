"""Checkpoints of a training job: ``TrainCtx.dump_checkpoint`` / ``load_checkpoint``.

A checkpoint holds every parameter-server replica's rows with their optimizer state and
the optimizer settings, the dense model and its optimizer, torch's RNG state, and the
number of batches each NN-worker rank has trained (the data position). The format is in
:mod:`persia_py.checkpoint.layout`.

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
workers (``TrainCtx`` loads the checkpoint on entry) and ``PERSIA_DATA_POSITIONS`` for the
data loaders: each loader's position in the checkpoint (its first batch not trained, and
any later ones trained already; :mod:`persia_py.ids.positions`), so that it skips exactly
the batches the checkpoint holds as trained.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.stateful import Stateful, TrainState
from persia_py.config import CheckpointConfig, CommonConfig
from persia_py.dense.collectives import WorldJoinable
from persia_py.ids.positions import DataPositions
from persia_py.ops import safe_files
from persia_py.proto import checkpoint_pb2 as pb
from persia_py.proto import checkpoint_pb2_grpc
from persia_py.wire.address_book import AddressBook, servers_now
from persia_py.wire.rpc import ServiceClient

logger = logging.getLogger(__name__)


class _CheckpointReplica(ServiceClient):
    """The checkpoint service of one parameter-server replica."""

    service_name = "parameter server"
    stub_class = checkpoint_pb2_grpc.ParameterServerCheckpointStub

    def request(self, method: str, request: Any) -> Any:
        """``method`` of the service (Dump, Load), retried as every idempotent call."""
        return self._call(f"stub.{method}", request, idempotent=True)


class PSCheckpointClient:
    """Dump and Load calls to the parameter-server replicas at ``addresses``.

    The servers read and write only inside their checkpoint root (``root``, the same
    folder: ``checkpoint_config.root``, else the current directory); the calls carry the
    names that lead from it to a checkpoint folder, never a path. With ``book`` (the job's
    address book), a replica that moved (a spare node) is called where the book says
    (persia_py/wire/address_book.py), from the start and once a call finds it gone.
    """

    def __init__(self, addresses: list[str] | tuple[str, ...], common: CommonConfig,
                 root: str | os.PathLike | None = None, *,
                 book: AddressBook | None = None) -> None:
        if not addresses:
            raise RuntimeError("no parameter-server addresses (PERSIA_PS_ADDRS is empty); "
                               "checkpoints need them")
        self.common = common
        self.root = safe_files.configured_root(root)
        self._replicas = [_CheckpointReplica(a, common, book=e)
                          for a, e in servers_now(addresses, book)]

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas]

    def wait_ready(self) -> None:
        for replica in self._replicas:
            replica.wait_ready()

    def _each(self, method: str, request) -> list:
        with ThreadPoolExecutor(max_workers=len(self._replicas)) as pool:
            return list(pool.map(lambda r: r.request(method, request), self._replicas))

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
        for replica in self._replicas:
            replica.close()


def _write_file(folder: Path, name: str, contents: bytes) -> None:
    """Write ``contents`` as the new file ``name`` in ``folder``, durably."""
    safe_files.check_name(name, "file name")
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


def _gather(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (lists of any length), in rank order."""
    rank, world = _world()
    if world == 1:
        return [list(values)]
    backend_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64, device=backend_device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=backend_device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.int64, device=backend_device)
    padded[:mine.numel()] = mine
    every = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(every, padded)
    return [t[:int(n.item())].tolist() for t, n in zip(every, sizes)]


def _share(counts: list[int], rank: int, world: int) -> int:
    """Rank ``rank``'s count of a checkpoint's per-rank ``counts``: its own with as many
    ranks, else an equal share of their sum."""
    if len(counts) == world:
        return counts[rank]
    total = sum(counts)
    return total // world + (rank < total % world)


STATE_KEYS = ("model", "dense_optimizer", "train_state")
"""What a rank's ``states`` hold: the dense model, its optimizer and its
:class:`~persia_py.checkpoint.stateful.TrainState` (batches trained)."""


class _PeriodicJoinHook(JoinHook):
    """Run by a rank out of batches while the others train on (``Join``): at each of
    their periodic checkpoint steps it answers their vote with "not training", so they
    skip that checkpoint instead of waiting for this rank at its barrier."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer

    def main_hook(self) -> None:  # once per step of the ranks still training
        self._checkpointer.train_state.shadowed()  # the job's step goes on
        if self._checkpointer.is_periodic(self._checkpointer.job_step):
            self._checkpointer.vote(training=False)


class Checkpointer(WorldJoinable):
    """Checkpoints of one training rank: the servers' tables plus the rank's ``states``.

    Args:
        states: :data:`STATE_KEYS` -> :class:`~persia_py.checkpoint.stateful.Stateful` (what
            ``TrainCtx.state_dict()`` returns); read and restored through that
            interface only.
        flush: waits until the servers have acknowledged every embedding update this
            rank sent (the consistent cut).
        ps_addrs: the parameter-server replicas, in replica order.
        book: the job's address book, where a replica that moved is found (None: they
            never move).
        common: deadlines and channel settings.
        config: checkpoint root, periodic folder and interval.
        device: where this rank's collectives run (for the step counts).
        sharded_dense: the dense model is sharded (FSDP): every rank writes its shards
            with ``torch.distributed.checkpoint`` (:mod:`persia_py.checkpoint.dense`).
    """

    def __init__(self, states: Mapping[str, Stateful], *, flush: Callable[[], None],
                 ps_addrs: Sequence[str], common: CommonConfig, config: CheckpointConfig,
                 device: torch.device, sharded_dense: bool = False,
                 book: AddressBook | None = None) -> None:
        missing = [k for k in STATE_KEYS if not isinstance(states.get(k), Stateful)]
        if missing:
            raise TypeError(f"states must map {list(STATE_KEYS)} to Stateful objects; "
                            f"missing or not Stateful: {missing}")
        model, optimizer, train_state = (states["model"], states["dense_optimizer"],
                                         states["train_state"])
        if not (isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
                and isinstance(train_state, TrainState)):
            raise TypeError("states must be TrainCtx.state_dict()'s: a torch Module, a torch "
                            "Optimizer and a TrainState; got "
                            f"{[type(states[k]).__name__ for k in STATE_KEYS]}")
        self._model, self._optimizer = model, optimizer
        self.train_state = train_state
        self._flush = flush
        self._ps_addrs = tuple(ps_addrs)
        self._book = book
        self._common = common
        self._config = config
        self._device = device
        self.sharded_dense = sharded_dense
        self._dense_token: str | None = None
        self.periodic_dir = config.dir
        self.every_steps = config.every_steps
        self._client: PSCheckpointClient | None = None
        self.last_cut: tuple[Path, Path | None] | None = None
        """(root, folder) of the checkpoint last written (the folder on rank 0 only) or
        loaded; nothing trained since, unless :meth:`changed`."""
        self._cut_steps = 0
        super().__init__()

    @property
    def steps(self) -> int:
        """Batches this rank has trained, including those before the loaded checkpoint."""
        return self.train_state.state_dict()["steps"]

    @property
    def job_step(self) -> int:
        """The job's step, the same on every rank (see ``TrainState.job_step``)."""
        return self.train_state.state_dict()["job_step"]

    def changed(self) -> bool:
        """Whether this rank trained a batch (or took one for evaluation) since the last
        checkpoint it wrote or loaded."""
        state = self.train_state.state_dict()
        return state["steps"] != self._cut_steps or bool(state["new_batch_ids"])

    def _ps(self) -> PSCheckpointClient:
        if self._client is None:
            self._client = PSCheckpointClient(self._ps_addrs, self._common, self._config.root,
                                              book=self._book)
            self._client.wait_ready()
        return self._client

    def resume_if_asked(self, path: str | os.PathLike | None = None) -> Path | None:
        """Load ``path`` if given (the checkpoint a training restarted by torchrun went
        back to), else ``$PERSIA_RESUME_DIR`` if set, else the newest complete checkpoint
        in the periodic folder (``checkpoint_config.dir``) if there is one: a job
        restarted after a failure goes on from its last checkpoint by itself. Returns
        the checkpoint folder loaded (None: none)."""
        chosen = path or os.environ.get(fmt.ENV_RESUME_DIR)
        if not chosen and self.periodic_dir:
            chosen = fmt.latest(self.periodic_dir)
        if not chosen:
            return None
        logger.info("resuming from checkpoint %s", chosen)
        self.load(chosen)
        assert self.last_cut is not None, "load() sets it"
        return self.last_cut[1]

    def is_periodic(self, steps: int) -> bool:
        return bool(self.every_steps) and steps % self.every_steps == 0

    def after_step(self) -> None:
        """Write the periodic checkpoint if this step is one, and every rank still trains
        (ranks train in step until one runs out of batches; see :class:`_PeriodicJoinHook`)."""
        if not self.is_periodic(self.job_step):
            return
        training = self.vote(training=True)
        _, world = _world()
        if training == world:
            assert self.periodic_dir is not None, "CheckpointConfig requires dir with every_steps"
            self.dump(self.periodic_dir)
        else:
            logger.warning("step %d: periodic checkpoint skipped: %d of %d NN-worker ranks "
                           "have run out of batches", self.job_step, world - training, world)

    def vote(self, *, training: bool) -> int:
        """How many ranks are still training (every rank votes at a periodic step)."""
        return self._count_ranks(training)

    def _count_ranks(self, flag: bool) -> int:
        """How many ranks say ``flag`` (every rank calls it)."""
        _, world = _world()
        if world == 1:
            return int(flag)
        device = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        count = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(count)
        return int(count.item())

    def final(self, why: str) -> Path | None:
        """The checkpoint a training ends with (``why``: for the log), in the periodic
        folder, which the job started again goes on from exactly; every rank calls it,
        after the last step. Written, unless no rank trained anything since the last
        checkpoint written into or loaded from that folder: that one is the final one
        then (a second folder of the same cut would make the two kept ones one, pruning
        the distinct one before). Returns the folder on rank 0 (every rank's if loaded)."""
        root = self.periodic_dir
        if root is None:
            raise ValueError("final(): there is no periodic folder (checkpoint_config.dir) "
                             "to write the final checkpoint into")
        last_cut = self.last_cut
        if (last_cut is not None and last_cut[0] == Path(os.path.realpath(root))
                and self._count_ranks(self.changed()) == 0):  # a collective, in that case only
            folder = last_cut[1]
        else:
            folder = self.dump(root)
        if folder is not None and _world()[0] == 0:
            logger.info("training ended (%s) at step %d; final checkpoint %s", why,
                        self.job_step, folder)
        return folder

    def join_hook(self, **kwargs) -> JoinHook:
        return _PeriodicJoinHook(self)

    def dump(self, root: str | os.PathLike, *, extra_files: Mapping[str, bytes] | None = None
             ) -> Path | None:
        """Write a checkpoint into ``root``; returns its folder on rank 0 (None elsewhere).

        ``extra_files`` (name -> contents, e.g. a TorchScript of the model) are written
        into the checkpoint folder by rank 0 before it is committed."""
        started = time.perf_counter()
        self._flush()
        _barrier()  # every rank's updates are acknowledged: the cut is consistent
        train_state = self.train_state
        state = train_state.state_dict()
        counts = _gather([state["steps"], state["samples"]], self._device)
        rank_steps, rank_samples = [c[0] for c in counts], [c[1] for c in counts]
        # Batch ids are < 2^63 (loader index < 2^23), so they travel as int64.
        new_ids = [i for ids in _gather(state["new_batch_ids"], self._device) for i in ids]
        positions = train_state.positions.advanced(new_ids)
        rank, world = _world()
        final = None
        self._dense_token = self._write_sharded_dense(Path(root)) if self.sharded_dense else None
        if rank == 0:
            final = self._write(Path(root), {"rank_steps": rank_steps, "world_size": world,
                                             "rank_samples": rank_samples,
                                             "job_step": state["job_step"]},
                                positions, dict(extra_files or {}))
            logger.info("checkpoint %s written in %.2fs", final, time.perf_counter() - started)
        _barrier()
        # Every rank holds the same cut: the next checkpoint counts from here.
        train_state.load_state_dict({**state, "data_positions": positions.to_json()})
        self._cut(root, final, state["steps"])
        return final

    def _cut(self, root: str | os.PathLike, folder: Path | None, steps: int) -> None:
        self.last_cut = (Path(os.path.realpath(root)), folder)
        self._cut_steps = steps

    def _write(self, root: Path, counts: dict, positions: DataPositions,
               extra_files: dict[str, bytes]) -> Path:
        tmp = fmt.new_tmp_dir(root, self._dense_token)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ps_answers = pool.submit(self._ps().dump, tmp)
            if not self.sharded_dense:  # else every rank wrote its shards already
                fmt.save_tensors(tmp, "dense-model", self._model.state_dict())
                fmt.save_optimizer(tmp, "dense-optimizer", self._optimizer)
            safe_files.save_array(tmp / "torch-rng-state.npy", torch.get_rng_state().numpy())
            for name, contents in extra_files.items():
                _write_file(tmp, name, contents)
            answers = ps_answers.result()
        manifest = {
            "num_ps_replicas": len(answers),
            "ps_rows": [a.num_rows for a in answers],
            "ps_bytes": [a.num_bytes for a in answers],
            **counts,  # world_size, rank_steps, rank_samples, job_step
            "data_positions": positions.to_json(),
            "created_unix": time.time(),
        }
        # Named by the batches of all ranks (``step``); the job's step is ``job_step``.
        return fmt.commit(tmp, manifest, step=sum(counts["rank_steps"]))

    def load(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint (a root or one checkpoint folder) into the servers and the model."""
        started = time.perf_counter()
        folder = fmt.resolve(path)
        manifest = safe_files.load_json(folder / fmt.MANIFEST)
        rank, world = _world()
        rank_steps = manifest["rank_steps"]
        steps = _share(rank_steps, rank, world)
        # Older checkpoints: the job's step as rank 0 counts it, the same on every rank.
        job_step = manifest.get("job_step", _share(rank_steps, 0, world))
        samples = _share(manifest.get("rank_samples", [0] * len(rank_steps)), rank, world)
        if rank == 0:
            self._ps().load(folder)
        self._load_dense(folder)
        self.train_state.load_state_dict({
            "steps": steps, "job_step": job_step, "samples": samples,
            "data_positions": fmt.data_positions(manifest)})
        self._cut(folder.parent, folder, steps)
        rng = safe_files.load_array(folder / "torch-rng-state.npy")
        torch.set_rng_state(torch.from_numpy(np.array(rng)))
        _barrier()  # no rank trains before the servers hold the checkpoint's rows
        logger.info("checkpoint %s (step %d) loaded in %.2fs", folder, manifest["step"],
                    time.perf_counter() - started)
        return manifest

    def _write_sharded_dense(self, root: Path) -> str:
        """Every rank writes its dense shards into the checkpoint being written (rank 0
        names its temporary folder); returns that folder's token for rank 0's commit."""
        token = uuid.uuid4().hex if _world()[0] == 0 else "0" * 32
        if _world()[1] > 1:
            device = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
            raw = torch.tensor(list(token.encode()), dtype=torch.uint8, device=device)
            dist.broadcast(raw, src=0)
            token = bytes(raw.cpu().tolist()).decode()
        tmp = fmt.new_tmp_dir(root, token)
        from persia_py.checkpoint import dense as dense_checkpoint  # FSDP jobs only: heavy

        dense_checkpoint.save_sharded(tmp, self._model, self._optimizer)
        return token

    def _load_dense(self, folder: Path) -> None:
        """The dense model and optimizer, from either format into either kind of model."""
        model, optimizer = self._model, self._optimizer
        if fmt.is_sharded(folder) or self.sharded_dense:
            from persia_py.checkpoint import dense as dense_checkpoint  # heavy: see is_sharded

            if fmt.is_sharded(folder):
                dense_checkpoint.load_sharded(folder, model, optimizer)
            else:
                dense_checkpoint.load_full_into_sharded(folder, model, optimizer)
        else:
            model.load_state_dict(fmt.load_tensors(folder, "dense-model"))
            fmt.load_optimizer(folder, "dense-optimizer", optimizer)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

