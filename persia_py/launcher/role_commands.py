"""Each role's command line, built in one function per role kind for every engine
(``local``, ``k8s``, ``slurm``, and ``serve``'s servers): the
:class:`~persia_py.launcher.job_model.Job` says what the role runs, the engine's
:class:`~persia_py.launcher.job_model.Placement` where and how."""

from __future__ import annotations

from persia_py.launcher.job_model import Job, NNPlacement, Placement
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)
from persia_py.launcher.roles import HOLD_ON_CONFIG_ERROR

__all__ = ["data_loader", "embedding_worker", "nn_worker", "parameter_server", "server_role"]


def _server_flags(kind: RoleKind, job: Job, at: Placement) -> list[str]:
    """What every server role and data loader takes: port, bind, replica, metrics."""
    flags = [kind.command, *(["--insecure"] if job.insecure else []), *at.flags,
             *([HOLD_ON_CONFIG_ERROR] if at.hold_on_final_error else []),
             "--port", str(at.port), *(["--bind", at.bind] if at.bind is not None else []),
             "--replica-index", at.index, "--replica-size", str(job.replicas(kind))]
    if at.metrics_port is not None:
        flags += ["--metrics-port", str(at.metrics_port)]
    return flags


def parameter_server(job: Job, at: Placement) -> list[str]:
    """A parameter server: its update log (``at.own_log``, a folder), replayed by a
    restart; a serving replica's checkpoint and the increments it follows."""
    return [*at.launcher, *_server_flags(PARAMETER_SERVER, job, at),
            *(["--update-log", at.own_log] if at.own_log else []),
            *(["--replay-update-log"] if at.replay else []),
            *(["--inference"] if at.inference else []),
            *(["--load-checkpoint", at.load_checkpoint] if at.load_checkpoint else []),
            *(["--follow-increments", at.follow_increments] if at.follow_increments else [])]


def embedding_worker(job: Job, at: Placement) -> list[str]:
    """An embedding worker (it keeps no state: a restart starts empty)."""
    return [*at.launcher, *_server_flags(EMBEDDING_WORKER, job, at)]


def data_loader(job: Job, at: Placement) -> list[str]:
    """A data loader: its handover log (``at.own_log``, a file), replayed by a restart;
    the script and its arguments last."""
    return [*at.launcher, *_server_flags(DATA_LOADER, job, at),
            *(["--handover-log", at.own_log] if at.own_log else []),
            *(["--replay-handovers"] if at.replay else []),
            job.data_loader.path, *job.data_loader.args]


_SERVERS = {PARAMETER_SERVER: parameter_server, EMBEDDING_WORKER: embedding_worker,
            DATA_LOADER: data_loader}


def server_role(kind: RoleKind, job: Job, at: Placement) -> list[str]:
    """The command of one replica of a server role or data loader."""
    return _SERVERS[kind](job, at)


def nn_worker(job: Job, at: NNPlacement) -> list[str]:
    """The NN workers of one node: torchrun (or its stand-in) running the training
    script, with an elastic rendezvous across nodes where ``at`` names one."""
    command = [*at.launcher, "nn-worker", *(["--insecure"] if job.insecure else []), *at.flags,
               "--nproc-per-node", str(job.nproc_per_node)]
    if at.rdzv_endpoint is not None:
        command += ["--nnodes", str(job.nn_nodes), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", at.rdzv_endpoint, "--rdzv-id", at.rdzv_id or "persia"]
    if at.metrics_port is not None:
        command += ["--metrics-port", str(at.metrics_port)]
    if at.max_restarts is not None:
        command += ["--max-restarts", str(at.max_restarts)]
    if at.train_log is not None:
        command += ["--train-log", at.train_log]
    return [*command, job.nn_worker.path, *job.nn_worker.args]
