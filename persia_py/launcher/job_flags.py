"""From the command line to the job model: the flags of the job every engine runs
(:func:`add_job_flags`, and the supervisor's that ``local`` and ``slurm`` share:
:func:`add_supervisor_flags`), and the one place where ``local``'s, ``k8s``'s and
``slurm``'s parsed flags (an ``argparse.Namespace``) become a typed
:class:`~persia_py.launcher.job_model.Job` and the engine's own options (a role's, and
``serve``'s and ``plan``'s: :mod:`persia_py.launcher.role_options`). Past these two
modules no launcher function takes a Namespace."""

from __future__ import annotations

import argparse
import shlex

from persia_py.launcher import job_token
from persia_py.launcher.job_model import Job, Resources, Script
from persia_py.launcher.job_run import LocalOptions
from persia_py.launcher.k8s_flags import K8sJob
from persia_py.launcher.role_kinds import DATA_LOADER, EMBEDDING_WORKER, NN_WORKER, PARAMETER_SERVER
from persia_py.launcher.slurm import SlurmJob

__all__ = ["add_job_flags", "add_supervisor_flags", "job_from_flags", "k8s_from_flags",
           "local_from_flags", "slurm_from_flags"]


def add_job_flags(p: argparse.ArgumentParser, *, nn_node: str | None = None,
                  in_image: bool = False) -> None:
    """The flags of the job itself, alike for every engine (:func:`job_from_flags` reads
    them): its scripts and their arguments, its configs, each role's replicas.
    ``nn_node``: what one NN-worker node is to the engine (``--num-nn-worker-nodes``;
    None: one node, this machine); ``in_image``: the scripts are paths in the container
    image, the configs are put into a ConfigMap (``k8s``)."""
    where = ", as a path in the image" if in_image else ""
    p.add_argument("--nn-worker", required=True, help=f"training script{where}")
    p.add_argument("--nn-worker-args", default="", help="arguments of the training script")
    p.add_argument("--data-loader", required=True, help=f"data-loader script{where}")
    p.add_argument("--data-loader-args", default="", help="arguments of the data-loader script")
    checked = " (validated, then put into the ConfigMap)" if in_image else ""
    p.add_argument("--embedding-config", required=True, help=f"embedding_config.yml{checked}")
    p.add_argument("--global-config", default=None,
                   help=f"global_config.yml{checked} (default: all defaults)")
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server replicas")
    p.add_argument("--num-embedding-workers", type=int, default=1, help="embedding workers")
    p.add_argument("--num-data-loaders", type=int, default=1, help="data loaders")
    if nn_node is None:
        p.add_argument("--nproc-per-node", type=int, default=1, help="NN-worker ranks")
        return
    p.add_argument("--num-nn-worker-nodes", type=int, default=1,
                   help=f"NN-worker {nn_node}s (torchrun nodes)")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help=f"NN-worker ranks per {nn_node}")


def add_supervisor_flags(p: argparse.ArgumentParser, token: str) -> None:
    """The flags of persia_py's own supervisor (``local``, ``slurm``): each role's
    restarts, metrics, the job token (``token``: where it comes from without
    ``--insecure``)."""
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of each role after it died (a parameter server, embedding "
                        "worker or data loader alone; the training, from the last checkpoint, "
                        "for an NN worker) or exited when asked to by a Restart or Rewind "
                        "call, before the job stops; 0: the first death stops it")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not serve Prometheus metrics (default: every role serves them on "
                        "a free port, printed at start-up)")
    job_token.add_insecure_flag(p, "every role", token)
    job_token.add_insecure_token_flag(p)


def job_from_flags(args: argparse.Namespace, *, nn_nodes: int = 1,
                   max_restarts: int = 3, nn_restarts: str = "launcher",
                   flag_names: dict[str, str] | None = None) -> Job:
    """The job the flags every engine shares describe (scripts, configs, counts)."""
    return Job(
        embedding_config=args.embedding_config, global_config=args.global_config,
        nn_worker=Script(args.nn_worker, tuple(shlex.split(args.nn_worker_args))),
        data_loader=Script(args.data_loader, tuple(shlex.split(args.data_loader_args))),
        num_ps=args.num_ps, num_embedding_workers=args.num_embedding_workers,
        num_data_loaders=args.num_data_loaders, nn_nodes=nn_nodes,
        nproc_per_node=args.nproc_per_node, insecure=args.insecure,
        max_restarts=max_restarts, nn_restarts=nn_restarts, flag_names=flag_names or {})


