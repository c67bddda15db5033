"""torchrun with one more rendezvous backend, :data:`~persia_py.launcher.loopback.BACKEND`:
``python -m persia_py.launcher.loopback_torchrun --rdzv-backend=persia-loopback
--rdzv-endpoint=127.0.0.1:PORT [torchrun's other arguments]`` (PORT 0: any free one), for
ranks on one node.

torch's rendezvous store (``TCPStore``) has no authentication, and its server listens on
every interface whatever host it is given (torch 2.13: the libuv server binds the
wildcard address, ``*:PORT``). So this backend binds the listening socket itself, to
127.0.0.1, and hands it to the store (``TCPStore(master_listen_fd=...)``), which then
listens nowhere else. Otherwise it is torch's static rendezvous: the store lives in
torchrun's agent, the ranks dial it as clients (``TORCHELASTIC_USE_AGENT_STORE``), and it
outlives restarts of the ranks. The port is bound here, where it is used, so no other
process can take it between its choice and its use.
"""

from __future__ import annotations

import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from persia_py.launcher.loopback import BACKEND, LOOPBACK

_DEFAULT_TIMEOUT_SEC = 600  # torch's static rendezvous


class LoopbackRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous for one node, its store listening on 127.0.0.1 only."""

    def __init__(self, port: int, run_id: str, timeout_sec: int) -> None:
        super().__init__(LOOPBACK, port, 0, 1, run_id, timeout_sec)

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            listener = socket.create_server((LOOPBACK, self.master_port), backlog=128)
            self.master_port = listener.getsockname()[1]
            # The store owns the descriptor from here on (libuv closes it).
            self._store = TCPStore(LOOPBACK, self.master_port, 1, True, self.timeout,
                                   multi_tenant=True, master_listen_fd=listener.detach(),
                                   use_libuv=True)
        return super().next_rendezvous()


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's factory for :data:`BACKEND` (the registry calls it with the parameters)."""
    if params.max_nodes != 1:
        raise ValueError(f"--rdzv-backend={BACKEND} runs ranks on one node only; got "
                         f"--nnodes={params.min_nodes}:{params.max_nodes}")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if host not in (LOOPBACK, "localhost"):
        raise ValueError(f"--rdzv-backend={BACKEND} listens on {LOOPBACK}; got "
                         f"--rdzv-endpoint={params.endpoint}")
    timeout = int(params.config.get("timeout", _DEFAULT_TIMEOUT_SEC))
    return LoopbackRendezvous(port, params.run_id, timeout)


def main(argv: list[str] | None = None) -> None:
    rendezvous_handler_registry.register(BACKEND, create_handler)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
