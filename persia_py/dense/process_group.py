"""The NN workers' torch.distributed process group: its deadlines, and errors that name
the ranks when a collective fails.

A collective (the dense allreduce, a checkpoint barrier) waits for every rank. A rank
behind a dead link, or one that died without its sockets being closed, would otherwise
hold the others for torch's default 30 minutes; here a collective gives up after two
RPC deadlines (``common_config.rpc_timeout_sec``): one for a peer that is itself waiting
out an RPC (e.g. rank 0's checkpoint Dump) before it joins, one for the wait itself. The
error then names every rank's address, so the operator knows which hosts to look at.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from persia_py.config import CommonConfig
from persia_py.dense.collectives import all_gather_json

_MAX_ADDRESS_BYTES = 1024
"""Bound of one rank's address (JSON text) in the exchange that names the ranks."""


def init_process_group(backend: str, common: CommonConfig) -> list[str]:
    """Join the default process group (``env://``, as torchrun sets it up), set the
    collectives' deadline, and return each rank's address (index = rank)."""
    # Joining waits for the slowest rank to start: that is a start-up wait.
    timeout = timedelta(seconds=common.startup_timeout_sec)
    store = _store_of_this_attempt(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    addresses = all_gather_json(_local_address(), max_bytes=_MAX_ADDRESS_BYTES,
                                what="the ranks' addresses")
    if backend == "gloo":  # NCCL's watchdog aborts the process instead; keep its default
        dist.distributed_c10d._set_pg_timeout(
            timedelta(seconds=2 * common.rpc_timeout_sec))
    return [str(a) for a in addresses]


def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store, seen under a prefix of its own, when torchrun restarted the
    ranks (None on a first start: ``env://`` as usual). torchrun's static rendezvous keeps
    one store across restarts, and torch 2.13 adds no per-attempt prefix to it, so the
    restarted ranks could read the dead ranks' gloo addresses and fail to connect
    ("Connection refused"), depending on who writes first."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"persia/attempt_{attempt}", store)


def _local_address() -> str:
    """This host's address on the route to the rendezvous host (MASTER_ADDR)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP: picks a route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


SETTLE_SEC = 0.05
"""How long :func:`settle_finished_collectives` leaves the GIL to gloo's worker threads."""


def settle_finished_collectives(settle_sec: float = SETTLE_SEC, *, barrier: bool = True
                                ) -> None:
    """Wait for every rank's collectives (``barrier``), then leave the GIL to the gloo
    group's worker threads for ``settle_sec``, so that they drop the collectives they
    finished while the interpreter still runs. Nothing to do without a gloo group of
    several ranks.

    Why: the worker thread that ran a collective drops its work object only after the
    waiter was woken, and that object may hold the last reference to a Python object: a
    tensor whose Python side is gone (an ``async_op`` allreduce nobody waits for, e.g.
    ``Join``'s per-step notice, or a result already read), or the autograd context that
    ``torch.autograd.backward`` stashes (FSDP's collectives during the backward). Freeing
    it needs the GIL. Once the interpreter finalizes, CPython 3.11 ends a thread that
    takes the GIL (``pthread_exit``), here inside a ``noexcept`` C++ destructor:
    ``std::terminate`` ("terminate called without an active exception", SIGABRT) or a
    SIGSEGV, after the script itself finished. It happens when the script's tail after
    its last collective is short, and the group's threads live as long as the FSDP or
    DDP model that holds the group, usually to the end. The barrier waits for every
    collective before it (gloo's barrier waits on them), and for a worker already
    freeing one under the queue's lock (the call releases the GIL); the pause covers a
    worker that has not got there yet. With ``barrier``, call it on every rank, before
    ``destroy_process_group``. Without, it only pauses: for ranks that leave at different
    times (a DDP rank 0 evaluating alone while the others are done), which a barrier
    would keep waiting, and fail past the group's timeout."""
    if not (dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() == "gloo"):
        return
    if barrier:
        dist.barrier()
    time.sleep(settle_sec)


class PeerFailure(RuntimeError):
    """A collective failed: a peer rank is unreachable, stalled or gone."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a process-group transport failure (timeout, peer gone)."""
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    # gloo raises plain RuntimeErrors: from a collective's wait (raised in c10d's
    # Python API), or from the autograd hooks of DDP's reducer (naming gloo's sources,
    # except for its own timeout of a pair, which names nothing).
    innermost = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    text = str(exc)
    return "gloo" in text or any(m in text for m in _GLOO_TRANSPORT_MESSAGES) or any(
        frame.filename.endswith("distributed_c10d.py") for frame in innermost)


_GLOO_TRANSPORT_MESSAGES = ("Application timeout caused pair closure",
                            "Connection closed by peer", "Connection reset by peer")
"""What gloo's transport says when a peer is gone or silent, with or without its path."""


@contextmanager
def naming_peers(what: str, addresses: list[str], rank: int,
                 common: CommonConfig) -> Iterator[None]:
    """Collectives inside fail with what failed, the deadline, and the address of every
    other rank (one of them is unreachable or stalled); other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        peers = ", ".join(f"rank {r} at {a}" for r, a in enumerate(addresses) if r != rank)
        raise PeerFailure(
            f"{what} failed on rank {rank}: a peer NN-worker rank is unreachable or "
            f"stalled ({peers}); collectives wait up to 2 x common_config.rpc_timeout_sec "
            f"({2 * common.rpc_timeout_sec:.0f} s). Cause: {exc}") from exc
