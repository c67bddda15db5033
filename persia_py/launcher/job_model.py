"""The job model: one persia_py job, described once, that every engine renders.

A :class:`Job` is built from the command line and the configs (``persia-launcher local``
and ``k8s`` build it from their flags: :mod:`persia_py.launcher.job_flags`); an engine
renders it by placing each replica of each role (:class:`Placement`: where it binds, its
port, its replica index as the engine spells it, its own log, whether it holds on a final
error) and asking :mod:`persia_py.launcher.role_commands` for the replica's command
line, built in one function per role kind for every engine. What each role writes and
reads (:meth:`Job.folders`) lives here too, so every engine checks the same folders.

The shape follows TorchX's ``AppDef``/``Role`` (roles with replicas, mounts, retry policy,
resources), without depending on it: our guarantees need per-role restarts that keep the
other roles running, plain StatefulSets that need no Volcano, and the job token as a file
(docs/architecture.md#the-job-model).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from persia_py.config import ConfigError, load_global_config
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    NN_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)

__all__ = ["Folder", "Job", "Layout", "NNPlacement", "NO_SCRIPT", "Placement", "RESTARTS",
           "Resources", "Script"]

RESTARTS = ("launcher", "torchrun")
"""Who restarts a dead NN rank: the launcher (the training roles from the last
checkpoint) or torchrun (the ranks rewind the loaders and embedding workers)."""


@dataclass(frozen=True)
class Script:
    """A user's script and its arguments, as a path the role's machine sees."""

    path: str
    args: tuple[str, ...] = ()


NO_SCRIPT = Script("")
"""The script of a job that runs none of that role (``serve``'s: parameter servers and
an embedding worker, no NN worker or data loader)."""


@dataclass(frozen=True)
class Folder:
    """A folder the job's roles write, named by where it came from."""

    path: str
    source: str
    """The config key or flag that names it (in messages)."""
    writers: tuple[RoleKind, ...]
    """The role kinds that write into it."""
    shared: bool = True
    """Read by processes other than the one that wrote it, maybe on another machine
    (other replicas, other roles, serving): it must be on storage they all reach."""
    outlives_process: bool = True
    """A restart of its writer (or a later run) reads it again."""


@dataclass(frozen=True)
class Resources:
    """What one replica of a role asks of its machine (Kubernetes requests, Slurm
    options)."""

    cpu: str = "1"
    memory: str = "2Gi"
    gpus: int = 0


@dataclass(frozen=True)
class Job:
    """One job: its scripts, configs and how many replicas of each role.

    Args:
        embedding_config, global_config: the config files (global: None for defaults).
        nn_worker, data_loader: the training and data-loader scripts.
        num_ps, num_embedding_workers, num_data_loaders: replicas of those roles.
        nn_nodes, nproc_per_node: NN-worker machines and ranks on each.
        insecure: run without a job token (every role gets ``--insecure``).
        max_restarts: restarts of each role (or of the training) before the job stops.
        nn_restarts: who restarts a dead NN rank (:data:`RESTARTS`).
    """

    embedding_config: str
    global_config: str | None
    nn_worker: Script
    data_loader: Script
    num_ps: int = 1
    num_embedding_workers: int = 1
    num_data_loaders: int = 1
    nn_nodes: int = 1
    nproc_per_node: int = 1
    insecure: bool = False
    max_restarts: int = 3
    nn_restarts: str = "launcher"
    flag_names: dict[str, str] = field(default_factory=dict, compare=False)
    """How the command line that built the job names each count (messages)."""

    def __post_init__(self) -> None:
        for name in ("num_ps", "num_embedding_workers", "num_data_loaders", "nn_nodes",
                     "nproc_per_node"):
            if getattr(self, name) < 1:
                flag = self.flag_names.get(name, "--" + name.replace("_", "-"))
                raise ConfigError(f"{flag} must be >= 1; got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0; got {self.max_restarts}")
        if self.nn_restarts not in RESTARTS:
            raise ConfigError(f"--nn-restarts must be one of {RESTARTS}; got "
                              f"{self.nn_restarts!r}")

    @property
    def world_size(self) -> int:
        """NN-worker ranks in all."""
        return self.nn_nodes * self.nproc_per_node

    def replicas(self, kind: RoleKind) -> int:
        """Replicas of ``kind`` (the NN worker: one per node)."""
        return {PARAMETER_SERVER: self.num_ps, EMBEDDING_WORKER: self.num_embedding_workers,
                DATA_LOADER: self.num_data_loaders, NN_WORKER: self.nn_nodes}[kind]

    def folders(self) -> list[Folder]:
        """The folders the configs name that roles write and others (or restarts) read:
        the checkpoints, the incremental and dense exports. (An engine adds its own: the
        run folder, the update and handover logs; the scripts' own folders, such as a
        stream and its position log, are the user's to declare.)"""
        config = load_global_config(self.global_config).checkpoint_config
        found = []
        if config.dir:
            # Rank 0 writes the dense state and manifest, every server its rows; a resume
            # reads them all, and a server loads every replica's rows (resharding).
            found.append(Folder(config.dir, "checkpoint_config.dir",
                                (NN_WORKER, PARAMETER_SERVER)))
        if config.incremental_dir:  # serving replicas follow it
            found.append(Folder(config.incremental_dir, "checkpoint_config.incremental_dir",
                                (PARAMETER_SERVER,)))
        if config.dense_export_dir:  # serving follows it
            found.append(Folder(config.dense_export_dir, "checkpoint_config.dense_export_dir",
                                (NN_WORKER,)))
        return found


