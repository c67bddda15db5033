"""``persia-launcher k8s``: every rendered object's kind, names, ports, env and counts."""

from __future__ import annotations

import pytest
import yaml
from checkout import EXAMPLE

from persia_py.config import ConfigError
from persia_py.launcher.cli import build_parser, main
from persia_py.launcher.job_flags import k8s_from_flags
from persia_py.launcher.k8s import render_yaml

FLAGS = [
    "k8s", "--job-name", "ctr", "--namespace", "ml", "--image", "registry.example/persia-py:1",
    "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
    "--global-config", str(EXAMPLE / "global_config.yml"),
    "--nn-worker", "/app/examples/criteo_synthetic/train.py", "--nn-worker-args", "--test-samples 5",
    "--data-loader", "/app/examples/criteo_synthetic/data_loader.py",
    "--num-ps", "3", "--num-embedding-workers", "2", "--num-data-loaders", "4",
    "--num-nn-worker-nodes", "2", "--nproc-per-node", "8", "--nn-worker-gpus", "8",
    "--ps-memory", "64Gi", "--ps-cpu", "16", "--metrics-port", "9100",
]


def _render(*flags: str) -> list[dict]:
    return list(yaml.safe_load_all(render_yaml(k8s_from_flags(
        build_parser().parse_args(list(flags))))))


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_objects_match_the_flags() -> None:
    objects = _render(*FLAGS)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert kinds == {
        ("NetworkPolicy", "ctr-ingress"), ("Secret", "ctr-token"), ("ConfigMap", "ctr-config"),
        ("Service", "ctr-ps"), ("StatefulSet", "ctr-ps"),
        ("Service", "ctr-embedding-worker"), ("StatefulSet", "ctr-embedding-worker"),
        ("Service", "ctr-data-loader"), ("StatefulSet", "ctr-data-loader"),
        ("Service", "ctr-nn-worker"), ("Job", "ctr-nn-worker"),
    }
    # The policy, the token and the config come before any pod that needs them.
    assert len(objects) == len(kinds)
    assert [o["kind"] for o in objects[:3]] == ["NetworkPolicy", "Secret", "ConfigMap"]
    assert all(o["metadata"]["namespace"] == "ml" for o in objects)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}

    config = by["ConfigMap", "ctr-config"]["data"]
    assert config["embedding_config.yml"] == (EXAMPLE / "embedding_config.yml").read_text()
    # The user's global config, plus the path the token Secret is mounted at.
    expected = yaml.safe_load((EXAMPLE / "global_config.yml").read_text())
    expected["common_config"]["auth_token_file"] = "/etc/persia-token/token"
    assert yaml.safe_load(config["global_config.yml"]) == expected

    for name, replicas, port in (("ctr-ps", 3, 23000), ("ctr-embedding-worker", 2, 23001),
                                 ("ctr-data-loader", 4, 23002)):
        service, sts = by["Service", name], by["StatefulSet", name]
        assert service["spec"]["clusterIP"] == "None"  # headless: stable per-pod DNS names
        assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
            "grpc": port, "metrics": 9100}
        assert sts["spec"]["serviceName"] == name and sts["spec"]["replicas"] == replicas
        assert sts["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "registry.example/persia-py:1"
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "grpc": port, "metrics": 9100}
        command = container["command"]
        assert command[command.index("--port") + 1] == str(port)
        assert command[command.index("--replica-index") + 1] == "$(POD_INDEX)"
        assert command[command.index("--replica-size") + 1] == str(replicas)
        assert command[command.index("--metrics-port") + 1] == "9100"
        assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
        assert container["volumeMounts"][0]["mountPath"] == "/etc/persia"
        assert sts["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == "ctr-config"

    ps = by["StatefulSet", "ctr-ps"]["spec"]["template"]["spec"]["containers"][0]
    assert ps["command"][:2] == ["persia-launcher", "embedding-parameter-server"]
    assert ps["resources"]["requests"] == {"cpu": "16", "memory": "64Gi"}
    env = _env(ps)
    assert env["PERSIA_PS_ADDRS"] == ",".join(
        f"ctr-ps-{i}.ctr-ps.ml.svc:23000" for i in range(3))
    assert env["PERSIA_EMBEDDING_WORKER_ADDRS"] == ",".join(
        f"ctr-embedding-worker-{i}.ctr-embedding-worker.ml.svc:23001" for i in range(2))
    assert env["PERSIA_DATA_LOADER_ADDRS"].count(",") == 3
    assert env["PERSIA_NN_WORKER_WORLD_SIZE"] == "16"
    assert env["PERSIA_GLOBAL_CONFIG"] == "/etc/persia/global_config.yml"
    assert env["PERSIA_EMBEDDING_CONFIG"] == "/etc/persia/embedding_config.yml"
    assert env["PERSIA_BIND_HOST"] == "0.0.0.0" and env["PERSIA_METRICS_PORT"] == "9100"
    assert env["POD_INDEX"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']")
    dl = by["StatefulSet", "ctr-data-loader"]["spec"]["template"]["spec"]["containers"][0]
    assert dl["command"][-1] == "/app/examples/criteo_synthetic/data_loader.py"

    job = by["Job", "ctr-nn-worker"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == 2
    pod = job["template"]["spec"]
    assert pod["subdomain"] == "ctr-nn-worker" and pod["restartPolicy"] == "Never"
    (nn,) = pod["containers"]
    command = nn["command"]
    assert command[:2] == ["persia-launcher", "nn-worker"]
    flags = dict(zip(command[2:-3:2], command[3:-3:2]))
    assert flags == {"--nproc-per-node": "8", "--nnodes": "2", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": "ctr-nn-worker-0.ctr-nn-worker:29500",
                     "--rdzv-id": "ctr", "--metrics-port": "9100", "--max-restarts": "3",
                     # Where the pod's user can write it (an emptyDir), not the image's /app.
                     "--train-log": "/var/lib/persia/train/train_log.jsonl"}
    assert command[-3:] == ["/app/examples/criteo_synthetic/train.py", "--test-samples", "5"]
    assert nn["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {p["name"]: p["containerPort"] for p in nn["ports"]} == {"rendezvous": 29500,
                                                                     "metrics": 9100}
    assert _env(nn)["PERSIA_PS_ADDRS"] == env["PERSIA_PS_ADDRS"]
    service = by["Service", "ctr-nn-worker"]["spec"]
    assert service["clusterIP"] == "None" and service["selector"]["persia.role"] == "nn-worker"


def test_a_config_error_fails_the_nn_worker_job_at_once() -> None:
    """Exit code 78 (persia_py.ops.start_checks): the pod would stop the same way again."""
    (job,) = [o for o in _render(*FLAGS) if o["kind"] == "Job"]
    assert job["spec"]["podFailurePolicy"]["rules"] == [{"action": "FailJob", "onExitCodes": {
        "containerName": "nn-worker", "operator": "In", "values": [78]}}]


def test_the_stateful_sets_roles_hold_on_a_config_error() -> None:
    """A StatefulSet restarts its pods whatever their exit code, into the same config
    error: their roles hold on one (--hold-on-config-error) instead of exiting 78. The NN
    workers' Job fails on 78 (above): they exit."""
    parser = build_parser()
    holds = {}
    for template in _pod_templates(_render(*FLAGS)):
        (container,) = template["spec"]["containers"]
        # Each command as the role's own parser reads it (with a pod's index filled in).
        argv = [("0" if arg == "$(POD_INDEX)" else arg) for arg in container["command"][1:]]
        args = parser.parse_args(argv)
        holds[args.command] = getattr(args, "hold_on_config_error", False)
    assert holds == {"embedding-parameter-server": True, "embedding-worker": True,
                     "data-loader": True, "nn-worker": False}


def test_cli_writes_the_manifest(tmp_path) -> None:
    out = tmp_path / "job.yaml"
    assert main([*FLAGS, "-o", str(out)]) == 0
    assert len(list(yaml.safe_load_all(out.read_text()))) == 11
    assert out.stat().st_mode & 0o777 == 0o600  # it holds the generated token

def test_configs_are_validated_before_rendering(tmp_path) -> None:
    bad = tmp_path / "global_config.yml"
    bad.write_text("embedding_worker_config:\n  forward_bufer_size: 3\n")
    flags = [*FLAGS]
    flags[flags.index("--global-config") + 1] = str(bad)
    with pytest.raises(ConfigError, match="forward_bufer_size: unknown key"):
        _render(*flags)
    # As the pods will see it: they start in the image's WORKDIR, the checkpoint root.
    bad.write_text("checkpoint_config:\n  dir: /data/job/ckpt\n  every_steps: 10\n")
    with pytest.raises(ConfigError, match=r"checkpoint_config.dir: '/data/job/ckpt' lies "
                                          r"outside the checkpoint root /app \(checkpoint_config"
                                          r".root is unset: the pods' working directory\)"):
        _render(*flags)
    # In the root, but in each pod's own filesystem: lost with the pod, and a part in each.
    bad.write_text("checkpoint_config:\n  dir: ckpt\n  every_steps: 10\n")
    with pytest.raises(ConfigError, match=r"checkpoint_config.dir: /app/ckpt lies on no shared "
                                          r"volume(.|\n)*--shared-volume CLAIM:PATH"):
        _render(*flags)
    bad.write_text("checkpoint_config:\n  root: /data/job\n  dir: /data/job/ckpt\n  every_steps: 10\n")
    assert _render(*flags, "--shared-volume", "team-data:/data")


@pytest.mark.parametrize("flag, value", [("--job-name", "Bad_Name"), ("--num-ps", "0"),
                                         ("--auth-secret-name", "Bad/Name"),
                                         ("--tls-secret-name", "TLS")])
def test_bad_flags_are_refused(flag: str, value: str) -> None:
    flags = [*FLAGS, flag, value]  # the last one given wins
    # A count below one is a config error of the job model (exit 78 from the CLI).
    with pytest.raises((SystemExit, ConfigError), match=flag):
        _render(*flags)


# -- secure by default ----------------------------------------------------------------------

def _pod_templates(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Job")]


def _global_config(objects: list[dict]) -> dict:
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return yaml.safe_load(config["data"]["global_config.yml"])


def test_the_token_comes_from_a_secret_file_never_a_literal_in_a_pod_spec() -> None:
    objects = _render(*FLAGS)
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    token = secret["stringData"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
    others = [o for o in objects if o is not secret]
    assert not [o["metadata"]["name"] for o in others if token in yaml.safe_dump(o)]
    assert _global_config(objects)["common_config"]["auth_token_file"] == (
        "/etc/persia-token/token")
    templates = _pod_templates(objects)
    assert len(templates) == 4
    for template in templates:
        pod = template["spec"]
        volume = {v["name"]: v for v in pod["volumes"]}["persia-token"]["secret"]
        assert volume["secretName"] == "ctr-token"
        assert volume["items"] == [{"key": "token", "path": "token"}]
        assert volume["defaultMode"] == 0o440  # the pod's group (fsGroup) only
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
        (container,) = pod["containers"]
        assert {"name": "persia-token", "mountPath": "/etc/persia-token",
                "readOnly": True} in container["volumeMounts"]
        assert "PERSIA_AUTH_TOKEN" not in _env(container)
        assert "--insecure" not in container["command"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}
    again = [o for o in _render(*FLAGS) if o["kind"] == "Secret"][0]["stringData"]["token"]
    assert again != token  # a new token per rendering


def test_an_existing_token_secret_is_referenced_not_made() -> None:
    objects = _render(*FLAGS, "--auth-secret-name", "team-token")
    assert "Secret" not in {o["kind"] for o in objects}
    for template in _pod_templates(objects):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["persia-token"]["secret"]["secretName"] == "team-token"


def test_insecure_is_an_explicit_opt_out_that_every_role_is_told() -> None:
    objects = _render(*FLAGS, "--insecure")
    kinds = [o["kind"] for o in objects]
    assert "Secret" not in kinds and kinds[0] == "NetworkPolicy"
    assert "auth_token_file" not in (_global_config(objects).get("common_config") or {})
    for template in _pod_templates(objects):
        (container,) = template["spec"]["containers"]
        assert container["command"][2] == "--insecure"  # right after the subcommand
        assert "persia-token" not in {v["name"] for v in template["spec"]["volumes"]}
    with pytest.raises(SystemExit, match="--insecure and --auth-secret-name"):
        _render(*FLAGS, "--insecure", "--auth-secret-name", "team-token")


def test_a_tls_secret_is_mounted_and_the_config_points_at_it() -> None:
    objects = _render(*FLAGS, "--tls-secret-name", "ctr-tls")
    common = _global_config(objects)["common_config"]
    assert {k: common[k] for k in ("tls_cert_file", "tls_key_file", "tls_ca_file")} == {
        "tls_cert_file": "/etc/persia-tls/tls.crt", "tls_key_file": "/etc/persia-tls/tls.key",
        "tls_ca_file": "/etc/persia-tls/ca.crt"}
    for template in _pod_templates(objects):
        volume = {v["name"]: v for v in template["spec"]["volumes"]}["persia-tls"]["secret"]
        assert volume["secretName"] == "ctr-tls"
        assert {i["key"] for i in volume["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        (container,) = template["spec"]["containers"]
        assert {"name": "persia-tls", "mountPath": "/etc/persia-tls",
                "readOnly": True} in container["volumeMounts"]
    assert "persia-tls" not in yaml.safe_dump(_render(*FLAGS))  # only when asked


def test_the_network_policy_admits_the_jobs_pods_and_the_metrics_scraper_only() -> None:
    objects = _render(*FLAGS)
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    job = {"app.kubernetes.io/name": "persia", "persia.job": "ctr"}
    assert spec["podSelector"] == {"matchLabels": job} and spec["policyTypes"] == ["Ingress"]
    for template in _pod_templates(objects):  # the policy covers every pod of the job
        assert job.items() <= template["metadata"]["labels"].items()
    own, scraper = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": job}}]}
    assert scraper["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    # Metrics only; NN-worker rank r of 8 serves on 9100 + r.
    assert scraper["ports"] == [{"protocol": "TCP", "port": 9100, "endPort": 9107}]

    custom = _render(*FLAGS, "--metrics-scraper-namespace", "team=obs, tier=infra",
                     "--metrics-scraper-pods", "")
    (policy,) = [o for o in custom if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"][1]["from"] == [{
        "namespaceSelector": {"matchLabels": {"team": "obs", "tier": "infra"}},
        "podSelector": {"matchLabels": {}}}]
    with pytest.raises(SystemExit, match="--metrics-scraper-pods"):
        _render(*FLAGS, "--metrics-scraper-pods", "prometheus")


def test_a_config_that_sets_what_the_secrets_provide_is_refused(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    config = tmp_path / "global_config.yml"
    config.write_text(f"common_config:\n  auth_token_file: {token}\n")
    flags = [*FLAGS]
    flags[flags.index("--global-config") + 1] = str(config)
    with pytest.raises(SystemExit, match="common_config.auth_token_file is set"):
        _render(*flags)
    # With --insecure the manifests set no token file: the user's stays as written.
    assert _global_config(_render(*flags, "--insecure")) == {
        "common_config": {"auth_token_file": str(token)}}
