"""``persia-launcher k8s``: every rendered object's kind, names, ports, env and counts."""

from __future__ import annotations

import pytest
import yaml
from conftest import EXAMPLE

from persia_py.config import ConfigError
from persia_py.launcher.cli import build_parser, main
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
    return list(yaml.safe_load_all(render_yaml(build_parser().parse_args(list(flags)))))


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_objects_match_the_flags() -> None:
    objects = _render(*FLAGS)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert kinds == {
        ("ConfigMap", "ctr-config"),
        ("Service", "ctr-ps"), ("StatefulSet", "ctr-ps"),
        ("Service", "ctr-embedding-worker"), ("StatefulSet", "ctr-embedding-worker"),
        ("Service", "ctr-data-loader"), ("StatefulSet", "ctr-data-loader"),
        ("Service", "ctr-nn-worker"), ("Job", "ctr-nn-worker"),
    }
    assert len(objects) == len(kinds) and objects[0]["kind"] == "ConfigMap"
    assert all(o["metadata"]["namespace"] == "ml" for o in objects)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}

    config = by["ConfigMap", "ctr-config"]["data"]
    assert config["embedding_config.yml"] == (EXAMPLE / "embedding_config.yml").read_text()
    assert config["global_config.yml"] == (EXAMPLE / "global_config.yml").read_text()

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
                     "--rdzv-id": "ctr", "--metrics-port": "9100"}
    assert command[-3:] == ["/app/examples/criteo_synthetic/train.py", "--test-samples", "5"]
    assert nn["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {p["name"]: p["containerPort"] for p in nn["ports"]} == {"rendezvous": 29500,
                                                                     "metrics": 9100}
    assert _env(nn)["PERSIA_PS_ADDRS"] == env["PERSIA_PS_ADDRS"]
    service = by["Service", "ctr-nn-worker"]["spec"]
    assert service["clusterIP"] == "None" and service["selector"]["persia.role"] == "nn-worker"


def test_cli_writes_the_manifest(tmp_path) -> None:
    out = tmp_path / "job.yaml"
    assert main([*FLAGS, "-o", str(out)]) == 0
    assert len(list(yaml.safe_load_all(out.read_text()))) == 9


def test_configs_are_validated_before_rendering(tmp_path) -> None:
    bad = tmp_path / "global_config.yml"
    bad.write_text("embedding_worker_config:\n  forward_bufer_size: 3\n")
    flags = [*FLAGS]
    flags[flags.index("--global-config") + 1] = str(bad)
    with pytest.raises(ConfigError, match="forward_bufer_size: unknown key"):
        _render(*flags)


@pytest.mark.parametrize("flag, value", [("--job-name", "Bad_Name"), ("--num-ps", "0")])
def test_bad_flags_are_refused(flag: str, value: str) -> None:
    flags = [*FLAGS]
    flags[flags.index(flag) + 1] = value
    with pytest.raises(SystemExit, match=flag):
        _render(*flags)
