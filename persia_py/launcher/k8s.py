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

import argparse
import logging
import shlex
import sys

import yaml

from persia_py.config import load_embedding_config, load_global_config
from persia_py.env import job_env
from persia_py.launcher import job_token
from persia_py.launcher.k8s_flags import TLS_DIR, check_k8s_args
from persia_py.launcher.role_kinds import ROLE_KINDS
from persia_py.launcher.roles import HOLD_ON_CONFIG_ERROR
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


def _job_labels(args: argparse.Namespace) -> dict[str, str]:
    """Labels every pod of the job carries (and only its pods)."""
    return {"app.kubernetes.io/name": "persia", "persia.job": args.job_name}


def _labels(args: argparse.Namespace, role: str) -> dict[str, str]:
    return {**_job_labels(args), "persia.role": role}


def _token_secret(args: argparse.Namespace) -> str | None:
    """Name of the Secret that holds the job token (None: ``--insecure``)."""
    if args.insecure:
        return None
    return args.auth_secret_name or f"{args.job_name}-token"


def _meta(args: argparse.Namespace, name: str, role: str, **extra) -> dict:
    return {"name": name, "namespace": args.namespace, "labels": _labels(args, role), **extra}


def _addrs(args: argparse.Namespace, short: str, count: int, port: int) -> list[str]:
    svc = f"{args.job_name}-{short}"
    return [f"{svc}-{i}.{svc}.{args.namespace}.svc:{port}" for i in range(count)]


def _env(args: argparse.Namespace, role: str) -> list[dict]:
    # A StatefulSet pod's ordinal, or an indexed Job pod's completion index.
    index_field = ("metadata.annotations['batch.kubernetes.io/job-completion-index']"
                   if role == "nn-worker" else "metadata.labels['apps.kubernetes.io/pod-index']")
    variables = job_env(
        ps_addrs=_addrs(args, "ps", args.num_ps, args.ps_port),
        embedding_worker_addrs=_addrs(args, "embedding-worker", args.num_embedding_workers,
                                      args.embedding_worker_port),
        data_loader_addrs=_addrs(args, "data-loader", args.num_data_loaders,
                                 args.data_loader_port),
        nn_world_size=args.num_nn_worker_nodes * args.nproc_per_node,
        # Inside a pod, behind the NetworkPolicy and (unless --insecure) the token.
        bind_host="0.0.0.0",
        embedding_config=f"{CONFIG_DIR}/embedding_config.yml",
        global_config=f"{CONFIG_DIR}/global_config.yml")
    variables.update({ENV_METRICS_PORT: str(args.metrics_port), "PYTHONUNBUFFERED": "1",
                      "GLIBC_TUNABLES": allocator.TUNABLES})
    return [*({"name": k, "value": v} for k, v in variables.items()),
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index_field}}}]


def _secret_volumes(args: argparse.Namespace) -> list[tuple[dict, str]]:
    """(volume, mount path) of the token and TLS Secrets the pods mount."""
    # Group-readable by the pod's fsGroup (the image's user), by nobody else.
    mode = 0o440
    found = []
    token_secret = _token_secret(args)
    if token_secret is not None:
        found.append(({"name": "persia-token", "secret": {
            "secretName": token_secret, "defaultMode": mode,
            "items": [{"key": "token", "path": "token"}]}}, TOKEN_DIR))
    if args.tls_secret_name:
        found.append(({"name": "persia-tls", "secret": {
            "secretName": args.tls_secret_name, "defaultMode": mode,
            "items": [{"key": k, "path": k} for k in TLS_FILES.values()]}}, TLS_DIR))
    return found


