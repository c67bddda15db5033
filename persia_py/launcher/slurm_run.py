"""``persia-launcher slurm-run``: a job inside its Slurm allocation, started by the batch
script ``persia-launcher slurm`` renders (:mod:`persia_py.launcher.slurm`).

It runs on the allocation's first node under persia_py's own supervisor
(:func:`persia_py.launcher.job_run.run_job`) with the allocation's :class:`Layout`: the
parameter servers on the nodes of component 0, round robin; the NN workers one node each
of component 1 (one job step over all of them: torchrun per node, c10d rendezvous on the
first), the embedding workers and data loaders beside them. Each server role and data
loader is a job step of its own (``srun --overlap`` pinned to its node), so the
supervisor restarts a role that died alone, on the same node and port, as ``local`` does,
and an NN step that died by rolling the training back to its last checkpoint.

A step's environment is the supervisor's (``srun`` passes it on through Slurm, not on a
command line): the roles' addresses, the config paths and the job token (also in the run
folder, mode 0600); the launcher's lifeline is a pipe of this node and is dropped there.

A requeue or ``scancel`` stops the job in order, as SIGTERM stops ``local``: Slurm's
SIGTERM reaches every process of the job at once, so only the NN workers act on it (a
step, a final checkpoint); the servers' and data loaders' steps ignore it
(``$PERSIA_STOP_SIGNALS``: persia_py/launcher/stop_signals.py) and are stopped by the
supervisor once the NN step has ended, with SIGUSR2 to their ``srun`` (which turns a
SIGTERM of its own into SIGKILL, but passes SIGUSR2 on). All within Slurm's ``KillWait``
(docs/deployment.md#running-on-slurm).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from collections.abc import Mapping

from persia_py.launcher.job_model import Layout
from persia_py.launcher.job_run import LocalOptions, run_job
from persia_py.launcher.lifeline import ENV_LIFELINE_FD
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)
from persia_py.launcher.run_folder import address_book_file
from persia_py.launcher.slurm import PORT_OFFSETS, SlurmJob
from persia_py.launcher.slurm_spares import SpareNodes
from persia_py.launcher.stop_signals import ENV_STOP_SIGNALS
from persia_py.wire.address_book import AddressBook

__all__ = ["run_in_allocation", "slurm_layout"]

_GROUP = {PARAMETER_SERVER: 0, EMBEDDING_WORKER: 1, DATA_LOADER: 1}
"""The heterogeneous job's component each kind runs on."""
SERVER_STOP = "SIGUSR2,SIGINT"
"""What stops a server's or data loader's step (``$PERSIA_STOP_SIGNALS``): not Slurm's
SIGTERM, which comes while the NN workers still need them for their final checkpoint."""
NN_STOP = "SIGTERM,SIGUSR2,SIGINT"
"""What stops the NN workers' step: Slurm's SIGTERM too."""


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm node list (``node[2-3]``), as ``scontrol`` expands it."""
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout.split()


def _nodes(environ: Mapping[str, str], group: int) -> list[str]:
    name = f"SLURM_JOB_NODELIST_HET_GROUP_{group}"
    if name not in environ:
        raise SystemExit(f"slurm-run: ${name} is unset: run it from the batch script "
                         "persia-launcher slurm renders (a heterogeneous job of two "
                         "components), not by hand")
    return hostnames(environ[name])


def slurm_layout(spec: SlurmJob, environ: Mapping[str, str] = os.environ) -> Layout:
    """Where each replica runs in this allocation, and the ``srun`` that starts it there."""
    groups = [_nodes(environ, 0), _nodes(environ, 1)]
    if len(groups[1]) != spec.job.nn_nodes:
        raise SystemExit(f"slurm-run: component 1 has {len(groups[1])} nodes, the job "
                         f"{spec.job.nn_nodes} NN-worker nodes")
    if len(groups[0]) <= spec.spare_nodes:
        raise SystemExit(f"slurm-run: component 0 has {len(groups[0])} nodes, not more than "
                         f"--spare-nodes {spec.spare_nodes}")
    # The spares first: the supervisor (this node) runs on the first of them, and a
    # parameter server's lost node never takes it along (persia_py/launcher/slurm_spares.py).
    placed = [groups[0][spec.spare_nodes:], groups[1]]
    hosts: dict[RoleKind, list[str]] = {}
    ports: dict[RoleKind, list[int]] = {}
    for kind, group in _GROUP.items():
        nodes = placed[group]
        hosts[kind] = [nodes[i % len(nodes)] for i in range(spec.job.replicas(kind))]
        ports[kind] = [spec.port_base + PORT_OFFSETS[kind.short] + i
                       for i in range(spec.job.replicas(kind))]
    step = ["srun", "--overlap", "--kill-on-bad-exit=1", f"--job-name={spec.job_name}"]
    # The lifeline is a pipe of this node; on another node its number means nothing.
    # Slurm's SIGTERM (a requeue, scancel) reaches every process of the job at once: the
    # NN workers act on it, the servers wait for the supervisor's SIGUSR2 (the NN workers
    # stopped, their final checkpoint written), which srun passes on as it is.
    drop_lifeline = ["env", "-u", ENV_LIFELINE_FD]

    def launch(kind: RoleKind | None, index: int, command: list[str]) -> list[str]:
        if kind is None:  # the NN workers: a task on every node of component 1
            return [*step, "--het-group=1", f"--nodes={len(groups[1])}",
                    "--ntasks-per-node=1", *drop_lifeline, f"{ENV_STOP_SIGNALS}={NN_STOP}",
                    *command]
        return [*step, f"--het-group={_GROUP[kind]}", "--nodes=1", "--ntasks=1",
                f"--nodelist={hosts[kind][index]}", *drop_lifeline,
                f"{ENV_STOP_SIGNALS}={SERVER_STOP}", *command]

    rendezvous = (f"{groups[1][0]}:{spec.port_base + PORT_OFFSETS['rendezvous']}"
                  if len(groups[1]) > 1 else None)
    layout = Layout(hosts=hosts, ports=ports, bind="0.0.0.0", launch=launch,
                    rendezvous=rendezvous, rendezvous_id=spec.job_name,
                    stop_signal=signal.SIGUSR2)
    if not spec.spare_nodes:
        return layout
    spares = SpareNodes(layout, groups[0][:spec.spare_nodes],
                        AddressBook(address_book_file(spec.run_dir)),
                        environ.get("SLURM_JOB_ID"), _log)
    return dataclasses.replace(layout, lost=spares.lost, relocate=spares.relocate)


def _log(message: str) -> None:
    print(f"[launcher] {message}", flush=True)


def run_in_allocation(spec: SlurmJob, options: LocalOptions) -> int:
    """Run the job in this allocation until it ends; its exit code."""
    print(f"[launcher] Slurm job {os.environ.get('SLURM_JOB_ID', '?')} (restart "
          f"{os.environ.get('SLURM_RESTART_COUNT', '0')}): {spec.job_name}", flush=True)
    return run_job(spec.job, options, slurm_layout(spec))
