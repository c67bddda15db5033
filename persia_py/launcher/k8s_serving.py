"""The serving side of a Kubernetes job (``persia-launcher k8s --serve MODULE:FACTORY``):
a Deployment whose pods run ``persia-launcher serve`` on the job's checkpoints, following
its incremental and dense exports, behind a ClusterIP Service ``<job>-serving``.

Each serving pod waits for the training's first checkpoint (``--wait``), then serves it and
applies each new increment and dense model as they appear, so it reads the checkpoint root
the training writes: the shared volume the job's checkpoints are on. Its clients come
from outside the job: a NetworkPolicy of its own admits them to the Serving port only
(they still need the job token, unless ``--insecure``)."""

from __future__ import annotations

import posixpath

from persia_py.config import ConfigError, load_global_config
from persia_py.launcher import k8s_objects as objects
from persia_py.launcher.k8s_flags import K8sJob

__all__ = ["serving_objects"]

ROLE = "serving"


def _serve_command(spec: K8sJob) -> list[str]:
    config = load_global_config(spec.job.global_config).checkpoint_config
    if not config.dir:
        raise ConfigError("--serve: checkpoint_config.dir is unset, so the training writes no "
                          "checkpoint to serve; set it (on a --shared-volume)")

    def in_pod(path: str) -> str:  # as the serving pod sees it (its WORKDIR is the image's)
        return posixpath.normpath(posixpath.join(objects.POD_WORKDIR, path))

    command = ["persia-launcher", "serve", "--checkpoint", in_pod(config.dir), "--wait",
               "--model", spec.serve_model or "",
               "--embedding-config", f"{objects.CONFIG_DIR}/embedding_config.yml",
               "--global-config", f"{objects.CONFIG_DIR}/global_config.yml",
               "--port", str(spec.serve_port), "--bind", "0.0.0.0",
               "--num-ps", str(spec.job.num_ps), "--metrics-port", str(spec.metrics_port)]
    if config.incremental_dir:
        command += ["--follow-increments", in_pod(config.incremental_dir)]
    if config.dense_export_dir:
        command += ["--follow-dense", in_pod(config.dense_export_dir)]
    return [*command, *(["--insecure"] if spec.job.insecure else [])]


def serving_objects(spec: K8sJob) -> list[dict]:
    """The serving Deployment, its Service and its NetworkPolicy."""
    name = f"{spec.job_name}-{ROLE}"
    ports = {"grpc": spec.serve_port, "metrics": spec.metrics_port}
    container = objects.container(spec, ROLE, _serve_command(spec), ports)
    labels = objects.labels(spec, ROLE)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": objects.meta(spec, name, ROLE),
        "spec": {
            "replicas": spec.serve_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": objects.scrape_annotations(spec)},
                "spec": objects.pod_spec(spec, container),
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": objects.meta(spec, name, ROLE),
        "spec": {"selector": labels,
                 "ports": [{"name": "grpc", "port": spec.serve_port,
                            "targetPort": spec.serve_port}]},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": objects.meta(spec, f"{name}-clients", ROLE),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            # The Serving port from anywhere: its clients are not the job's pods.
            "ingress": [{"ports": [{"protocol": "TCP", "port": spec.serve_port}]}],
        },
    }
    return [policy, service, deployment]
