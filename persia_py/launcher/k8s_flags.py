"""The flags of ``persia-launcher k8s``, and what they make: a :class:`K8sJob` (the job
model and Kubernetes' own options), checked before any object is rendered
(:mod:`persia_py.launcher.k8s` renders it)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from persia_py.launcher import job_token
from persia_py.launcher.job_model import Folder, Job, Resources
from persia_py.launcher.k8s_volumes import SharedVolume, parse_shared_volume
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    ROLE_KINDS,
    RoleKind,
)

TLS_DIR = "/etc/persia-tls"
"""Where ``--tls-secret-name``'s Secret is mounted in every pod."""
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_JOB_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names must start with a letter
MAX_STATEFUL_SET_NAME = 52
"""A StatefulSet labels its pods ``controller-revision-hash: <name>-<hash of up to 10
characters>``, and a label value has at most 63 characters."""
MAX_JOB_NAME = MAX_STATEFUL_SET_NAME - len("-") - max(len(kind.short) for kind in ROLE_KINDS)
"""The longest ``--job-name`` whose StatefulSets' names (``<job>-<role>``) fit."""


def add_k8s_flags(p: argparse.ArgumentParser) -> None:
    """Kubernetes' own flags of ``k8s``, beside the job's
    (:func:`persia_py.launcher.job_flags.add_job_flags`)."""
    p.add_argument("--job-name", required=True, help="name of the job; prefixes every object")
    p.add_argument("--namespace", default="default", help="Kubernetes namespace")
    p.add_argument("--image", required=True, help="container image (built from the Dockerfile)")
    p.add_argument("--image-pull-policy", default="IfNotPresent",
                   choices=["Always", "IfNotPresent", "Never"], help="imagePullPolicy")
    p.add_argument("--ps-port", type=int, default=23000, help="gRPC port of the parameter servers")
    p.add_argument("--embedding-worker-port", type=int, default=23001,
                   help="gRPC port of the embedding workers")
    p.add_argument("--data-loader-port", type=int, default=23002,
                   help="gRPC port of the data loaders")
    p.add_argument("--rdzv-port", type=int, default=29500, help="torchrun c10d rendezvous port")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus metrics port of every container (NN-worker rank r: +r)")
    for role, short in (("ps", "parameter server"), ("embedding-worker", "embedding worker"),
                        ("nn-worker", "NN worker"), ("data-loader", "data loader")):
        p.add_argument(f"--{role}-cpu", default="1", help=f"CPU request of a {short} pod")
        p.add_argument(f"--{role}-memory", default="2Gi", help=f"memory request of a {short} pod")
    p.add_argument("--nn-worker-gpus", type=int, default=0,
                   help="nvidia.com/gpu per NN-worker pod (0: CPU only)")
    p.add_argument("--auth-secret-name", default=None, metavar="NAME",
                   help="existing Secret whose key 'token' is the job token (default: a new "
                        "Secret <job>-token with a random token is part of the output)")
    job_token.add_insecure_flag(p, "every role", "the token from the Secret, mounted as a "
                                "file that common_config.auth_token_file names")
    p.add_argument("--tls-secret-name", default=None, metavar="NAME",
                   help=f"TLS Secret (keys tls.crt, tls.key, ca.crt) mounted at {TLS_DIR}; "
                        "the config's tls_*_file point at it (mutual TLS). Its certificate "
                        "must name every address dialed, e.g. *.<job>-ps.<namespace>.svc")
    p.add_argument("--metrics-scraper-namespace", default="kubernetes.io/metadata.name=monitoring",
                   metavar="K=V[,K=V]",
                   help="labels of the namespaces the NetworkPolicy lets reach the metrics "
                        "ports ('': every namespace; default: %(default)s)")
    p.add_argument("--metrics-scraper-pods", default="app.kubernetes.io/name=prometheus",
                   metavar="K=V[,K=V]",
                   help="labels of the pods in those namespaces that may scrape the metrics "
                        "('': every pod; default: %(default)s)")
    p.add_argument("--shared-volume", action="append", default=[], type=parse_shared_volume,
                   metavar="CLAIM:PATH",
                   help="mount the ReadWriteMany PersistentVolumeClaim CLAIM at PATH, "
                        "read-write, in every pod (repeatable). Checkpoints, exports and "
                        "--data-folder folders must lie on one (refused otherwise: each pod "
                        "would write into its own filesystem); the roles' own logs and the "
                        "training log go to PATH/<job> on the first, so a deleted pod's "
                        "successor replays them")
    p.add_argument("--data-folder", action="append", default=[], metavar="DIR",
                   help="a folder the job's scripts keep that must outlive a pod, e.g. a "
                        "stream and its position logs (repeatable; must lie on a "
                        "--shared-volume)")
    p.add_argument("--serve", default=None, metavar="MODULE:FACTORY",
                   help="also render a serving Deployment (persia-launcher serve) of the "
                        "job's checkpoints, following its increments and dense exports; "
                        "MODULE:FACTORY builds the dense model, as a path in the image")
    p.add_argument("--serve-replicas", type=int, default=1, help="serving pods (default 1)")
    p.add_argument("--serve-port", type=int, default=23010,
                   help="port of the Serving service (default 23010)")
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


