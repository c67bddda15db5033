"""``persia-launcher k8s``: Kubernetes manifests for one job, rendered from flags.

Objects (all labelled ``app.kubernetes.io/name: persia``, ``persia.job: <job>``,
``persia.role: <role>``):

* ConfigMap ``<job>-config``: ``global_config.yml`` and ``embedding_config.yml``, mounted
  at ``/etc/persia`` in every pod.
* Parameter servers, embedding workers and data loaders: each a StatefulSet behind a
  headless Service of the same name (``<job>-ps``, ``<job>-embedding-worker``,
  ``<job>-data-loader``). A pod's ordinal is its ``--replica-index``, and its DNS name
  (``<job>-ps-3.<job>-ps``) survives restarts, so routing ids by replica index holds.
  Kubernetes restarts a StatefulSet's pods whatever their exit code, and a restart would
  meet a config error (exit code 78) again: these roles run with
  ``--hold-on-config-error`` and hold on one, saying so, until their pod is deleted
  (:func:`persia_py.launcher.roles.hold_after_config_error`).
* NN workers: an indexed Job ``<job>-nn-worker`` whose pods run torchrun with c10d
  rendezvous at pod 0 (``<job>-nn-worker-0.<job>-nn-worker``, headless Service). A pod
  that exits 78 (a config error) fails the Job at once (its ``podFailurePolicy``).

Every container serves Prometheus metrics on ``--metrics-port`` (annotated for
scraping). The image is the one the repository's Dockerfile builds.

Secure by default:

* The job token comes from a Secret (key ``token``): ``--auth-secret-name`` names one that
  exists, else a Secret ``<job>-token`` with a new random token is part of the output.
  It is mounted as a file (``/etc/persia-token/token``) that the global config in the
  ConfigMap names as ``common_config.auth_token_file``; it is never a literal in a pod
  spec. ``--insecure`` is the explicit opt-out (every role then runs with ``--insecure``).
* ``--tls-secret-name`` mounts a TLS Secret (``tls.crt``, ``tls.key``, ``ca.crt``) at
  ``/etc/persia-tls`` and points the config's ``tls_*_file`` at it (mutual TLS).
* A NetworkPolicy ``<job>-ingress`` admits to the job's pods only the job's own pods (every
  port: gRPC, the rendezvous, and the ports torch.distributed picks) and the metrics
  scraper (``--metrics-scraper-namespace`` / ``--metrics-scraper-pods``, metrics port
  only). Servers bind 0.0.0.0 inside their pods, behind the policy and the token.
* Pods run as the image's non-root user (uid 1000, the Dockerfile's ``persia``) without
  privilege escalation, capabilities or a service-account token.
"""

from __future__ import annotations

import logging
import sys

import yaml

from persia_py.config import load_embedding_config, load_global_config
from persia_py.env import job_env
from persia_py.launcher import job_token, role_commands
from persia_py.launcher.job_model import NNPlacement, Placement
from persia_py.launcher.k8s_flags import TLS_DIR, K8sJob
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    ROLE_KINDS,
    RoleKind,
)
from persia_py.ops import allocator
from persia_py.ops.start_checks import CONFIG_EXIT_CODE, check_checkpoint_paths
from persia_py.telemetry.monitoring import ENV_METRICS_PORT

logger = logging.getLogger("persia_py.launcher")

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
_ROLES = {kind.command: kind.short for kind in ROLE_KINDS}  # role -> short name in object names
_KINDS = {kind.command: kind for kind in ROLE_KINDS}


def _job_labels(spec: K8sJob) -> dict[str, str]:
    """Labels every pod of the job carries (and only its pods)."""
    return {"app.kubernetes.io/name": "persia", "persia.job": spec.job_name}


def _labels(spec: K8sJob, role: str) -> dict[str, str]:
    return {**_job_labels(spec), "persia.role": role}


def _token_secret(spec: K8sJob) -> str | None:
    """Name of the Secret that holds the job token (None: ``--insecure``)."""
    if spec.job.insecure:
        return None
    return spec.auth_secret_name or f"{spec.job_name}-token"


def _meta(spec: K8sJob, name: str, role: str, **extra) -> dict:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec, role), **extra}