@dataclass(frozen=True)
class Placement:
    """How an engine runs one replica of a server or data-loader role: what differs
    between engines, and nothing else (the rest comes from the :class:`Job`)."""

    launcher: tuple[str, ...]
    """The ``persia-launcher`` command on that machine."""
    index: str
    """The replica index, or the engine's expression for it (``$(POD_INDEX)``)."""
    port: int
    bind: str | None
    """Address to bind (None: the role's default)."""
    own_log: str | None = None
    """The replica's own log, which a restart replays: a parameter server's update log
    (a folder), a data loader's handover log (a file); None: none."""
    metrics_port: int | None = None
    hold_on_final_error: bool = False
    """Hold instead of exiting on a config or data error (a supervisor that restarts
    whatever the exit code: a StatefulSet)."""
    replay: bool = False
    """A restart: replay the role's own log (update log, handover log)."""
    flags: tuple[str, ...] = ()
    """Flags every role of this engine takes (e.g. ``--insecure``)."""
    inference: bool = False
    """A serving replica (``serve``'s parameter servers): read-only tables."""
    load_checkpoint: str | None = None
    """The checkpoint a parameter server loads before serving (None: none)."""
    follow_increments: str | None = None
    """The incremental exports a serving parameter server applies as they appear."""


@dataclass(frozen=True)
class NNPlacement:
    """How an engine runs the NN workers of one node (torchrun's agent)."""

    launcher: tuple[str, ...]
    metrics_port: int | None = None
    max_restarts: int | None = None
    """torchrun's restarts of the ranks (None: the flag is left out, torchrun's default)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous (None: one node on loopback)."""
    rdzv_id: str | None = None
    train_log: str | None = None
    """Where rank 0 writes the training log (None: the role's default)."""
    flags: tuple[str, ...] = ()


def _as_is(kind: RoleKind | None, index: int, command: list[str]) -> list[str]:
    return command


@dataclass(frozen=True)
class Layout:
    """Where a job's replicas run."""

    hosts: dict[RoleKind, list[str]]
    """The address each replica of a server role or data loader is reached at."""
    ports: dict[RoleKind, list[int]]
    bind: str
    """What the servers bind."""
    launch: Callable[[RoleKind | None, int, list[str]], list[str]] = field(default=_as_is)
    """A role's command as started where it runs (kind None: the NN workers)."""
    rendezvous: str | None = None
    """HOST:PORT of the NN workers' elastic rendezvous across nodes (None: one node)."""
    rendezvous_id: str | None = None
    stop_signal: int = signal.SIGTERM
    """What the supervisor sends a started command to stop its role: SIGTERM, or
    SIGUSR2 to ``srun``, which passes it on (persia_py/launcher/stop_signals.py)."""
    lost: Callable[[RoleKind, int], bool] | None = None
    """Whether the machine of a replica is lost (its step ended, whatever its code, is a
    death); None: machines are never lost (``local``)."""
    relocate: Callable[[RoleKind, int], None] | None = None
    """Called before a replica that died is started again: moves it to a spare machine
    (``hosts`` changes) when its own is lost (None: it restarts where it was)."""

    def addresses(self, kind: RoleKind) -> list[str]:
        return [f"{h}:{p}" for h, p in zip(self.hosts[kind], self.ports[kind])]

    def book(self) -> dict[str, list[str]]:
        """Every replica's address by kind, as the job's address book lists them
        (persia_py/wire/address_book.py)."""
        return {kind.short: self.addresses(kind) for kind in self.hosts}