def local_from_flags(args: argparse.Namespace) -> tuple[Job, LocalOptions]:
    """``persia-launcher local``'s job and options."""
    job = job_from_flags(args, max_restarts=args.max_restarts, nn_restarts=args.nn_restarts)
    return job, LocalOptions(bind=args.bind, run_dir=args.run_dir, metrics=not args.no_metrics,
                             env=tuple(args.env), resume=args.resume)


def k8s_from_flags(args: argparse.Namespace) -> K8sJob:
    """``persia-launcher k8s``'s flags as a :class:`K8sJob`."""
    job = job_from_flags(args, nn_nodes=args.num_nn_worker_nodes, nn_restarts="torchrun",
                         flag_names={"nn_nodes": "--num-nn-worker-nodes"})
    resources = {kind: Resources(getattr(args, f"{flag}_cpu"), getattr(args, f"{flag}_memory"),
                                 args.nn_worker_gpus if kind is NN_WORKER else 0)
                 for kind, flag in ((PARAMETER_SERVER, "ps"),
                                    (EMBEDDING_WORKER, "embedding_worker"),
                                    (DATA_LOADER, "data_loader"), (NN_WORKER, "nn_worker"))}
    return K8sJob(
        job=job, job_name=args.job_name, namespace=args.namespace, image=args.image,
        image_pull_policy=args.image_pull_policy,
        ports={PARAMETER_SERVER: args.ps_port, EMBEDDING_WORKER: args.embedding_worker_port,
               DATA_LOADER: args.data_loader_port},
        rdzv_port=args.rdzv_port, metrics_port=args.metrics_port, resources=resources,
        auth_secret_name=args.auth_secret_name, tls_secret_name=args.tls_secret_name,
        metrics_scraper_namespace=args.metrics_scraper_namespace,
        metrics_scraper_pods=args.metrics_scraper_pods,
        shared_volumes=tuple(args.shared_volume), data_folders=tuple(args.data_folder),
        serve_model=args.serve, serve_replicas=args.serve_replicas, serve_port=args.serve_port)


_RENDER_ONLY = ("submit", "output")
"""``slurm``'s flags that are not the job's: ``slurm-run`` does not take them."""


def slurm_from_flags(args: argparse.Namespace) -> tuple[SlurmJob, LocalOptions]:
    """``persia-launcher slurm``'s (or ``slurm-run``'s) job, and how its supervisor runs
    it; the job's flags again, for the batch script's ``slurm-run``."""
    job = job_from_flags(args, nn_nodes=args.num_nn_worker_nodes,
                         max_restarts=args.max_restarts,
                         flag_names={"nn_nodes": "--num-nn-worker-nodes"})
    flags: list[str] = []
    for key, value in vars(args).items():
        # Left out when unset; not a 0 (``0 == False``: --max-restarts 0 would be lost).
        if key in ("command", *_RENDER_ONLY) or value is None or value is False or value == "":
            continue
        flag = "--" + ("time" if key == "time_limit" else key.replace("_", "-"))
        # FLAG=VALUE: a value that starts with '-' (a script's arguments) stays a value.
        flags.append(flag if value is True else f"{flag}={value}")
    spec = SlurmJob(job=job, job_name=args.job_name, run_dir=args.run_dir,
                    ps_partition=args.ps_partition, ps_nodes=args.ps_nodes,
                    worker_partition=args.worker_partition, time_limit=args.time_limit,
                    port_base=args.port_base, gpus_per_node=args.gpus_per_node,
                    spare_nodes=args.spare_nodes, flags=tuple(flags))
    return spec, LocalOptions(run_dir=args.run_dir, metrics=not args.no_metrics)
