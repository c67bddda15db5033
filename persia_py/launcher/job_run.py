"""Running a :class:`~persia_py.launcher.job_model.Job` under persia_py's own supervisor
(:class:`~persia_py.launcher.local.LocalCluster`): on this machine (``persia-launcher
local``) or on the nodes of a Slurm allocation (``persia-launcher slurm``, whose batch
script runs this supervisor on its first node and each role as a job step).

A :class:`Layout` is all that differs between the two: where each replica runs and on
which port, what the servers bind, and how a role's command is started there (as it is,
or through ``srun`` on its node). Checks, the run folder, the job token, resuming from
the newest checkpoint, each role's restarts and the training's, and the summary at the
end are the same.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass

from persia_py.config import load_global_config
from persia_py.env import job_env
from persia_py.launcher import job_token
from persia_py.launcher.job_model import Job, Layout
from persia_py.launcher.job_roles import job_roles
from persia_py.launcher.local import GracefulStop, LocalCluster
from persia_py.launcher.ports import free_ports
from persia_py.launcher.recovery import (
    BatchCounts,
    TrainingRecovery,
    checkpoint_root,
    latest_checkpoint,
    resume_env,
)
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
)
from persia_py.launcher.roles import validate_configs
from persia_py.launcher.run_folder import (
    address_book_file,
    make_run_folder,
    remove_update_logs,
)
from persia_py.ops.start_checks import (
    check_checkpoint_paths,
    check_writable,
    written_by_servers,
    written_by_training,
)
from persia_py.telemetry.events import ENV_TRAIN_LOG
from persia_py.telemetry.monitoring import LauncherMetrics, serve_metrics
from persia_py.wire.address_book import AddressBook
from persia_py.wire.security import ENV_AUTH_TOKEN

__all__ = ["Layout", "LocalOptions", "local_layout", "run_job", "run_local"]

SERVER_KINDS = (PARAMETER_SERVER, EMBEDDING_WORKER, DATA_LOADER)


def local_layout(job: Job, bind: str) -> Layout:
    """Every role on this machine, on free ports (the NN ranks' rendezvous store takes
    its port itself: persia_py/launcher/loopback.py)."""
    counts = [job.replicas(kind) for kind in SERVER_KINDS]
    ports = iter(free_ports(sum(counts), bind))
    return Layout(hosts={k: [bind] * n for k, n in zip(SERVER_KINDS, counts)},
                  ports={k: [next(ports) for _ in range(n)] for k, n in zip(SERVER_KINDS, counts)},
                  bind=bind)


@dataclass(frozen=True)
class LocalOptions:
    """How the supervisor runs a job (``persia-launcher local``'s flags: docs/cli.md)."""

    bind: str = "127.0.0.1"
    """The address every server binds (``local``)."""
    run_dir: str | None = None
    """The run folder (None: ``runs/local-<date>-<time>-<pid>``)."""
    metrics: bool = True
    """Every role serves Prometheus metrics on a free port."""
    env: tuple[str, ...] = ()
    """``KEY=VALUE`` items added to every process's environment."""
    resume: str | None = None
    """A checkpoint (root or folder) to continue from."""


def run_local(job: Job, options: LocalOptions) -> int:
    """Run ``job`` on this machine until it ends; its exit code."""
    return run_job(job, options, local_layout(job, options.bind))


def _extra_env(env: dict[str, str], items: tuple[str, ...]) -> None:
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env expects KEY=VALUE, got {item!r}")
        if key == ENV_AUTH_TOKEN:
            raise SystemExit(f"--env {ENV_AUTH_TOKEN}=...: a token on the command line can be "
                             "read by every local user; export it instead, or let local make "
                             "one")
        env[key] = value


def run_job(job: Job, options: LocalOptions, layout: Layout) -> int:
    """Run ``job``'s roles where ``layout`` places them, supervised, until it ends; its
    exit code."""
    validate_configs(job.global_config, job.embedding_config)
    # Every role starts in this folder: its checkpoint root, unless the config sets one;
    # and as this user, who must be able to write what they write (the run folder is
    # tried as it is made).
    checkpoints = load_global_config(job.global_config).checkpoint_config
    check_checkpoint_paths(checkpoints)
    check_writable([*written_by_servers(checkpoints), *written_by_training(checkpoints)])
    run_dir, train_log = make_run_folder(options.run_dir)
    # Where each server replica is now: the layout's, until one moves (a spare node).
    book = AddressBook(address_book_file(run_dir))
    book.publish(layout.book())
    env = dict(os.environ)
    env.update(job_env(
        ps_addrs=layout.addresses(PARAMETER_SERVER),
        embedding_worker_addrs=layout.addresses(EMBEDDING_WORKER),
        data_loader_addrs=layout.addresses(DATA_LOADER),
        nn_world_size=job.world_size, bind_host=layout.bind,
        embedding_config=os.path.abspath(job.embedding_config),
        global_config=os.path.abspath(job.global_config) if job.global_config else None,
        address_book=book.path))
    env.update({"PYTHONUNBUFFERED": "1", ENV_TRAIN_LOG: train_log})
    root = checkpoint_root(env, options.resume)
    if options.resume:
        env.update(resume_env(options.resume))
    elif (latest := latest_checkpoint(root)) is not None:
        # The NN workers resume from it by themselves (TrainCtx); the loaders must agree.
        env.update(resume_env(latest))
    _extra_env(env, options.env)
    # A token the user configured wins over --insecure, as it always did.
    job = dataclasses.replace(
        job, insecure=bool(job_token.give_job_token(job.insecure, env, run_dir)))
    roles = job_roles(job, run_dir=run_dir, root=root, layout=layout, metrics=options.metrics)
    cluster = LocalCluster(roles, env, max_restarts=job.max_restarts,
                           stop_signal=layout.stop_signal)
    recovery = TrainingRecovery(cluster, servers=roles[:job.num_ps], training=roles[job.num_ps:],
                                root=root, train_log=train_log,
                                max_restarts=job.max_restarts, log=cluster.log)
    cluster.restart_training = recovery
    counts = BatchCounts(train_log)
    metrics_server = None
    if options.metrics:
        cluster.metrics = LauncherMetrics()
        metrics_server = serve_metrics(cluster.metrics.registry, 0, options.bind,
                                       "[launcher] launcher")

    signalled = []

    def on_signal(signum, _frame):
        signalled.append(signum)
        # The first SIGTERM stops the training cleanly, a second one everything at once.
        raise GracefulStop if len(signalled) == 1 else KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
    except GracefulStop:
        cluster.stop()
        return 143
    except BaseException:
        cluster.stop()
        raise
    try:
        return cluster.run()
    finally:
        for summary in (recovery.summary(), counts.summary()):
            if summary:
                cluster.log(summary)
        remove_update_logs(run_dir, job.num_ps, cluster.log)
        if metrics_server is not None:
            metrics_server.close()
