"""The flags of ``persia-launcher k8s`` and their checks: what the user gives, before any
object is rendered (:mod:`persia_py.launcher.k8s` renders them)."""

from __future__ import annotations

import argparse
import re

from persia_py.launcher import job_token
from persia_py.launcher.role_kinds import ROLE_KINDS

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
    p.add_argument("--job-name", required=True, help="name of the job; prefixes every object")
    p.add_argument("--namespace", default="default", help="Kubernetes namespace")
    p.add_argument("--image", required=True, help="container image (built from the Dockerfile)")
    p.add_argument("--image-pull-policy", default="IfNotPresent",
                   choices=["Always", "IfNotPresent", "Never"], help="imagePullPolicy")
    p.add_argument("--embedding-config", required=True,
                   help="embedding_config.yml (validated, then put into the ConfigMap)")
    p.add_argument("--global-config", default=None,
                   help="global_config.yml (validated, then put into the ConfigMap)")
    p.add_argument("--nn-worker", required=True, help="training script, as a path in the image")
    p.add_argument("--nn-worker-args", default="", help="arguments of the training script")
    p.add_argument("--data-loader", required=True,
                   help="data-loader script, as a path in the image")
    p.add_argument("--data-loader-args", default="", help="arguments of the data-loader script")
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server replicas")
    p.add_argument("--num-embedding-workers", type=int, default=1, help="embedding workers")
    p.add_argument("--num-data-loaders", type=int, default=1, help="data loaders")
    p.add_argument("--num-nn-worker-nodes", type=int, default=1,
                   help="NN-worker pods (torchrun nodes)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="NN-worker ranks per pod")
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
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def check_k8s_args(args: argparse.Namespace) -> None:
    """Refuses (SystemExit, naming the flag) names Kubernetes would reject and counts below one."""
    if not _JOB_NAME.match(args.job_name) or len(args.job_name) > MAX_JOB_NAME:
        raise SystemExit(f"--job-name {args.job_name!r}: a lowercase letter, then lowercase "
                         f"letters, digits and '-', at most {MAX_JOB_NAME} characters (it "
                         "prefixes object and pod names)")
    for flag in ("auth_secret_name", "tls_secret_name"):
        name = getattr(args, flag)
        if name is not None and (not _NAME.match(name) or len(name) > 253):
            raise SystemExit(f"--{flag.replace('_', '-')} {name!r}: not a Secret name "
                             "(lowercase letters, digits and '-')")
    if args.insecure and args.auth_secret_name:
        raise SystemExit("--insecure and --auth-secret-name: choose one (a token, or none)")
    for name in ("num_ps", "num_embedding_workers", "num_data_loaders", "num_nn_worker_nodes",
                 "nproc_per_node"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")