def _addrs(spec: K8sJob, short: str, count: int, port: int) -> list[str]:
    svc = f"{spec.job_name}-{short}"
    return [f"{svc}-{i}.{svc}.{spec.namespace}.svc:{port}" for i in range(count)]


def _env(spec: K8sJob, role: str) -> list[dict]:
    # A StatefulSet pod's ordinal, or an indexed Job pod's completion index.
    index_field = ("metadata.annotations['batch.kubernetes.io/job-completion-index']"
                   if role == "nn-worker" else "metadata.labels['apps.kubernetes.io/pod-index']")
    variables = job_env(
        ps_addrs=_addrs(spec, "ps", spec.job.num_ps, spec.ports[PARAMETER_SERVER]),
        embedding_worker_addrs=_addrs(spec, "embedding-worker", spec.job.num_embedding_workers,
                                      spec.ports[EMBEDDING_WORKER]),
        data_loader_addrs=_addrs(spec, "data-loader", spec.job.num_data_loaders,
                                 spec.ports[DATA_LOADER]),
        nn_world_size=spec.job.nn_nodes * spec.job.nproc_per_node,
        # Inside a pod, behind the NetworkPolicy and (unless --insecure) the token.
        bind_host="0.0.0.0",
        embedding_config=f"{CONFIG_DIR}/embedding_config.yml",
        global_config=f"{CONFIG_DIR}/global_config.yml")
    variables.update({ENV_METRICS_PORT: str(spec.metrics_port), "PYTHONUNBUFFERED": "1",
                      "GLIBC_TUNABLES": allocator.TUNABLES})
    return [*({"name": k, "value": v} for k, v in variables.items()),
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index_field}}}]


def _secret_volumes(spec: K8sJob) -> list[tuple[dict, str]]:
    """(volume, mount path) of the token and TLS Secrets the pods mount."""
    # Group-readable by the pod's fsGroup (the image's user), by nobody else.
    mode = 0o440
    found = []
    token_secret = _token_secret(spec)
    if token_secret is not None:
        found.append(({"name": "persia-token", "secret": {
            "secretName": token_secret, "defaultMode": mode,
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


def _container(spec: K8sJob, role: str, command: list[str],
               ports: dict[str, int]) -> dict:
    wanted = spec.resources_of(_KINDS[role])
    resources: dict = {"requests": {"cpu": wanted.cpu, "memory": wanted.memory}}
    if wanted.gpus:
        resources["limits"] = {"nvidia.com/gpu": wanted.gpus}
    return {
        "name": role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "env": _env(spec, role),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": resources,
        "volumeMounts": [{"name": "persia-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         *({"name": v["name"], "mountPath": path, "readOnly": True}
                           for v, path in _secret_volumes(spec))],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _pod_spec(spec: K8sJob, container: dict, **extra) -> dict:
    return {
        "containers": [container],
        "volumes": [{"name": "persia-config", "configMap": {"name": f"{spec.job_name}-config"}},
                    *(v for v, _ in _secret_volumes(spec))],
        # The roles never call the Kubernetes API: no credentials for it in the pods.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID,
                            "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        **extra,
    }


def _annotations(spec: K8sJob) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.metrics_port),
            "prometheus.io/path": "/metrics"}


def _headless_service(spec: K8sJob, role: str, ports: dict[str, int]) -> dict:
    name = f"{spec.job_name}-{_ROLES[role]}"
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, role),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _labels(spec, role),
                 "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()]},
    }


def _stateful_set(spec: K8sJob, role: str, replicas: int, port: int,
                  command: list[str], scratch: dict[str, str] | None = None) -> list[dict]:
    """A headless Service and a StatefulSet of ``role``; ``scratch`` names writable
    emptyDir volumes (name -> mount path): they outlive a container's restart in its pod."""
    name = f"{spec.job_name}-{_ROLES[role]}"
    ports = {"grpc": port, "metrics": spec.metrics_port}
    container = _container(spec, role, command, ports)
    scratch = scratch or {}
    container["volumeMounts"] += [{"name": v, "mountPath": path} for v, path in scratch.items()]
    stateful_set: dict = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(spec, name, role),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(spec, role)},
            "template": {
                "metadata": {"labels": _labels(spec, role), "annotations": _annotations(spec)},
                "spec": _pod_spec(spec, container),
            },
        },
    }
    stateful_set["spec"]["template"]["spec"]["volumes"] += [
        {"name": v, "emptyDir": {}} for v in scratch]
    return [_headless_service(spec, role, ports), stateful_set]