@dataclass(frozen=True)
class K8sJob:
    """A :class:`~persia_py.launcher.job_model.Job` as ``persia-launcher k8s`` renders it:
    the job, and what only Kubernetes needs (object names, image, ports, resources,
    Secrets, who may scrape metrics). Checked as it is made (names Kubernetes would
    refuse; SystemExit naming the flag)."""

    job: Job
    job_name: str
    namespace: str = "default"
    image: str = "persia:latest"
    image_pull_policy: str = "IfNotPresent"
    ports: dict[RoleKind, int] = field(default_factory=lambda: {
        PARAMETER_SERVER: 23000, EMBEDDING_WORKER: 23001, DATA_LOADER: 23002})
    rdzv_port: int = 29500
    metrics_port: int = 9090
    resources: dict[RoleKind, Resources] = field(default_factory=dict)
    auth_secret_name: str | None = None
    tls_secret_name: str | None = None
    metrics_scraper_namespace: str = "kubernetes.io/metadata.name=monitoring"
    metrics_scraper_pods: str = "app.kubernetes.io/name=prometheus"
    shared_volumes: tuple[SharedVolume, ...] = ()
    """ReadWriteMany claims mounted in every pod (persia_py/launcher/k8s_volumes.py)."""
    data_folders: tuple[str, ...] = ()
    """Folders the job's scripts keep that must outlive a pod (a stream, its position
    logs): each must lie on a shared volume."""
    serve_model: str | None = None
    """``MODULE:FACTORY`` of the dense model: render a serving Deployment too."""
    serve_replicas: int = 1
    serve_port: int = 23010

    def __post_init__(self) -> None:
        if not _JOB_NAME.match(self.job_name) or len(self.job_name) > MAX_JOB_NAME:
            raise SystemExit(f"--job-name {self.job_name!r}: a lowercase letter, then "
                             f"lowercase letters, digits and '-', at most {MAX_JOB_NAME} "
                             "characters (it prefixes object and pod names)")
        for flag, name in (("--auth-secret-name", self.auth_secret_name),
                           ("--tls-secret-name", self.tls_secret_name)):
            if name is not None and (not _NAME.match(name) or len(name) > 253):
                raise SystemExit(f"{flag} {name!r}: not a Secret name (lowercase letters, "
                                 "digits and '-')")
        if self.job.insecure and self.auth_secret_name:
            raise SystemExit("--insecure and --auth-secret-name: choose one (a token, or none)")
        if self.serve_replicas < 1:
            raise SystemExit(f"--serve-replicas must be >= 1; got {self.serve_replicas}")
        for folder in self.data_folders:
            if not folder.startswith("/"):
                raise SystemExit(f"--data-folder {folder!r}: an absolute path, as the pods see it")

    @property
    def home(self) -> str | None:
        """The job's folder on its first shared volume (its roles' own logs, the training
        log); None: no shared volume."""
        return (f"{self.shared_volumes[0].path}/{self.job_name}" if self.shared_volumes
                else None)

    def folders(self) -> list[Folder]:
        """What the job writes that must outlive a pod or that other pods read: the
        configs' folders, and the scripts' own (``--data-folder``)."""
        return [*self.job.folders(),
                *(Folder(path, "--data-folder", (DATA_LOADER,), shared=False)
                  for path in self.data_folders)]

    def resources_of(self, kind: RoleKind) -> Resources:
        """``kind``'s pod resources (the defaults where none were given)."""
        return self.resources.get(kind, Resources())
