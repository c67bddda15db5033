"""The roles of a ``persia-launcher local`` job: :class:`Role`, one process of the cluster,
and :func:`job_roles`, the job's list of them, each with how it restarts alone."""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from persia_py.launcher.recovery import latest_checkpoint
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    NN_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)
from persia_py.launcher.run_folder import update_log_folder


@dataclass
class Role:
    """One process of a local job: its name in the output, command and kind."""

    name: str
    command: list[str]
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    kind: RoleKind = PARAMETER_SERVER
    restart: Callable[[], list[str]] | None = None
    """The command that starts this role again after it died (None: its death ends the job)."""
    num_restarts: int = 0

    @property
    def started(self) -> subprocess.Popen:
        """``process``, for the loops that watch roles: they run once every role is
        spawned (:meth:`persia_py.launcher.local.LocalCluster.start`)."""
        assert self.process is not None, f"{self.name} was never started"
        return self.process


def job_roles(args: argparse.Namespace, *, run_dir: str, root: str | None,
               role_flags: list[str], ports: tuple) -> list[Role]:
    """The job's roles, parameter servers first, then embedding workers, data loaders and
    the NN worker, each with how it restarts alone (``Role.restart``). ``role_flags``:
    what every role takes; ``ports``: those of each kind (the NN ranks' rendezvous store
    takes its port itself: persia_py/launcher/loopback.py)."""
    launcher = [sys.executable, "-m", "persia_py.launcher.cli"]
    host = args.bind
    ps_ports, ew_ports, dl_ports = ports
    num_ps, num_ew, num_dl = len(ps_ports), len(ew_ports), len(dl_ports)
    roles = [
        Role(f"{PARAMETER_SERVER.short}-{i}", [*launcher, PARAMETER_SERVER.command, "--port", str(p),
                         "--bind", host, "--replica-index", str(i), "--replica-size", str(num_ps),
                         "--update-log", update_log_folder(run_dir, i), *role_flags])
        for i, p in enumerate(ps_ports)
    ]
    roles += [
        Role(f"{EMBEDDING_WORKER.short}-{i}", [*launcher, EMBEDDING_WORKER.command, "--port", str(p),
                                       "--bind", host, "--replica-index", str(i),
                                       "--replica-size", str(num_ew), *role_flags],
             kind=EMBEDDING_WORKER)
        for i, p in enumerate(ew_ports)
    ]
    roles += [
        Role(f"{DATA_LOADER.short}-{i}", [*launcher, DATA_LOADER.command, "--port", str(p),
                                  "--replica-index", str(i), "--replica-size", str(num_dl),
                                  "--handover-log",
                                  os.path.join(run_dir, f"data-loader-{i}-handovers.log"),
                                  *role_flags, args.data_loader, *shlex.split(args.data_loader_args)],
             kind=DATA_LOADER)
        for i, p in enumerate(dl_ports)
    ]
    roles.append(Role(NN_WORKER.short, [*launcher, NN_WORKER.command,
                                    "--nproc-per-node", str(args.nproc_per_node),
                                    *(["--max-restarts", str(args.max_restarts)]
                                      if args.nn_restarts == "torchrun" else []),
                                    *role_flags, args.nn_worker, *shlex.split(args.nn_worker_args)],
                      kind=NN_WORKER))

    def ps_restart(command: list[str]) -> Callable[[], list[str]]:
        def restart() -> list[str]:
            # Its update log brings back what it applied since the checkpoint it starts
            # from; the newest checkpoint serves when the log is empty.
            latest = latest_checkpoint(root)
            command_now = [*command, "--replay-update-log"]
            return command_now if latest is None else [*command_now, "--load-checkpoint", latest]
        return restart

    for role in roles[:num_ps]:
        role.restart = ps_restart(role.command)
    for role in roles[num_ps:num_ps + num_ew]:
        # Restarted alone: the data loaders keep the ID features of every batch not yet
        # trained and put those it lost on its successor (see workers/data_loader.py).
        role.restart = functools.partial(list, role.command)
    for role in roles[num_ps + num_ew:num_ps + num_ew + num_dl]:
        # Restarted alone: its handover log says where it left off
        # (workers/handover_log.py); the flag goes before the script and its arguments.
        at = role.command.index(args.data_loader)
        role.restart = functools.partial(
            list, [*role.command[:at], "--replay-handovers", *role.command[at:]])
    return roles
