"""The job model (persia_py/launcher/job_model.py): one job, rendered by every engine,
each role's command line built in one place (persia_py/launcher/role_commands.py).

* ``local``, ``k8s`` and ``slurm`` run, for the same job, the same command for each role, up
  to what the engine places: port, bind address, replica index, metrics port, the role's own log,
  holding on a final error and replaying on a restart. A flag one engine gives a role and
  the other does not fails here.
* The job's counts are checked once, as a config error naming the flag.
* The folders the configs name say who writes and who reads them.
"""

from __future__ import annotations

import argparse

import pytest
import yaml
from checkout import EXAMPLE

from persia_py.config import ConfigError
from persia_py.launcher import slurm_run
from persia_py.launcher.cli import build_parser
from persia_py.launcher.job_model import Job, Layout, Script
from persia_py.launcher.job_roles import job_roles
from persia_py.launcher.k8s import render
from persia_py.launcher.k8s_flags import K8sJob
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    NN_WORKER,
    PARAMETER_SERVER,
    ROLE_KINDS,
)
from persia_py.launcher.slurm import SlurmJob

PLACED = {"port", "bind", "replica_index", "metrics_port", "update_log", "handover_log",
          "hold_on_config_error", "replay_update_log", "replay_handovers"}
"""What an engine decides for a server role or data loader (job_model.Placement)."""
NN_PLACED = {"metrics_port", "max_restarts", "nnodes", "rdzv_backend", "rdzv_endpoint", "train_log",
             "rdzv_id"}
"""What an engine decides for the NN workers of a node (job_model.NNPlacement)."""


def _job(**changes) -> Job:
    fields = dict(embedding_config=str(EXAMPLE / "embedding_config.yml"),
                  global_config=str(EXAMPLE / "global_config.yml"),
                  nn_worker=Script("train.py", ("--epochs", "2")),
                  data_loader=Script("data_loader.py", ("--stream", "s")),
                  num_ps=2, num_embedding_workers=2, num_data_loaders=2, nproc_per_node=2,
                  nn_restarts="torchrun")
    return Job(**{**fields, **changes})


def _parsed(command: list[str]) -> argparse.Namespace:
    """A role's command line as its subcommand parses it (after the launcher itself)."""
    at = next(i for i, word in enumerate(command) if word in {k.command for k in ROLE_KINDS})
    # Kubernetes expands the pod's index from its environment.
    words = [w.replace("$(POD_INDEX)", "0") for w in command[at:]]
    return build_parser(words[0]).parse_args(words)


def _layout(num: int) -> Layout:
    kinds = (PARAMETER_SERVER, EMBEDDING_WORKER, DATA_LOADER)
    return Layout(hosts={k: ["127.0.0.1"] * num for k in kinds},
                  ports={k: [100 * j + i for i in range(num)] for j, k in enumerate(kinds, 1)},
                  bind="127.0.0.1")


def _local_commands(job: Job) -> dict:
    roles = job_roles(job, run_dir="/run", root=None, layout=_layout(2), metrics=True)
    return {(r.kind, r.name.rsplit("-", 1)[-1] if r.kind is not NN_WORKER else "0"): r.command
            for r in roles}


def _slurm_commands(job: Job, monkeypatch) -> dict:
    # scontrol expands Slurm's node lists; here the lists are already plain names.
    monkeypatch.setattr(slurm_run, "hostnames", lambda nodelist: nodelist.split(","))
    spec = SlurmJob(job=job, job_name="ctr", run_dir="/shared/run")
    layout = slurm_run.slurm_layout(spec, {"SLURM_JOB_NODELIST_HET_GROUP_0": "big1",
                                           "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu1,gpu2"})
    roles = job_roles(job, run_dir="/shared/run", root=None, layout=layout, metrics=True)
    return {r.kind: r.command for r in roles}


def _k8s_commands(job: Job) -> dict:
    found = {}
    for item in render(K8sJob(job=job, job_name="ctr", image="persia:1")):
        if item["kind"] in ("StatefulSet", "Job"):
            spec = item["spec"]["template"]["spec"]["containers"][0]
            kind = next(k for k in ROLE_KINDS if k.command == spec["name"])
            found[kind] = spec["command"]
    return found


