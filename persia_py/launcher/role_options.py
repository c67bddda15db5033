"""The options of the commands that run one role (``embedding-parameter-server``,
``embedding-worker``, ``nn-worker``, ``data-loader``), of ``serve`` and of ``plan``: one
frozen dataclass each, built from the parsed flags here and nowhere else (the engines'
flags become a job in :mod:`persia_py.launcher.job_flags`). Each field is the flag of the
same name (``--replica-index`` -> ``replica_index``); its help in
:mod:`persia_py.launcher.cli` says what it means."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["DataLoaderOptions", "EmbeddingWorkerOptions", "NNWorkerOptions",
           "ParameterServerOptions", "PlanOptions", "RoleOptions", "ServeOptions",
           "ServerOptions", "plan_options_from_flags", "role_options_from_flags"]


@dataclass(frozen=True, kw_only=True)
class RoleOptions:
    """What every command that starts a role (or ``serve``) takes."""

    command: str
    """The subcommand, as messages name it (``persia-launcher COMMAND: ...``)."""
    global_config: str | None
    """None: ``$PERSIA_GLOBAL_CONFIG``, else all defaults."""
    embedding_config: str | None
    """None: ``$PERSIA_EMBEDDING_CONFIG``."""
    insecure: bool
    metrics_port: int | None
    """None: no metrics endpoint; 0: any free port."""


@dataclass(frozen=True, kw_only=True)
class ServerOptions(RoleOptions):
    """A server role's or data loader's replica: where it serves, which one it is."""

    port: int
    bind: str | None
    """None: ``$PERSIA_BIND_HOST`` (a data loader), else 127.0.0.1."""
    replica_index: int
    replica_size: int


@dataclass(frozen=True, kw_only=True)
class ParameterServerOptions(ServerOptions):
    """``persia-launcher embedding-parameter-server``."""

    load_checkpoint: str | None
    checkpoint_root: str | None
    update_log: str | None
    update_log_max_bytes: int
    replay_update_log: bool
    inference: bool
    follow_increments: str | None


@dataclass(frozen=True, kw_only=True)
class EmbeddingWorkerOptions(ServerOptions):
    """``persia-launcher embedding-worker``."""

    ps_addrs: str | None
    """Comma-separated; None: ``$PERSIA_PS_ADDRS``."""


@dataclass(frozen=True, kw_only=True)
class DataLoaderOptions(ServerOptions):
    """``persia-launcher data-loader``."""

    script: str
    script_args: tuple[str, ...]
    handover_log: str | None
    replay_handovers: bool


@dataclass(frozen=True, kw_only=True)
class NNWorkerOptions(RoleOptions):
    """``persia-launcher nn-worker``: torchrun's flags and the training script."""

    script: str
    script_args: tuple[str, ...]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    rdzv_endpoint: str | None
    rdzv_backend: str
    rdzv_id: str
    local_addr: str | None
    max_restarts: int
    train_log: str


@dataclass(frozen=True, kw_only=True)
class ServeOptions(RoleOptions):
    """``persia-launcher serve``."""

    checkpoint: str
    wait: bool
    model: str
    port: int
    bind: str
    num_ps: int
    device_id: int | None
    follow_increments: str | None
    follow_dense: str | None


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """``persia-launcher plan``."""

    embedding_config: str
    global_config: str | None
    ids: tuple[tuple[str, int], ...]
    ids_all: int | None
    ids_file: str | None
    sample: str | None
    sample_format: str
    sample_delimiter: str
    sample_scale: float
    optimizer: str
    row_dtype: str | None
    machine_memory: int
    machine_cores: int
    usable_memory: float
    nn_workers: int
    nn_workers_per_node: int
    batch_size: int
    staleness: int
    update_log_max_bytes: int
    machine_disk: int | None
    disk_free_fraction: float
    samples_per_second: float | None
    ram_hit_rate: float | None
    json: bool


_ROLE_OPTIONS: dict[str, type[RoleOptions]] = {
    "embedding-parameter-server": ParameterServerOptions,
    "embedding-worker": EmbeddingWorkerOptions,
    "nn-worker": NNWorkerOptions,
    "data-loader": DataLoaderOptions,
    "serve": ServeOptions,
}
"""Each command that runs a role (or ``serve``) and its options."""

_Options = TypeVar("_Options", bound="DataclassInstance")


def _from_flags(cls: type[_Options], args: argparse.Namespace) -> _Options:
    """``cls`` with each field the flag of its name (repeated or remainder flags, parsed
    as lists, as tuples)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)}
    return cls(**{name: tuple(value) if isinstance(value, list) else value
                  for name, value in values.items()})


def role_options_from_flags(args: argparse.Namespace) -> RoleOptions:
    """The options of the role (or ``serve``) that ``args.command`` names."""
    return _from_flags(_ROLE_OPTIONS[args.command], args)


def plan_options_from_flags(args: argparse.Namespace) -> PlanOptions:
    """``persia-launcher plan``'s options."""
    return _from_flags(PlanOptions, args)
