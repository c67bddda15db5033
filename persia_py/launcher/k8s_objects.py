"""The pieces every Kubernetes object of a job is made of: names and labels, the pods'
environment, containers and pod specs, Secrets' volumes, headless Services and
StatefulSets (:mod:`persia_py.launcher.k8s` assembles a job from them,
:mod:`persia_py.launcher.k8s_serving` its serving Deployment)."""

from __future__ import annotations

from persia_py.env import job_env
from persia_py.launcher.job_model import Resources
from persia_py.launcher.k8s_flags import TLS_DIR, K8sJob
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    ROLE_KINDS,
)
from persia_py.ops import allocator
from persia_py.telemetry.monitoring import ENV_METRICS_PORT

CONFIG_DIR = "/etc/persia"
TOKEN_DIR = "/etc/persia-token"
TLS_FILES = {"tls_cert_file": "tls.crt", "tls_key_file": "tls.key", "tls_ca_file": "ca.crt"}
"""``common_config`` key -> key in the TLS Secret (as cert-manager writes them)."""
IMAGE_UID = 1000
"""The Dockerfile's user ``persia``: pods run as it, and can read the mounted Secrets."""
POD_WORKDIR = "/app"
"""The Dockerfile's ``WORKDIR``: the pods' checkpoint root unless the config sets one."""
KUBERNETES_VERSION = "1.35"
"""The Kubernetes release whose API schemas the manifests are validated against (tests)."""
ROLES = {kind.command: kind.short for kind in ROLE_KINDS}  # role -> short name in object names
KINDS = {kind.command: kind for kind in ROLE_KINDS}


def job_labels(spec: K8sJob) -> dict[str, str]:
    """Labels every pod of the job carries (and only its pods)."""
    return {"app.kubernetes.io/name": "persia", "persia.job": spec.job_name}


def labels(spec: K8sJob, role: str) -> dict[str, str]:
    return {**job_labels(spec), "persia.role": role}


def token_secret(spec: K8sJob) -> str | None:
    """Name of the Secret that holds the job token (None: ``--insecure``)."""
    if spec.job.insecure:
        return None
    return spec.auth_secret_name or f"{spec.job_name}-token"


def meta(spec: K8sJob, name: str, role: str, **extra) -> dict:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, role), **extra}


def addrs(spec: K8sJob, short: str, count: int, port: int) -> list[str]:
    svc = f"{spec.job_name}-{short}"
    return [f"{svc}-{i}.{svc}.{spec.namespace}.svc:{port}" for i in range(count)]


def env(spec: K8sJob, role: str) -> list[dict]:
    # A StatefulSet pod's ordinal, or an indexed Job pod's completion index.
    index_field = ("metadata.annotations['batch.kubernetes.io/job-completion-index']"
                   if role == "nn-worker" else "metadata.labels['apps.kubernetes.io/pod-index']")
    variables = job_env(
        ps_addrs=addrs(spec, "ps", spec.job.num_ps, spec.ports[PARAMETER_SERVER]),
        embedding_worker_addrs=addrs(spec, "embedding-worker", spec.job.num_embedding_workers,
                                      spec.ports[EMBEDDING_WORKER]),
        data_loader_addrs=addrs(spec, "data-loader", spec.job.num_data_loaders,
                                 spec.ports[DATA_LOADER]),
        nn_world_size=spec.job.nn_nodes * spec.job.nproc_per_node,
        # Inside a pod, behind the NetworkPolicy and (unless --insecure) the token.
        bind_host="0.0.0.0",
        embedding_config=f"{CONFIG_DIR}/embedding_config.yml",
        global_config=f"{CONFIG_DIR}/global_config.yml")
    variables.update({ENV_METRICS_PORT: str(spec.metrics_port), "PYTHONUNBUFFERED": "1",
                      "GLIBC_TUNABLES": allocator.BASE_TUNABLES})
    return [*({"name": k, "value": v} for k, v in variables.items()),
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index_field}}}]