@pytest.mark.parametrize("insecure", [False, True])
def test_every_engine_runs_the_same_command_for_each_role(insecure: bool, monkeypatch) -> None:
    job = _job(insecure=insecure, nn_nodes=2)
    local, k8s, slurm = (_local_commands(job), _k8s_commands(job),
                         _slurm_commands(job, monkeypatch))
    assert set(k8s) == set(slurm) == set(ROLE_KINDS)
    for (kind, index), command in local.items():
        mine = vars(_parsed(command))
        placed = NN_PLACED if kind is NN_WORKER else PLACED
        for engine in (k8s, slurm):
            theirs = vars(_parsed(engine[kind]))
            assert {k: v for k, v in mine.items() if k not in placed} == \
                {k: v for k, v in theirs.items() if k not in placed}, (kind, command,
                                                                       engine[kind])
        assert mine["insecure"] is insecure
        theirs = vars(_parsed(k8s[kind]))
        if kind is not NN_WORKER:
            assert mine["replica_index"] == int(index)
            assert k8s[kind][k8s[kind].index("--replica-index") + 1] == "$(POD_INDEX)"
    # What differs is the engine's: Kubernetes restarts a pod whatever its exit code, so
    # its servers always replay their logs and hold on a final error.
    ps = _parsed(k8s[PARAMETER_SERVER])
    assert ps.replay_update_log and ps.hold_on_config_error and ps.bind == "0.0.0.0"
    assert not _parsed(local[(PARAMETER_SERVER, "0")]).replay_update_log
    # Slurm: each server a step pinned to its node of its component; the NN workers one
    # step over component 1, meeting at its first node.
    assert slurm[PARAMETER_SERVER][:2] == ["srun", "--overlap"]
    assert {"--het-group=0", "--nodelist=big1"} <= set(slurm[PARAMETER_SERVER])
    assert {"--het-group=1", "--nodes=2"} <= set(slurm[NN_WORKER])
    assert _parsed(slurm[NN_WORKER]).rdzv_endpoint == "gpu1:23300"
    # Slurm's SIGTERM stops the NN workers; the servers wait for the supervisor's SIGUSR2.
    assert "PERSIA_STOP_SIGNALS=SIGUSR2,SIGINT" in slurm[PARAMETER_SERVER]
    assert "PERSIA_STOP_SIGNALS=SIGTERM,SIGUSR2,SIGINT" in slurm[NN_WORKER]


def test_a_restart_in_local_replays_the_roles_own_log() -> None:
    roles = job_roles(_job(), run_dir="/run", root=None, layout=_layout(1), metrics=False)
    by_kind = {r.kind: r for r in roles}
    assert _parsed(by_kind[PARAMETER_SERVER].restart()).replay_update_log
    assert _parsed(by_kind[DATA_LOADER].restart()).replay_handovers
    assert by_kind[EMBEDDING_WORKER].restart() == by_kind[EMBEDDING_WORKER].command
    assert by_kind[NN_WORKER].restart is None  # the training restarts (launcher/recovery.py)


@pytest.mark.parametrize("name,flag", [("num_ps", "--num-ps"),
                                       ("nproc_per_node", "--nproc-per-node")])
def test_counts_below_one_are_config_errors_naming_the_flag(name: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"{flag} must be >= 1; got 0"):
        _job(**{name: 0})


def test_the_configs_folders_say_who_writes_and_who_reads_them(tmp_path) -> None:
    config = tmp_path / "global_config.yml"
    config.write_text(yaml.safe_dump({"checkpoint_config": {
        "root": str(tmp_path), "dir": str(tmp_path / "ckpt"), "every_steps": 10,
        "incremental_dir": str(tmp_path / "inc"), "dense_export_dir": str(tmp_path / "dense")}}))
    folders = {f.source: f for f in _job(global_config=str(config)).folders()}
    assert set(folders) == {"checkpoint_config.dir", "checkpoint_config.incremental_dir",
                            "checkpoint_config.dense_export_dir"}
    checkpoints = folders["checkpoint_config.dir"]
    assert checkpoints.shared and set(checkpoints.writers) == {NN_WORKER, PARAMETER_SERVER}
    assert all(f.outlives_process for f in folders.values())


def test_serves_servers_are_the_training_roles_placed_as_serving_replicas(tmp_path) -> None:
    """``serve``'s parameter servers and embedding worker get their commands from
    role_commands: a training role's, plus what a serving replica takes."""
    from pathlib import Path

    from persia_py.launcher.cli import build_parser
    from persia_py.launcher.role_options import role_options_from_flags
    from persia_py.launcher.serve import _server_roles

    options = role_options_from_flags(build_parser().parse_args([
        "serve", "--checkpoint", str(tmp_path), "--embedding-config", "e.yml", "--model",
        "m.py:M", "--num-ps", "2", "--insecure", "--follow-increments", "inc",
        "--metrics-port", "0"]))
    ps0, ps1, worker = (build_parser().parse_args(role.command[3:])
                        for role in _server_roles(options, "/abs/e.yml", Path("/ckpt/7"),
                                                  "127.0.0.1", [5001, 5002], 5003))
    assert (ps1.command, ps1.port, ps1.replica_index, ps1.replica_size) == (
        "embedding-parameter-server", 5002, 1, 2)
    assert (ps0.inference, ps0.load_checkpoint, ps0.insecure, ps0.metrics_port) == (
        True, "/ckpt/7", True, 0)
    assert ps0.follow_increments.endswith("/inc") and ps0.follow_increments.startswith("/")
    assert (worker.command, worker.port, worker.bind, worker.metrics_port) == (
        "embedding-worker", 5003, "127.0.0.1", 0)


def test_the_batch_scripts_slurm_run_gets_the_job_slurm_was_given() -> None:
    from persia_py.launcher.job_flags import slurm_from_flags

    spec, _ = slurm_from_flags(build_parser("slurm").parse_args([
        "slurm", "--job-name", "ctr", "--run-dir", "/shared/run", "--nn-worker", "t.py",
        "--data-loader", "d.py", "--embedding-config", "e.yml", "--num-nn-worker-nodes", "2",
        "--nn-worker-args", "--lr -1", "--max-restarts", "0", "--no-metrics", "--submit"]))
    again, options = slurm_from_flags(build_parser("slurm-run").parse_args(
        ["slurm-run", *spec.flags]))
    assert again.job == spec.job and again.job.max_restarts == 0, spec.flags
    assert again.job.nn_worker.args == ("--lr", "-1") and not options.metrics