NN_MAX_RESTARTS = 3
"""torchrun restarts of the NN ranks before the Job fails."""


LAUNCHER = ("persia-launcher",)
"""``persia-launcher`` in the image."""


def placement(spec: K8sJob, kind: RoleKind) -> Placement:
    """Where a pod of ``kind``'s StatefulSet runs its replica: the pod's ordinal as the
    index, 0.0.0.0 behind the NetworkPolicy and the token, its own log in an emptyDir
    volume (a container restarted in its pod replays it; a new pod starts a new one).
    Kubernetes restarts a StatefulSet's pods whatever their exit code, and a restart would
    meet a config or data error again: the role holds on one instead of exiting
    (persia_py/launcher/roles.py)."""
    own_log = {PARAMETER_SERVER: UPDATE_LOG_DIR,
               DATA_LOADER: f"{HANDOVER_LOG_DIR}/handovers.log"}.get(kind)
    return Placement(LAUNCHER, "$(POD_INDEX)", spec.ports[kind], "0.0.0.0", own_log=own_log,
                     metrics_port=spec.metrics_port, hold_on_final_error=True, replay=True)


def nn_placement(spec: K8sJob) -> NNPlacement:
    """How an NN-worker pod runs torchrun: c10d rendezvous at pod 0. A dead rank:
    torchrun restarts the ranks, which rewind the data loaders and embedding workers to
    their last checkpoint (persia_py/checkpoint/rewind.py); their StatefulSets start them
    again. A lost pod still fails the Job."""
    name = f"{spec.job_name}-nn-worker"
    return NNPlacement(LAUNCHER, metrics_port=spec.metrics_port, max_restarts=NN_MAX_RESTARTS,
                       rdzv_endpoint=f"{name}-0.{name}:{spec.rdzv_port}", rdzv_id=spec.job_name)


def _selector(flag: str, value: str) -> dict[str, str]:
    """``k=v,k2=v2`` as matchLabels ('' matches everything)."""
    labels = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{flag} {value!r}: expected labels as KEY=VALUE[,KEY=VALUE]")
        labels[key.strip()] = val.strip()
    return labels


def _network_policy(spec: K8sJob) -> dict:
    """Ingress to the job's pods: from its own pods, and from the scraper to the metrics."""
    metrics: dict = {"protocol": "TCP", "port": spec.metrics_port}
    if spec.job.nproc_per_node > 1:  # NN-worker rank r serves metrics on port + r
        metrics["endPort"] = spec.metrics_port + spec.job.nproc_per_node - 1
    scraper = {
        "namespaceSelector": {"matchLabels": _selector("--metrics-scraper-namespace",
                                                       spec.metrics_scraper_namespace)},
        "podSelector": {"matchLabels": _selector("--metrics-scraper-pods",
                                                 spec.metrics_scraper_pods)},
    }
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(spec, f"{spec.job_name}-ingress", "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": _job_labels(spec)},
            "policyTypes": ["Ingress"],
            "ingress": [
                # Every port: gloo and NCCL pick their own, beside gRPC and the rendezvous.
                {"from": [{"podSelector": {"matchLabels": _job_labels(spec)}}]},
                {"from": [scraper], "ports": [metrics]},
            ],
        },
    }


def _security_settings(spec: K8sJob) -> dict[str, str]:
    """``common_config`` keys the manifests set, to the files the Secrets are mounted as."""
    settings = {}
    if _token_secret(spec) is not None:
        settings["auth_token_file"] = f"{TOKEN_DIR}/token"
    if spec.tls_secret_name:
        settings.update({key: f"{TLS_DIR}/{name}" for key, name in TLS_FILES.items()})
    return settings


