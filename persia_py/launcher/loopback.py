"""NN ranks on one machine keep every port they open on loopback.

torch's rendezvous store and gloo authenticate nobody: a host that reaches their ports
can join or disturb the process group. Ranks on one machine need no other host to reach
them, so ``persia-launcher nn-worker`` with one node (and ``local``, which runs it):

* runs torchrun with the rendezvous backend :data:`BACKEND`, whose store listens on
  127.0.0.1 only (:mod:`persia_py.launcher.loopback_torchrun`);
* names the loopback interface in ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
  (:func:`loopback_env`): gloo's listeners and NCCL's bootstrap sockets otherwise bind
  the address the machine's name resolves to, often its network address.
"""

from __future__ import annotations

import sys
from pathlib import Path

BACKEND = "persia-loopback"
"""The rendezvous backend of :mod:`persia_py.launcher.loopback_torchrun`."""
LOOPBACK = "127.0.0.1"
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_IFF_LOOPBACK = 0x8  # <linux/if.h>


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(flags.read_text(), 16) & _IFF_LOOPBACK:
                return flags.parent.name
        except (OSError, ValueError):
            continue
    return "lo"


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with gloo's and NCCL's sockets on the loopback interface, unless it names
    an interface for them already (the user's choice stands)."""
    iface = loopback_interface()
    return {**dict.fromkeys(IFNAME_VARIABLES, iface), **env}


def torchrun_command(port: int) -> list[str]:
    """The start of a torchrun command line for one node on loopback (``port`` 0: the
    store takes any free port)."""
    return [sys.executable, "-m", "persia_py.launcher.loopback_torchrun",
            f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={LOOPBACK}:{port}"]