UPDATE_LOG_DIR = "/var/lib/persia/updates"
"""Where a parameter-server pod keeps its update log (an emptyDir volume)."""
HANDOVER_LOG_DIR = "/var/lib/persia/handovers"
"""Where a data-loader pod keeps its handover log (an emptyDir volume)."""


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
        "volumeMounts": [{"name": "persia-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         *({"name": v["name"], "mountPath": path, "readOnly": True}
                           for v, path in _secret_volumes(args))],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _pod_spec(args: argparse.Namespace, container: dict, **extra) -> dict:
    return {
        "containers": [container],
        "volumes": [{"name": "persia-config", "configMap": {"name": f"{args.job_name}-config"}},
                    *(v for v, _ in _secret_volumes(args))],
        # The roles never call the Kubernetes API: no credentials for it in the pods.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID,
                            "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
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
                  command: list[str], scratch: dict[str, str] | None = None) -> list[dict]:
    """A headless Service and a StatefulSet of ``role``; ``scratch`` names writable
    emptyDir volumes (name -> mount path): they outlive a container's restart in its pod."""
    name = f"{args.job_name}-{_ROLES[role]}"
    ports = {"grpc": port, "metrics": args.metrics_port}
    container = _container(args, role, command, ports)
    scratch = scratch or {}
    container["volumeMounts"] += [{"name": v, "mountPath": path} for v, path in scratch.items()]
    stateful_set: dict = {
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
    stateful_set["spec"]["template"]["spec"]["volumes"] += [
        {"name": v, "emptyDir": {}} for v in scratch]
    return [_headless_service(args, role, ports), stateful_set]


def _launcher(args: argparse.Namespace, role: str, *flags: str) -> list[str]:
    return ["persia-launcher", role, *(["--insecure"] if args.insecure else []), *flags]


def _stateful_launcher(args: argparse.Namespace, role: str, *flags: str) -> list[str]:
    """The command of a StatefulSet's role. Its pods are restarted whatever their exit
    code, and a restart would meet a config error again: the role holds on one instead
    of exiting 78 (persia_py/launcher/roles.py)."""
    return _launcher(args, role, HOLD_ON_CONFIG_ERROR, *flags)


def _selector(flag: str, value: str) -> dict[str, str]:
    """``k=v,k2=v2`` as matchLabels ('' matches everything)."""
    labels = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{flag} {value!r}: expected labels as KEY=VALUE[,KEY=VALUE]")
        labels[key.strip()] = val.strip()
    return labels


def _network_policy(args: argparse.Namespace) -> dict:
    """Ingress to the job's pods: from its own pods, and from the scraper to the metrics."""
    metrics: dict = {"protocol": "TCP", "port": args.metrics_port}
    if args.nproc_per_node > 1:  # NN-worker rank r serves metrics on port + r
        metrics["endPort"] = args.metrics_port + args.nproc_per_node - 1
    scraper = {
        "namespaceSelector": {"matchLabels": _selector("--metrics-scraper-namespace",
                                                       args.metrics_scraper_namespace)},
        "podSelector": {"matchLabels": _selector("--metrics-scraper-pods",
                                                 args.metrics_scraper_pods)},
    }
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(args, f"{args.job_name}-ingress", "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": _job_labels(args)},
            "policyTypes": ["Ingress"],
            "ingress": [
                # Every port: gloo and NCCL pick their own, beside gRPC and the rendezvous.
                {"from": [{"podSelector": {"matchLabels": _job_labels(args)}}]},
                {"from": [scraper], "ports": [metrics]},
            ],
        },
    }


def _security_settings(args: argparse.Namespace) -> dict[str, str]:
    """``common_config`` keys the manifests set, to the files the Secrets are mounted as."""
    settings = {}
    if _token_secret(args) is not None:
        settings["auth_token_file"] = f"{TOKEN_DIR}/token"
    if args.tls_secret_name:
        settings.update({key: f"{TLS_DIR}/{name}" for key, name in TLS_FILES.items()})
    return settings


def _global_config_text(args: argparse.Namespace) -> str:
    """The global config for the ConfigMap: the user's, with the mounted Secrets' paths."""
    text = _read(args.global_config) if args.global_config else "{}\n"
    settings = _security_settings(args)
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


def _token_secret_object(args: argparse.Namespace) -> list[dict]:
    """The Secret with a new random token, unless one is named or there is to be none."""
    name = _token_secret(args)
    if name is None or args.auth_secret_name:
        return []
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": _meta(args, name, "token"),
             "stringData": {"token": job_token.new_token()}}]


