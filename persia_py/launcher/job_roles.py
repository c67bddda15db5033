"""The roles of a ``persia-launcher local`` job: :class:`Role`, one process of the cluster,
and :func:`job_roles`, the job's list of them, each with how it restarts alone."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from persia_py.launcher import role_commands
from persia_py.launcher.job_model import Job, Layout, NNPlacement, Placement
from persia_py.launcher.recovery import latest_checkpoint
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    NN_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)
from persia_py.launcher.run_folder import handover_log_file, update_log_folder


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
    lost: Callable[[], bool] | None = None
    """Whether the machine it ran on is lost (a Slurm node DOWN): then its end is a death
    whatever its exit code (``srun`` ends 0 when its node fails); None: never."""

    @property
    def started(self) -> subprocess.Popen:
        """``process``, for the loops that watch roles: they run once every role is
        spawned (:meth:`persia_py.launcher.local.LocalCluster.start`)."""
        assert self.process is not None, f"{self.name} was never started"
        return self.process


LAUNCHER = (sys.executable, "-m", "persia_py.launcher.cli")
"""``persia-launcher`` as ``local`` starts it: this interpreter, whatever is on PATH."""


def local_placement(kind: RoleKind, index: int, port: int, *, bind: str, run_dir: str,
                    metrics: bool) -> Placement:
    """Where ``local`` runs replica ``index`` of ``kind``: on this machine, its own log in
    the run folder, metrics on a free port when asked."""
    own_log = {PARAMETER_SERVER: update_log_folder(run_dir, index),
               DATA_LOADER: handover_log_file(run_dir, index)}.get(kind)
    # A data loader binds where $PERSIA_BIND_HOST (the job's environment) says.
    return Placement(LAUNCHER, str(index), port, None if kind is DATA_LOADER else bind,
                     own_log=own_log, metrics_port=0 if metrics else None)


def local_nn_placement(job: Job, layout: Layout, *, metrics: bool) -> NNPlacement:
    """How the supervisor runs the NN workers: torchrun restarts the ranks only when asked
    to (``--nn-restarts torchrun``), else the supervisor restarts the training; across
    nodes, an elastic rendezvous at the layout's ``rendezvous``."""
    return NNPlacement(LAUNCHER, metrics_port=0 if metrics else None,
                       max_restarts=job.max_restarts if job.nn_restarts == "torchrun" else None,
                       rdzv_endpoint=layout.rendezvous, rdzv_id=layout.rendezvous_id)


def job_roles(job: Job, *, run_dir: str, root: str | None, layout: Layout,
              metrics: bool) -> list[Role]:
    """The job's roles, parameter servers first, then embedding workers, data loaders and
    the NN worker, placed by ``layout``, each with how it restarts alone
    (``Role.restart``)."""
    roles = []
    for kind in (PARAMETER_SERVER, EMBEDDING_WORKER, DATA_LOADER):
        for i, port in enumerate(layout.ports[kind]):
            at = local_placement(kind, i, port, bind=layout.bind, run_dir=run_dir,
                                 metrics=metrics)
            first = role_commands.server_role(kind, job, at)
            role = Role(f"{kind.short}-{i}", layout.launch(kind, i, first), kind=kind)
            # Restarted alone, replaying its own log: a parameter server's update log
            # brings back what it applied since the checkpoint it starts from (the newest
            # serves when the log is empty); a data loader's handover log says where it
            # left off (workers/handover_log.py); an embedding worker has none (the data
            # loaders put the batches it lost there again: workers/data_loader.py).
            again = role_commands.server_role(kind, job, dataclasses.replace(at, replay=True))
            role.restart = _restart(again, root if kind is PARAMETER_SERVER else None,
                                    functools.partial(_relaunch, layout, role, i, first))
            if layout.lost is not None:
                role.lost = functools.partial(layout.lost, kind, i)
            roles.append(role)
    nn = role_commands.nn_worker(job, local_nn_placement(job, layout, metrics=metrics))
    roles.append(Role(NN_WORKER.short, layout.launch(None, 0, nn), kind=NN_WORKER))
    return roles


def _relaunch(layout: Layout, role: Role, index: int, first: list[str],
              command: list[str]) -> list[str]:
    """Replica ``index`` of ``role``'s kind started again with ``command`` where
    ``layout`` places it now: on a spare machine if its own was lost
    (``Layout.relocate``); ``role.command`` (``first``, its command from scratch, for a
    training restarted from the start) goes there too."""
    if layout.relocate is not None:
        layout.relocate(role.kind, index)
        role.command = layout.launch(role.kind, index, first)
    return layout.launch(role.kind, index, command)


def _restart(command: list[str], root: str | None,
             launch: Callable[[list[str]], list[str]]) -> Callable[[], list[str]]:
    """A role's restart command, started by ``launch``; with ``root``, a parameter
    server's, which loads the newest checkpoint there (at the time of the restart) when its
    update log is empty."""
    def restart() -> list[str]:
        latest = None if root is None else latest_checkpoint(root)
        return launch(list(command) if latest is None
                      else [*command, "--load-checkpoint", latest])
    return restart
