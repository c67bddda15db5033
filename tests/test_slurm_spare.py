"""``persia-launcher slurm --spare-nodes 1``: a job on the real Slurm cluster
(tests/slurm_cluster.py) loses its parameter server's node mid-run (its ``slurmd`` and
every process on it SIGKILLed) and finishes, every sample trained once, with the server
on the spare node.

The parameter servers' component holds two nodes from partition ``all`` (the spare first,
where the job's supervisor runs, then the parameter server's), the NN-worker component one
node of ``gpu`` (with the embedding worker and the data loader). Once Slurm marks the lost
node DOWN the server's step ends; the supervisor starts it on the spare, from its last
checkpoint and its update log (in the run folder, on the file system every node shares),
and writes its address in the job's address book, where the embedding worker and the
checkpoint client find it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from child_processes import launcher_command
from test_slurm_job import JOB, KILL_FILES, _stream, _trained

from persia_py.launcher import slurm_run
from persia_py.launcher.job_model import Job, Script
from persia_py.launcher.role_kinds import PARAMETER_SERVER
from persia_py.launcher.slurm import SlurmJob, render_script

pytestmark = pytest.mark.processes

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def test_the_spares_come_first_and_the_script_asks_for_them(monkeypatch) -> None:
    job = Job(embedding_config="e.yml", global_config=None, nn_worker=Script("t.py"),
              data_loader=Script("d.py"), num_ps=3)
    spec = SlurmJob(job=job, job_name="ctr", run_dir="/shared/run", ps_nodes=2, spare_nodes=1)
    script = render_script(spec)
    head, workers = script.split("#SBATCH hetjob")
    assert "#SBATCH --no-kill" in head and "#SBATCH --nodes=3" in head
    assert "--no-kill" not in workers and "#SBATCH --nodes=1" in workers
    plain = render_script(dataclasses.replace(spec, spare_nodes=0))
    assert "--no-kill" not in plain and "#SBATCH --nodes=2" in plain
    # scontrol expands Slurm's node lists; here the lists are already plain names.
    monkeypatch.setattr(slurm_run, "hostnames", lambda nodelist: nodelist.split(","))
    layout = slurm_run.slurm_layout(spec, {"SLURM_JOB_NODELIST_HET_GROUP_0": "big1,big2,big3",
                                           "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu1"})
    assert layout.hosts[PARAMETER_SERVER] == ["big2", "big3", "big2"]
    assert layout.lost is not None and layout.relocate is not None
    with pytest.raises(SystemExit, match="component 0 has 1 nodes, not more than "
                                         "--spare-nodes 1"):
        slurm_run.slurm_layout(spec, {"SLURM_JOB_NODELIST_HET_GROUP_0": "big1",
                                      "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu1"})


def _script(slurm, tmp_path: Path, run: str) -> str:
    done = slurm.run(*launcher_command(
        "slurm", "--job-name", f"persia-{run}", "--run-dir", str(tmp_path / run),
        "--nn-worker", str(JOB / "train.py"), "--data-loader", str(JOB / "data_loader.py"),
        "--embedding-config", str(JOB / "embedding_config.yml"),
        "--global-config", str(tmp_path / "global_config.yml"),
        "--ps-partition", "all", "--spare-nodes", "1", "--worker-partition", "gpu",
        "--no-metrics", "--data-loader-args",
        f"--stream {tmp_path / 'stream'} --positions {tmp_path / 'positions'} --finite",
        "--nn-worker-args", f"--out {tmp_path / run}"), timeout=120)
    return done.stdout


def _book(run_dir: Path) -> tuple[int, list[str]]:
    data = json.loads((run_dir / "addresses.json").read_text())
    return data["version"], data["roles"]["ps"]


def _batch_host(slurm, job_id: int) -> str:
    """Where the batch script (and the supervisor) runs: component 0's first node (the
    cluster's ``job`` merges the components' lines, the last one's fields winning)."""
    lines = slurm.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout.splitlines()
    [first] = [line for line in lines if "HetJobOffset=0 " in line]
    found = re.search(r"BatchHost=(\S+)", first)
    assert found, first
    return found.group(1)


def test_a_parameter_server_whose_node_is_lost_goes_on_on_the_spare(
        slurm, tmp_path: Path) -> None:
    total = _stream(tmp_path, KILL_FILES)
    script = _script(slurm, tmp_path, "run")
    assert "#SBATCH --no-kill" in script
    assert script.split("#SBATCH hetjob")[0].count("#SBATCH --nodes=2") == 1, script
    job_id = slurm.submit(script)
    slurm.wait_for_output(job_id, r"checkpoint \S+ckpt-\S+ written", timeout=300)
    version, [address] = _book(tmp_path / "run")
    node, port = address.split(":")
    batch_host = _batch_host(slurm, job_id)
    assert version == 1 and node != batch_host, (address, batch_host)
    slurm.kill_node(node)
    [moved] = slurm.wait_for_output(
        job_id, rf"ps-0: node {node} is down\*; starting it on spare node (\S+) ", timeout=120)
    assert moved.group(1) == batch_host
    slurm.wait_for_job(job_id, ENDED, timeout=400)
    out = slurm.output(job_id)
    assert slurm.job(job_id)["JobState"] == "COMPLETED", out[-20000:]
    assert _book(tmp_path / "run") == (2, [f"{batch_host}:{port}"])
    # The embedding worker (and any checkpoint after the move) called it there; the
    # server came back with its update log replayed on its last checkpoint.
    assert re.search(rf"moved to parameter server {batch_host}:{port}", out), out[-20000:]
    assert "its update log applied again" in out, out[-20000:]
    assert not re.search(r"parameter server (\S+) moved to parameter server \1;", out)
    assert len(re.findall(r"Slurm job \d+ \(restart", out)) == 1, out[-20000:]  # no requeue
    np.testing.assert_array_equal(_trained(tmp_path / "run"), np.arange(total))