def render(args: argparse.Namespace) -> list[dict]:
    """Every object of the job, in the order to apply them."""
    check_k8s_args(args)
    # As the pods will see them: a folder outside the root is refused before any apply.
    check_checkpoint_paths(load_global_config(args.global_config).checkpoint_config,
                           pod_dir=POD_WORKDIR)
    load_embedding_config(args.embedding_config)
    files = {"embedding_config.yml": _read(args.embedding_config),
             "global_config.yml": _global_config_text(args)}
    objects: list[dict] = [
        # The policy first: no pod of the job is ever reachable from outside it.
        _network_policy(args),
        *_token_secret_object(args),
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": _meta(args, f"{args.job_name}-config", "config"), "data": files},
    ]
    index = "$(POD_INDEX)"  # expanded by Kubernetes from the env var above
    metrics = ["--metrics-port", str(args.metrics_port)]
    # The update log lives in the pod: a container that dies and is restarted in it
    # replays it (servers/update_log.py); a new pod starts with an empty one.
    objects += _stateful_set(
        args, "embedding-parameter-server", args.num_ps, args.ps_port,
        _stateful_launcher(args, "embedding-parameter-server", "--port", str(args.ps_port),
                           "--bind", "0.0.0.0", "--replica-index", index,
                           "--replica-size", str(args.num_ps), *metrics,
                           "--update-log", UPDATE_LOG_DIR, "--replay-update-log"),
        scratch={"ps-updates": UPDATE_LOG_DIR})
    objects += _stateful_set(
        args, "embedding-worker", args.num_embedding_workers, args.embedding_worker_port,
        _stateful_launcher(args, "embedding-worker", "--port", str(args.embedding_worker_port),
                           "--bind", "0.0.0.0", "--replica-index", index,
                           "--replica-size", str(args.num_embedding_workers), *metrics))
    # Likewise a data loader's handover log (workers/handover_log.py).
    objects += _stateful_set(
        args, "data-loader", args.num_data_loaders, args.data_loader_port,
        _stateful_launcher(args, "data-loader", "--port", str(args.data_loader_port),
                           "--replica-index", index, "--replica-size", str(args.num_data_loaders),
                           *metrics, "--handover-log", f"{HANDOVER_LOG_DIR}/handovers.log",
                           "--replay-handovers", args.data_loader,
                           *shlex.split(args.data_loader_args)),
        scratch={"handovers": HANDOVER_LOG_DIR})
    objects += _nn_worker_job(args)
    return objects


NN_MAX_RESTARTS = 3
"""torchrun restarts of the NN ranks before the Job fails."""


def _nn_worker_job(args: argparse.Namespace) -> list[dict]:
    name = f"{args.job_name}-nn-worker"
    ports = {"rendezvous": args.rdzv_port, "metrics": args.metrics_port}
    command = _launcher(
        args, "nn-worker", "--nproc-per-node", str(args.nproc_per_node),
        "--nnodes", str(args.num_nn_worker_nodes),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{name}-0.{name}:{args.rdzv_port}",
        "--rdzv-id", args.job_name, "--metrics-port", str(args.metrics_port),
        # A dead rank: torchrun restarts the ranks, which rewind the data loaders and
        # embedding workers to their last checkpoint (persia_py/checkpoint/rewind.py); their
        # StatefulSets start them again. A lost pod still fails the Job.
        "--max-restarts", str(NN_MAX_RESTARTS),
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
            # A config error (persia_py.ops.start_checks) is final: the Job fails, naming it.
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "nn-worker", "operator": "In",
                "values": [CONFIG_EXIT_CODE]}}]},
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
    if args.insecure:
        logger.warning("--insecure: the job's roles run WITHOUT a job token; only the "
                       "NetworkPolicy keeps other pods from calling their RPCs")
    if args.output == "-":
        sys.stdout.write(text)
    else:
        # It may hold the job token (the generated Secret): readable by its owner only.
        path = job_token.write_private_file(args.output, text)
        print(f"wrote {path}", file=sys.stderr)
    if not (args.insecure or args.auth_secret_name):
        print(f"the manifest holds Secret {args.job_name}-token with a new job token: keep it "
              "private; rendering again makes another token, so to re-apply to a running "
              f"job pass --auth-secret-name {args.job_name}-token", file=sys.stderr)
    return 0