def _global_config_text(spec: K8sJob) -> str:
    """The global config for the ConfigMap: the user's, with the mounted Secrets' paths."""
    text = _read(spec.job.global_config) if spec.job.global_config else "{}\n"
    settings = _security_settings(spec)
    if not settings:
        return text
    data = yaml.safe_load(text) or {}
    common = data.get("common_config") or {}
    for key in settings:
        if common.get(key) is not None:
            raise SystemExit(
                f"--global-config: common_config.{key} is set ({common[key]!r}), but the "
                f"manifests set it to {settings[key]} (a mounted Secret); remove it from the "
                "file" + (" (or pass --insecure)" if key == "auth_token_file" else ""))
    data["common_config"] = {**common, **settings}
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _token_secret_object(spec: K8sJob) -> list[dict]:
    """The Secret with a new random token, unless one is named or there is to be none."""
    name = _token_secret(spec)
    if name is None or spec.auth_secret_name:
        return []
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": _meta(spec, name, "token"),
             "stringData": {"token": job_token.new_token()}}]


def render(spec: K8sJob) -> list[dict]:
    """Every object of the job, in the order to apply them."""
    # As the pods will see them: a folder outside the root is refused before any apply.
    check_checkpoint_paths(load_global_config(spec.job.global_config).checkpoint_config,
                           pod_dir=POD_WORKDIR)
    load_embedding_config(spec.job.embedding_config)
    files = {"embedding_config.yml": _read(spec.job.embedding_config),
             "global_config.yml": _global_config_text(spec)}
    objects: list[dict] = [
        # The policy first: no pod of the job is ever reachable from outside it.
        _network_policy(spec),
        *_token_secret_object(spec),
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": _meta(spec, f"{spec.job_name}-config", "config"), "data": files},
    ]
    # The update log and the handover log live in the pod: a container that dies and is
    # restarted in it replays them (servers/update_log.py, workers/handover_log.py).
    for kind, scratch in ((PARAMETER_SERVER, {"ps-updates": UPDATE_LOG_DIR}),
                          (EMBEDDING_WORKER, None),
                          (DATA_LOADER, {"handovers": HANDOVER_LOG_DIR})):
        objects += _stateful_set(spec, kind.command, spec.job.replicas(kind), spec.ports[kind],
                                 role_commands.server_role(kind, spec.job, placement(spec, kind)),
                                 scratch=scratch)
    objects += _nn_worker_job(spec)
    return objects


def _nn_worker_job(spec: K8sJob) -> list[dict]:
    name = f"{spec.job_name}-nn-worker"
    ports = {"rendezvous": spec.rdzv_port, "metrics": spec.metrics_port}
    command = role_commands.nn_worker(spec.job, nn_placement(spec))
    container = _container(spec, "nn-worker", command, ports)
    nodes = spec.job.nn_nodes
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(spec, name, "nn-worker"),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,
            # A config error (persia_py.ops.start_checks) is final: the Job fails, naming it.
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "nn-worker", "operator": "In",
                "values": [CONFIG_EXIT_CODE]}}]},
            "template": {
                "metadata": {"labels": _labels(spec, "nn-worker"),
                             "annotations": _annotations(spec)},
                # Pods of an indexed Job are named <job>-<index>; with the subdomain they
                # resolve as <job>-<index>.<service>, so pod 0 hosts the rendezvous.
                "spec": _pod_spec(spec, container, subdomain=name, restartPolicy="Never"),
            },
        },
    }
    return [_headless_service(spec, "nn-worker", ports), job]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config files) as literal blocks, readable in the manifest."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render_yaml(spec: K8sJob) -> str:
    return yaml.dump_all(render(spec), Dumper=_Dumper, sort_keys=False)


def run_k8s(spec: K8sJob, output: str = "-") -> int:
    """Render ``spec``'s manifests into ``output`` (``-``: stdout)."""
    text = render_yaml(spec)
    if spec.job.insecure:
        logger.warning("--insecure: the job's roles run WITHOUT a job token; only the "
                       "NetworkPolicy keeps other pods from calling their RPCs")
    if output == "-":
        sys.stdout.write(text)
    else:
        # It may hold the job token (the generated Secret): readable by its owner only.
        path = job_token.write_private_file(output, text)
        print(f"wrote {path}", file=sys.stderr)
    if not (spec.job.insecure or spec.auth_secret_name):
        print(f"the manifest holds Secret {spec.job_name}-token with a new job token: keep it "
              "private; rendering again makes another token, so to re-apply to a running "
              f"job pass --auth-secret-name {spec.job_name}-token", file=sys.stderr)
    return 0