def secret_volumes(spec: K8sJob) -> list[tuple[dict, str]]:
    """(volume, mount path) of the token and TLS Secrets the pods mount."""
    # Group-readable by the pod's fsGroup (the image's user), by nobody else.
    mode = 0o440
    found = []
    secret = token_secret(spec)
    if secret is not None:
        found.append(({"name": "persia-token", "secret": {
            "secretName": secret, "defaultMode": mode,
            "items": [{"key": "token", "path": "token"}]}}, TOKEN_DIR))
    if spec.tls_secret_name:
        found.append(({"name": "persia-tls", "secret": {
            "secretName": spec.tls_secret_name, "defaultMode": mode,
            "items": [{"key": k, "path": k} for k in TLS_FILES.values()]}}, TLS_DIR))
    return found


UPDATE_LOG_DIR = "/var/lib/persia/updates"
"""Where a parameter-server pod keeps its update log (an emptyDir volume)."""
HANDOVER_LOG_DIR = "/var/lib/persia/handovers"
"""Where a data-loader pod keeps its handover log (an emptyDir volume)."""
TRAIN_LOG_DIR = "/var/lib/persia/train"
"""Where an NN-worker pod writes the training log without a shared volume (an emptyDir)."""


def container(spec: K8sJob, role: str, command: list[str],
               ports: dict[str, int]) -> dict:
    # A role kind's requests as given; serving's the defaults (it is not a role kind).
    wanted = spec.resources_of(KINDS[role]) if role in KINDS else Resources()
    resources: dict = {"requests": {"cpu": wanted.cpu, "memory": wanted.memory}}
    if wanted.gpus:
        resources["limits"] = {"nvidia.com/gpu": wanted.gpus}
    return {
        "name": role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "env": env(spec, role),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": resources,
        "volumeMounts": [{"name": "persia-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         *({"name": v["name"], "mountPath": path, "readOnly": True}
                           for v, path in secret_volumes(spec)),
                         *({"name": v.volume_name, "mountPath": v.path}
                           for v in spec.shared_volumes)],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def pod_spec(spec: K8sJob, main: dict, **extra) -> dict:
    return {
        "containers": [main],
        "volumes": [{"name": "persia-config", "configMap": {"name": f"{spec.job_name}-config"}},
                    *(v for v, _ in secret_volumes(spec)),
                    *({"name": v.volume_name, "persistentVolumeClaim": {"claimName": v.claim}}
                      for v in spec.shared_volumes)],
        # The roles never call the Kubernetes API: no credentials for it in the pods.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID,
                            "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        **extra,
    }


def scrape_annotations(spec: K8sJob) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.metrics_port),
            "prometheus.io/path": "/metrics"}


def headless_service(spec: K8sJob, role: str, ports: dict[str, int]) -> dict:
    name = f"{spec.job_name}-{ROLES[role]}"
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(spec, name, role),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": labels(spec, role),
                 "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()]},
    }


def stateful_set(spec: K8sJob, role: str, replicas: int, port: int,
                  command: list[str], scratch: dict[str, str] | None = None) -> list[dict]:
    """A headless Service and a StatefulSet of ``role``; ``scratch`` names writable
    emptyDir volumes (name -> mount path): they outlive a container's restart in its pod."""
    name = f"{spec.job_name}-{ROLES[role]}"
    ports = {"grpc": port, "metrics": spec.metrics_port}
    box = container(spec, role, command, ports)
    scratch = scratch or {}
    box["volumeMounts"] += [{"name": v, "mountPath": path} for v, path in scratch.items()]
    stateful_set: dict = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(spec, name, role),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(spec, role)},
            "template": {
                "metadata": {"labels": labels(spec, role), "annotations": scrape_annotations(spec)},
                "spec": pod_spec(spec, box),
            },
        },
    }
    stateful_set["spec"]["template"]["spec"]["volumes"] += [
        {"name": v, "emptyDir": {}} for v in scratch]
    return [headless_service(spec, role, ports), stateful_set]
