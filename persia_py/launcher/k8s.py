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

``--shared-volume CLAIM:PATH`` mounts a ReadWriteMany claim in every pod and moves the roles'
own logs onto it; a folder that must outlive a pod but lies on no shared volume is refused
(:mod:`persia_py.launcher.k8s_volumes`). ``--serve`` adds a serving Deployment
(:mod:`persia_py.launcher.k8s_serving`). Each role's command comes from
:mod:`persia_py.launcher.role_commands`, as ``local``'s does.

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
from persia_py.launcher import job_token, role_commands
from persia_py.launcher import k8s_objects as objects
from persia_py.launcher.job_model import NNPlacement, Placement
from persia_py.launcher.k8s_flags import TLS_DIR, K8sJob
from persia_py.launcher.k8s_serving import serving_objects
from persia_py.launcher.k8s_volumes import check_on_shared_volumes
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    RoleKind,
)
from persia_py.ops.start_checks import CONFIG_EXIT_CODE, check_checkpoint_paths

logger = logging.getLogger("persia_py.launcher")

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
    if spec.home is not None:  # a deleted pod's successor, on any node, replays them
        own_log = {PARAMETER_SERVER: f"{spec.home}/ps-$(POD_INDEX)-updates",
                   DATA_LOADER: f"{spec.home}/data-loader-$(POD_INDEX)-handovers.log"}.get(kind)
    else:  # in an emptyDir: a container restarted in its pod replays them
        own_log = {PARAMETER_SERVER: objects.UPDATE_LOG_DIR,
                   DATA_LOADER: f"{objects.HANDOVER_LOG_DIR}/handovers.log"}.get(kind)
    return Placement(LAUNCHER, "$(POD_INDEX)", spec.ports[kind], "0.0.0.0", own_log=own_log,
                     metrics_port=spec.metrics_port, hold_on_final_error=True, replay=True)


def nn_placement(spec: K8sJob) -> NNPlacement:
    """How an NN-worker pod runs torchrun: c10d rendezvous at pod 0. A dead rank:
    torchrun restarts the ranks, which rewind the data loaders and embedding workers to
    their last checkpoint (persia_py/checkpoint/rewind.py); their StatefulSets start them
    again. A lost pod still fails the Job."""
    name = f"{spec.job_name}-nn-worker"
    # The training log where the pod's user can write it: on the shared volume (a later
    # run goes on with it), else in an emptyDir (the image's WORKDIR is not the user's).
    train_log = f"{spec.home or objects.TRAIN_LOG_DIR}/train_log.jsonl"
    return NNPlacement(LAUNCHER, metrics_port=spec.metrics_port, max_restarts=NN_MAX_RESTARTS,
                       rdzv_endpoint=f"{name}-0.{name}:{spec.rdzv_port}", rdzv_id=spec.job_name,
                       train_log=train_log)


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
        "metadata": objects.meta(spec, f"{spec.job_name}-ingress", "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": objects.job_labels(spec)},
            "policyTypes": ["Ingress"],
            "ingress": [
                # Every port: gloo and NCCL pick their own, beside gRPC and the rendezvous.
                {"from": [{"podSelector": {"matchLabels": objects.job_labels(spec)}}]},
                {"from": [scraper], "ports": [metrics]},
            ],
        },
    }


def _security_settings(spec: K8sJob) -> dict[str, str]:
    """``common_config`` keys the manifests set, to the files the Secrets are mounted as."""
    settings = {}
    if objects.token_secret(spec) is not None:
        settings["auth_token_file"] = f"{objects.TOKEN_DIR}/token"
    if spec.tls_secret_name:
        settings.update({key: f"{TLS_DIR}/{name}" for key, name in objects.TLS_FILES.items()})
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
    name = objects.token_secret(spec)
    if name is None or spec.auth_secret_name:
        return []
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": objects.meta(spec, name, "token"),
             "stringData": {"token": job_token.new_token()}}]


def render(spec: K8sJob) -> list[dict]:
    """Every object of the job, in the order to apply them."""
    # As the pods will see them: a folder outside the root is refused before any apply.
    check_checkpoint_paths(load_global_config(spec.job.global_config).checkpoint_config,
                           pod_dir=objects.POD_WORKDIR)
    check_on_shared_volumes(spec.folders(), spec.shared_volumes, objects.POD_WORKDIR)
    load_embedding_config(spec.job.embedding_config)
    files = {"embedding_config.yml": _read(spec.job.embedding_config),
             "global_config.yml": _global_config_text(spec)}
    found: list[dict] = [
        # The policy first: no pod of the job is ever reachable from outside it.
        _network_policy(spec),
        *_token_secret_object(spec),
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": objects.meta(spec, f"{spec.job_name}-config", "config"), "data": files},
    ]
    # The update log and the handover log: on the shared volume (a deleted pod's successor
    # replays them), else in the pod (a container that dies and is restarted in it replays
    # them: servers/update_log.py, workers/handover_log.py).
    own = spec.home is None
    for kind, scratch in ((PARAMETER_SERVER, {"ps-updates": objects.UPDATE_LOG_DIR}),
                          (EMBEDDING_WORKER, None),
                          (DATA_LOADER, {"handovers": objects.HANDOVER_LOG_DIR})):
        found += objects.stateful_set(
            spec, kind.command, spec.job.replicas(kind), spec.ports[kind],
            role_commands.server_role(kind, spec.job, placement(spec, kind)),
            scratch=scratch if own else None)
    found += _nn_worker_job(spec)
    if spec.serve_model is not None:
        found += serving_objects(spec)
    return found


def _nn_worker_job(spec: K8sJob) -> list[dict]:
    name = f"{spec.job_name}-nn-worker"
    ports = {"rendezvous": spec.rdzv_port, "metrics": spec.metrics_port}
    command = role_commands.nn_worker(spec.job, nn_placement(spec))
    container = objects.container(spec, "nn-worker", command, ports)
    scratch = [] if spec.home else [{"name": "train-log", "emptyDir": {}}]
    container["volumeMounts"] += [{"name": v["name"], "mountPath": objects.TRAIN_LOG_DIR}
                                  for v in scratch]
    nodes = spec.job.nn_nodes
    job: dict = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": objects.meta(spec, name, "nn-worker"),
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
                "metadata": {"labels": objects.labels(spec, "nn-worker"),
                             "annotations": objects.scrape_annotations(spec)},
                # Pods of an indexed Job are named <job>-<index>; with the subdomain they
                # resolve as <job>-<index>.<service>, so pod 0 hosts the rendezvous.
                "spec": objects.pod_spec(spec, container, subdomain=name, restartPolicy="Never"),
            },
        },
    }
    job["spec"]["template"]["spec"]["volumes"] += scratch
    return [objects.headless_service(spec, "nn-worker", ports), job]


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
