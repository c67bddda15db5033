"""``persia-launcher k8s --shared-volume CLAIM:PATH``: an online job whose checkpoints,
exports, stream and logs outlive its pods.

* Every container of every role (and of the serving Deployment) mounts the claim at PATH
  read-write; the manifests pass the API schemas (strict).
* Every folder a pod writes that another pod, or the pod's successor, reads lies on a
  shared volume: the configs' folders, the scripts' declared folders, and the roles' own
  logs (update log, handover log, training log), read from each pod's command line.
* Without the flag the same job is refused at render time, exit 78, naming the folder and
  the flag that fixes it; so is a declared folder off the volume.
"""

from __future__ import annotations

import posixpath

import pytest
import yaml
from checkout import EXAMPLE
from test_k8s import _render
from test_k8s_schemas import _schema_errors

from persia_py.launcher.cli import build_parser, main
from persia_py.launcher.role_kinds import ROLE_KINDS
from persia_py.ops.start_checks import CONFIG_EXIT_CODE

CLAIM, PATH = "ctr-data", "/data"


def _online_job(tmp_path, *extra: str) -> list[str]:
    config = tmp_path / "global_config.yml"
    config.write_text(yaml.safe_dump({"checkpoint_config": {
        "root": f"{PATH}/ctr", "dir": f"{PATH}/ctr/ckpt", "every_steps": 500,
        "incremental_dir": f"{PATH}/ctr/increments", "incremental_every_sec": 60,
        "dense_export_dir": f"{PATH}/ctr/dense", "dense_export_every_sec": 60}}))
    return ["k8s", "--job-name", "ctr", "--image", "registry.example/ctr-job:1",
            "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
            "--global-config", str(config),
            "--nn-worker", "/app/job/train.py",
            "--data-loader", "/app/job/data_loader.py",
            "--data-loader-args", f"--stream {PATH}/stream --positions {PATH}/ctr/positions",
            "--data-folder", f"{PATH}/stream", "--data-folder", f"{PATH}/ctr/positions",
            "--num-ps", "2", "--num-data-loaders", "2", "--num-nn-worker-nodes", "2",
            "--serve", "/app/job/model.py:Model", *extra]


def _pods(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(kind/name, pod spec, its container) of every workload."""
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"],
             o["spec"]["template"]["spec"]["containers"][0])
            for o in objects if o["kind"] in ("StatefulSet", "Job", "Deployment")]


def _claim_mounts(pod: dict, container: dict) -> dict[str, str]:
    """Mount path -> claim, of the container's PersistentVolumeClaim mounts."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claims[m["name"]] for m in container["volumeMounts"]
            if m["name"] in claims and not m.get("readOnly")}


def _written(container: dict) -> list[str]:
    """The folders and files a role's command line says it writes and replays."""
    argv = [w.replace("$(POD_INDEX)", "0") for w in container["command"]]
    command = argv[1]
    if command not in {k.command for k in ROLE_KINDS}:
        return []  # serving reads only
    args = vars(build_parser(command).parse_args(argv[1:]))
    return [args[k] for k in ("update_log", "handover_log", "train_log") if args.get(k)]


def test_every_pod_mounts_the_claim_and_writes_what_outlives_it_there(tmp_path) -> None:
    objects = _render(*_online_job(tmp_path, "--shared-volume", f"{CLAIM}:{PATH}"))
    assert _schema_errors(objects) == []
    pods = _pods(objects)
    assert {name.split("/")[0] for name, _, _ in pods} == {"StatefulSet", "Job", "Deployment"}
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")
                            ["data"]["global_config.yml"])["checkpoint_config"]
    for name, pod, container in pods:
        mounts = _claim_mounts(pod, container)
        assert mounts == {PATH: CLAIM}, name  # read-write, at PATH, in every container
        # Every folder the pod writes that outlives it: the configs' (each role writes
        # some), the scripts' declared ones, and its own logs.
        shared = [config["dir"], config["incremental_dir"], config["dense_export_dir"],
                  f"{PATH}/stream", f"{PATH}/ctr/positions", *_written(container)]
        off = [p for p in shared if not any(
            posixpath.commonpath([m, p]) == m for m in mounts)]
        assert off == [], (name, off)
    # The roles' own logs moved onto the volume: no emptyDir stands in for them.
    assert not any("emptyDir" in v for _, pod, _ in pods for v in pod["volumes"])
    [serving] = [c for name, _, c in pods if name.startswith("Deployment")]
    assert serving["command"][:2] == ["persia-launcher", "serve"]
    assert {"--wait", "--follow-increments", "--follow-dense"} <= set(serving["command"])


def test_without_a_shared_volume_the_job_is_refused_naming_folder_and_flag(tmp_path,
                                                                             capsys) -> None:
    assert main(_online_job(tmp_path)) == CONFIG_EXIT_CODE
    err = capsys.readouterr().err
    for source, path in (("checkpoint_config.dir", f"{PATH}/ctr/ckpt"),
                         ("checkpoint_config.incremental_dir", f"{PATH}/ctr/increments"),
                         ("--data-folder", f"{PATH}/stream")):
        assert f"{source}: {path} lies on no shared volume" in err, err
    assert "--shared-volume CLAIM:PATH" in err


def test_a_declared_folder_off_the_volume_is_refused(tmp_path, capsys) -> None:
    flags = _online_job(tmp_path, "--shared-volume", f"{CLAIM}:{PATH}",
                        "--data-folder", "/scratch/positions")
    assert main(flags) == CONFIG_EXIT_CODE
    err = capsys.readouterr().err
    assert "--data-folder: /scratch/positions lies on no shared volume" in err, err
    assert f"shared volumes: {CLAIM} at {PATH}" in err


@pytest.mark.parametrize("value", ["ctr-data", "ctr-data:data", "ctr-data:/", ":/data"])
def test_a_malformed_shared_volume_is_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["k8s", "--shared-volume", value])
