"""``persia-launcher k8s``: Kubernetes manifests for one job, rendered from flags.

Objects (all labelled ``app.kubernetes.io/name: persia``, ``persia.job: <job>``,
``persia.role: <role>``):

* ConfigMap ``<job>-config``: ``global_config.yml`` and ``embedding_config.yml``, mounted
  at ``/etc/persia`` in every pod.
* Parameter servers, embedding workers and data loaders: each a StatefulSet behind a
  headless Service of the same name (``<job>-ps``, ``<job>-embedding-worker``,
  ``<job>-data-loader``). A pod's ordinal is its ``--replica-index``, and its DNS name
  (``<job>-ps-3.<job>-ps``) survives restarts, so routing ids by replica index holds.
* NN workers: an indexed Job ``<job>-nn-worker`` whose pods run torchrun with c10d
  rendezvous at pod 0 (``<job>-nn-worker-0.<job>-nn-worker``, headless Service).

Every container serves Prometheus metrics on ``--metrics-port`` (annotated for
scraping). The image is the one the repository's Dockerfile builds.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

import yaml

from persia_py import allocator
from persia_py.config import load_embedding_config, load_global_config
from persia_py.env import (
    ENV_BIND_HOST,
    ENV_DATA_LOADER_ADDRS,
    ENV_EMBEDDING_CONFIG,
    ENV_EMBEDDING_WORKER_ADDRS,
    ENV_GLOBAL_CONFIG,
    ENV_NN_WORLD_SIZE,
    ENV_PS_ADDRS,
)
from persia_py.monitoring import ENV_METRICS_PORT

CONFIG_DIR = "/etc/persia"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ROLES = {  # role -> short name in object names
    "embedding-parameter-server": "ps",
    "embedding-worker": "embedding-worker",
    "data-loader": "data-loader",
    "nn-worker": "nn-worker",
}


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
    p.add_argument("--auth-secret-name", default=None,
                   help="Secret (key 'token') given to every role as PERSIA_AUTH_TOKEN")
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def _check(args: argparse.Namespace) -> None:
    if not _NAME.match(args.job_name) or len(args.job_name) > 40:
        raise SystemExit(f"--job-name {args.job_name!r}: lowercase letters, digits and '-', "
                         "at most 40 characters (it prefixes object and pod names)")
    for name in ("num_ps", "num_embedding_workers", "num_data_loaders", "num_nn_worker_nodes",
                 "nproc_per_node"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")


def _labels(args: argparse.Namespace, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "persia", "persia.job": args.job_name, "persia.role": role}


def _meta(args: argparse.Namespace, name: str, role: str, **extra) -> dict:
    return {"name": name, "namespace": args.namespace, "labels": _labels(args, role), **extra}


def _addrs(args: argparse.Namespace, short: str, count: int, port: int) -> str:
    svc = f"{args.job_name}-{short}"
    return ",".join(f"{svc}-{i}.{svc}.{args.namespace}.svc:{port}" for i in range(count))


def _env(args: argparse.Namespace, role: str) -> list[dict]:
    # A StatefulSet pod's ordinal, or an indexed Job pod's completion index.
    index_field = ("metadata.annotations['batch.kubernetes.io/job-completion-index']"
                   if role == "nn-worker" else "metadata.labels['apps.kubernetes.io/pod-index']")
    env = [
        {"name": ENV_GLOBAL_CONFIG, "value": f"{CONFIG_DIR}/global_config.yml"},
        {"name": ENV_EMBEDDING_CONFIG, "value": f"{CONFIG_DIR}/embedding_config.yml"},
        {"name": ENV_PS_ADDRS, "value": _addrs(args, "ps", args.num_ps, args.ps_port)},
        {"name": ENV_EMBEDDING_WORKER_ADDRS,
         "value": _addrs(args, "embedding-worker", args.num_embedding_workers,
                         args.embedding_worker_port)},
        {"name": ENV_DATA_LOADER_ADDRS,
         "value": _addrs(args, "data-loader", args.num_data_loaders, args.data_loader_port)},
        {"name": ENV_NN_WORLD_SIZE, "value": str(args.num_nn_worker_nodes * args.nproc_per_node)},
        {"name": ENV_BIND_HOST, "value": "0.0.0.0"},
        {"name": ENV_METRICS_PORT, "value": str(args.metrics_port)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "GLIBC_TUNABLES", "value": allocator.TUNABLES},
        {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index_field}}},
    ]
    if args.auth_secret_name:
        env.append({"name": "PERSIA_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": args.auth_secret_name, "key": "token"}}})
    return env


def _container(args: argparse.Namespace, role: str, command: list[str],
               ports: dict[str, int]) -> dict:
    flag = "ps" if role == "embedding-parameter-server" else role
    resources: dict = {"requests": {"cpu": getattr(args, f"{flag.replace('-', '_')}_cpu"),
                                    "memory": getattr(args, f"{flag.replace('-', '_')}_memory")}}
    if role == "nn-worker" and args.nn_worker_gpus:
        resources["limits"] = {"nvidia.com/gpu": args.nn_worker_gpus}
    return {
        "name": role,
        "image": args.image,
        "imagePullPolicy": args.image_pull_policy,
        "command": command,
        "env": _env(args, role),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": resources,
        "volumeMounts": [{"name": "persia-config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }


def _pod_spec(args: argparse.Namespace, container: dict, **extra) -> dict:
    return {
        "containers": [container],
        "volumes": [{"name": "persia-config", "configMap": {"name": f"{args.job_name}-config"}}],
        **extra,
    }


def _annotations(args: argparse.Namespace) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.metrics_port),
            "prometheus.io/path": "/metrics"}


def _headless_service(args: argparse.Namespace, role: str, ports: dict[str, int]) -> dict:
    name = f"{args.job_name}-{_ROLES[role]}"
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(args, name, role),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _labels(args, role),
                 "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()]},
    }


def _stateful_set(args: argparse.Namespace, role: str, replicas: int, port: int,
                  command: list[str]) -> list[dict]:
    name = f"{args.job_name}-{_ROLES[role]}"
    ports = {"grpc": port, "metrics": args.metrics_port}
    container = _container(args, role, command, ports)
    stateful_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(args, name, role),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(args, role)},
            "template": {
                "metadata": {"labels": _labels(args, role), "annotations": _annotations(args)},
                "spec": _pod_spec(args, container),
            },
        },
    }
    return [_headless_service(args, role, ports), stateful_set]


def _launcher(*args: str) -> list[str]:
    return ["persia-launcher", *args]


def render(args: argparse.Namespace) -> list[dict]:
    """Every object of the job, in the order to apply them."""
    _check(args)
    load_global_config(args.global_config)
    load_embedding_config(args.embedding_config)
    files = {"embedding_config.yml": _read(args.embedding_config),
             "global_config.yml": _read(args.global_config) if args.global_config else "{}\n"}
    objects: list[dict] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(args, f"{args.job_name}-config", "config"), "data": files,
    }]
    index = "$(POD_INDEX)"  # expanded by Kubernetes from the env var above
    metrics = ["--metrics-port", str(args.metrics_port)]
    objects += _stateful_set(args, "embedding-parameter-server", args.num_ps, args.ps_port, _launcher(
        "embedding-parameter-server", "--port", str(args.ps_port), "--bind", "0.0.0.0",
        "--replica-index", index, "--replica-size", str(args.num_ps), *metrics))
    objects += _stateful_set(
        args, "embedding-worker", args.num_embedding_workers, args.embedding_worker_port,
        _launcher("embedding-worker", "--port", str(args.embedding_worker_port),
                  "--bind", "0.0.0.0", "--replica-index", index,
                  "--replica-size", str(args.num_embedding_workers), *metrics))
    objects += _stateful_set(
        args, "data-loader", args.num_data_loaders, args.data_loader_port,
        _launcher("data-loader", "--port", str(args.data_loader_port), "--replica-index", index,
                  "--replica-size", str(args.num_data_loaders), *metrics,
                  args.data_loader, *shlex.split(args.data_loader_args)))
    objects += _nn_worker_job(args)
    return objects


def _nn_worker_job(args: argparse.Namespace) -> list[dict]:
    name = f"{args.job_name}-nn-worker"
    ports = {"rendezvous": args.rdzv_port, "metrics": args.metrics_port}
    command = _launcher(
        "nn-worker", "--nproc-per-node", str(args.nproc_per_node),
        "--nnodes", str(args.num_nn_worker_nodes),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{name}-0.{name}:{args.rdzv_port}",
        "--rdzv-id", args.job_name, "--metrics-port", str(args.metrics_port),
        args.nn_worker, *shlex.split(args.nn_worker_args))
    container = _container(args, "nn-worker", command, ports)
    nodes = args.num_nn_worker_nodes
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(args, name, "nn-worker"),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": _labels(args, "nn-worker"),
                             "annotations": _annotations(args)},
                # Pods of an indexed Job are named <job>-<index>; with the subdomain they
                # resolve as <job>-<index>.<service>, so pod 0 hosts the rendezvous.
                "spec": _pod_spec(args, container, subdomain=name, restartPolicy="Never"),
            },
        },
    }
    return [_headless_service(args, "nn-worker", ports), job]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config files) as literal blocks, readable in the manifest."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render_yaml(args: argparse.Namespace) -> str:
    return yaml.dump_all(render(args), Dumper=_Dumper, sort_keys=False)


def run_k8s(args: argparse.Namespace) -> int:
    text = render_yaml(args)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {os.path.abspath(args.output)}", file=sys.stderr)
    return 0
