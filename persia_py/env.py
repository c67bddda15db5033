"""The process environment of a persia_py role, read once at the process entry.

The NN-worker variables are torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Service addresses come from ``PERSIA_*`` variables that
``persia-launcher`` (or a Kubernetes manifest) sets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from persia_py.ids.positions import ENV_DATA_POSITIONS, DataPositions

__all__ = ["PersiaEnv", "get_local_rank", "get_rank", "get_world_size"]

ENV_GLOBAL_CONFIG = "PERSIA_GLOBAL_CONFIG"
ENV_EMBEDDING_CONFIG = "PERSIA_EMBEDDING_CONFIG"
ENV_PS_ADDRS = "PERSIA_PS_ADDRS"
ENV_EMBEDDING_WORKER_ADDRS = "PERSIA_EMBEDDING_WORKER_ADDRS"
ENV_DATA_LOADER_ADDRS = "PERSIA_DATA_LOADER_ADDRS"
ENV_DATA_LOADER_REPLICA_INDEX = "PERSIA_DATA_LOADER_REPLICA_INDEX"
ENV_DATA_LOADER_PORT = "PERSIA_DATA_LOADER_PORT"
ENV_DATA_LOADER_REPLICA_SIZE = "PERSIA_DATA_LOADER_REPLICA_SIZE"
ENV_DATA_LOADER_HANDOVER_LOG = "PERSIA_DATA_LOADER_HANDOVER_LOG"
"""Where a data loader logs what it hands over (``persia-launcher data-loader
--handover-log``; see workers/handover_log.py)."""
ENV_DATA_LOADER_REPLAY = "PERSIA_DATA_LOADER_REPLAY_HANDOVERS"
"""``1``: the loader was restarted alone; it goes on where its handover log ends."""
ENV_NN_WORLD_SIZE = "PERSIA_NN_WORKER_WORLD_SIZE"
ENV_BIND_HOST = "PERSIA_BIND_HOST"
ENV_ADDRESS_BOOK = "PERSIA_ADDRESS_BOOK"
"""The job's address book, where a server that moved is found (persia_py/wire/address_book.py)."""


def job_env(*, ps_addrs: list[str], embedding_worker_addrs: list[str],
            data_loader_addrs: list[str], nn_world_size: int, bind_host: str,
            embedding_config: str, global_config: str | None,
            address_book: str | None = None) -> dict[str, str]:
    """The variables every role of a job is started with: where the other roles are, how
    many NN-worker ranks there are, what to bind and where the config files are. The one
    list that ``persia-launcher local`` and the Kubernetes manifests both set."""
    env = {
        ENV_EMBEDDING_CONFIG: embedding_config,
        ENV_PS_ADDRS: ",".join(ps_addrs),
        ENV_EMBEDDING_WORKER_ADDRS: ",".join(embedding_worker_addrs),
        ENV_DATA_LOADER_ADDRS: ",".join(data_loader_addrs),
        ENV_NN_WORLD_SIZE: str(nn_world_size),
        ENV_BIND_HOST: bind_host,
    }
    if global_config is not None:
        env[ENV_GLOBAL_CONFIG] = global_config
    if address_book is not None:
        env[ENV_ADDRESS_BOOK] = address_book
    return env


def _addrs(value: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in (value or "").split(",") if a.strip())


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True)
class PersiaEnv:
    """Everything a role reads from its environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    global_config: str | None = None
    embedding_config: str | None = None
    ps_addrs: tuple[str, ...] = ()
    embedding_worker_addrs: tuple[str, ...] = ()
    data_loader_addrs: tuple[str, ...] = ()
    data_loader_replica_index: int = 0
    data_loader_port: int = 0
    data_loader_replica_size: int = 1
    data_loader_handover_log: str | None = None
    data_loader_replay: bool = False
    nn_world_size: int = 1
    bind_host: str = "127.0.0.1"
    address_book: str | None = None
    """The job's address book (``$PERSIA_ADDRESS_BOOK``; None: the servers never move)."""
    data_positions: DataPositions = field(default_factory=DataPositions)
    """Each data loader's batches trained before the checkpoint the job resumes from
    (``$PERSIA_DATA_POSITIONS``, set by the launcher); a loader skips exactly those."""

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> PersiaEnv:
        env = os.environ if env is None else env
        return cls(
            rank=_int(env, "RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_rank=_int(env, "LOCAL_RANK", 0),
            global_config=env.get(ENV_GLOBAL_CONFIG) or None,
            embedding_config=env.get(ENV_EMBEDDING_CONFIG) or None,
            ps_addrs=_addrs(env.get(ENV_PS_ADDRS)),
            embedding_worker_addrs=_addrs(env.get(ENV_EMBEDDING_WORKER_ADDRS)),
            data_loader_addrs=_addrs(env.get(ENV_DATA_LOADER_ADDRS)),
            data_loader_replica_index=_int(env, ENV_DATA_LOADER_REPLICA_INDEX, 0),
            data_loader_port=_int(env, ENV_DATA_LOADER_PORT, 0),
            data_loader_replica_size=_int(env, ENV_DATA_LOADER_REPLICA_SIZE, 1),
            data_loader_handover_log=env.get(ENV_DATA_LOADER_HANDOVER_LOG) or None,
            data_loader_replay=env.get(ENV_DATA_LOADER_REPLAY) == "1",
            nn_world_size=_int(env, ENV_NN_WORLD_SIZE, 1),
            bind_host=env.get(ENV_BIND_HOST) or "127.0.0.1",
            address_book=env.get(ENV_ADDRESS_BOOK) or None,
            data_positions=DataPositions.from_text(env.get(ENV_DATA_POSITIONS),
                                                   f"${ENV_DATA_POSITIONS}"),
        )

    def require(self, field: str, variable: str) -> None:
        """Raise a clear error when a needed setting is absent."""
        if not getattr(self, field):
            raise RuntimeError(f"{variable} is not set; start this role with persia-launcher "
                               f"or set it to the service addresses")


def get_rank() -> int:
    """This NN worker's rank (torchrun's RANK; 0 outside a distributed job)."""
    return PersiaEnv.from_environ().rank


def get_world_size() -> int:
    """Number of NN-worker ranks (torchrun's WORLD_SIZE; 1 outside a distributed job)."""
    return PersiaEnv.from_environ().world_size


def get_local_rank() -> int:
    """This NN worker's rank on its machine (torchrun's LOCAL_RANK)."""
    return PersiaEnv.from_environ().local_rank
