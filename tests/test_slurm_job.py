"""``persia-launcher slurm``: a job submitted with ``sbatch`` to a real Slurm cluster
(tests/slurm_cluster.py: slurmctld on one emulated host, slurmd on three others).

* One batch script, a heterogeneous job: the parameter server on ``highmem`` (node1), two
  NN-worker nodes on ``gpu`` (node2, node3; one rank each, c10d rendezvous on node2), the
  embedding worker and data loader beside them, each role a job step. It trains a finite
  stream and every sample exactly once (the ranks write the ids they trained), and trains
  like the same job on one machine (``persia-launcher local``): its test AUC on rows it
  never trained lies within the three-host test's tolerance (auc_reference.AUC_TOLERANCE).
* The parameter server's step killed mid-run (its process on node1, SIGKILL) is restarted
  by the job itself, on the same node and port, its update log replayed; then
  ``scontrol requeue`` stops the job in order (the NN workers' final checkpoint first,
  then the servers) and runs the batch script again, which resumes from that checkpoint:
  the job ends 0, each rank's second run starts where its first stopped, and every sample
  is trained once (the ranks write the ids they trained, and where each run of theirs
  started).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from auc_reference import auc_like_reference
from checkout import ROOT
from child_processes import RoleProcess, launcher_command
from online_jobs import ROWS_PER_FILE, add_file, start, write_config, write_test_rows

pytestmark = pytest.mark.processes

JOB = ROOT / "tests" / "online_job"
NUM_FILES = 8
KILL_FILES = 45
"""The stream of the kill test: long enough that the PS dies, and the job is requeued,
well before its end (30 files were once all but trained at the requeue, under load 21)."""


def _script(slurm, tmp_path: Path, run: str, loader_args: str = "", nn_args: str = "") -> str:
    done = slurm.run(*launcher_command(
        "slurm", "--job-name", f"persia-{run}", "--run-dir", str(tmp_path / run),
        "--nn-worker", str(JOB / "train.py"), "--data-loader", str(JOB / "data_loader.py"),
        "--embedding-config", str(JOB / "embedding_config.yml"),
        "--global-config", str(tmp_path / "global_config.yml"),
        "--num-nn-worker-nodes", "2", "--ps-partition", "highmem", "--worker-partition", "gpu",
        "--no-metrics",
        "--data-loader-args",
        f"--stream {tmp_path / 'stream'} --positions {tmp_path / 'positions'} --finite "
        f"{loader_args}",
        "--nn-worker-args", f"--out {tmp_path / run} {nn_args}"), timeout=120)
    return done.stdout


def _trained(run_dir: Path) -> np.ndarray:
    text = " ".join(p.read_text() for p in sorted(run_dir.glob("ids-rank*.txt")))
    return np.sort(np.array(text.split(), dtype=np.int64))


def _stream(tmp_path: Path, num_files: int = NUM_FILES, every_steps: int = 4) -> int:
    (tmp_path / "stream").mkdir()
    write_config(tmp_path, every_steps=every_steps)
    for i in range(num_files):
        add_file(tmp_path / "stream", i)
    return num_files * ROWS_PER_FILE


def _test_auc(out: str) -> float:
    found = re.findall(r"test_auc: ([\d.]+)", out)
    assert len(found) == 1, out[-20000:]
    return float(found[0])


def test_a_three_host_job_trains_every_sample_once_like_one_machine(slurm, tmp_path: Path
                                                                     ) -> None:
    total = _stream(tmp_path)
    test_rows = write_test_rows(tmp_path / "test.csv")
    # The same job on one machine (persia-launcher local: same scripts, configs, stream,
    # roles and ranks, a folder of its own); the 3-host job's test AUC lies within
    # auc_reference.AUC_TOLERANCE of the range of its runs (auc_like_reference). The first
    # runs beside the Slurm job: neither waits for the other's CPU for long.
    def start_one_machine(name: str) -> RoleProcess:
        work = tmp_path / name
        work.mkdir()
        (work / "stream").symlink_to(tmp_path / "stream")
        write_config(work, every_steps=4)
        return start(work, "run", 2, loader_args="--finite", nn_args=f"--test-csv {test_rows}")

    beside = [start_one_machine("reference-1")]
    try:
        script = _script(slurm, tmp_path, "run", nn_args=f"--test-csv {test_rows}")
        assert "#SBATCH hetjob" in script and "#SBATCH --requeue" in script
        job_id = slurm.submit(script)
        slurm.wait_for_job(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
        out = slurm.output(job_id)
        assert slurm.job(job_id)["JobState"] == "COMPLETED", out[-20000:]
        # Each role ran where the layout put it: the NN ranks on two nodes.
        assert re.search(r"training finished", out), out[-20000:]
        np.testing.assert_array_equal(_trained(tmp_path / "run"), np.arange(total))

        def one_machine(name: str) -> float:
            return _test_auc((beside.pop() if beside else start_one_machine(name)
                              ).finish(timeout=300))

        auc_like_reference(_test_auc(out), one_machine)
    finally:
        for local in beside:  # the test failed before its reference finished
            local.stop()


def _lines(run_dir: Path, rank: int) -> list[np.ndarray]:
    text = (run_dir / f"ids-rank{rank}.txt").read_text()
    return [np.array(line.split(), dtype=np.int64) for line in text.splitlines()]


def test_a_killed_step_is_restarted_and_a_requeued_job_resumes(slurm, tmp_path: Path) -> None:
    # No periodic checkpoint before the requeue: the job can resume only from the one
    # written at the stop (without it, it would start over and train every sample twice).
    total = _stream(tmp_path, KILL_FILES, every_steps=1000)
    job_id = slurm.submit(_script(slurm, tmp_path, "run"))
    slurm.wait_for_output(job_id, r"rank \d trained \d+ samples", timeout=300)
    # The parameter server's step: its process on node1 and the srun that started it (the
    # hosts share this machine's process table; the update log's path is this job's).
    found = subprocess.run(["pgrep", "-f", f"embedding-parameter-server .*{tmp_path}/run/ps-0-"],
                           capture_output=True, text=True, timeout=30)
    pids = [int(p) for p in found.stdout.split()]
    assert pids, slurm.output(job_id)[-20000:]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    slurm.wait_for_output(job_id, r"ps-0 died \(.*\); restarting it on the same port",
                          timeout=120)
    # A few steps later Slurm requeues the job (as after a preemption): the job stops in
    # order and the batch script runs again, resuming from the checkpoint written at the
    # stop.
    steps = len(re.findall(r"rank 0 trained", slurm.output(job_id)))
    slurm.wait_for_output(job_id, r"rank 0 trained", timeout=300, count=steps + 4)
    slurm.requeue(job_id)
    slurm.wait_for_output(job_id, rf"Slurm job {job_id} \(restart 1\)", timeout=120)
    slurm.wait_for_job(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    out = slurm.output(job_id)
    assert slurm.job(job_id)["JobState"] == "COMPLETED", out[-20000:]
    resumed = [int(n) for n in re.findall(r"resuming from \S+ckpt-\S+ \((\d+) batches "
                                          r"trained\)", out)]
    assert len(resumed) == 1, f"not resumed from one checkpoint: {resumed}\n{out[-20000:]}"
    batches = resumed[0]
    # The requeue stopped the job in order: the ranks finished their step and wrote a
    # final checkpoint while the servers still served (they wait for the supervisor, not
    # for Slurm's SIGTERM), then the servers stopped. The second run resumed from that
    # checkpoint, the step the ranks had reached, not from an earlier one: it holds every
    # batch the first run trained (each rank's second run starts right after its first's
    # last step), and every sample was trained once.
    first_run = out[:out.index(f"Slurm job {job_id} (restart 1)")]
    assert re.search(r"training ended \([^)]*\) at step \d+; final checkpoint", first_run), \
        first_run[-20000:]
    trained, firsts = [], []
    for rank in (0, 1):
        starts = [int(n) for n in
                  (tmp_path / "run" / f"starts-rank{rank}.txt").read_text().split()]
        assert len(starts) == 2 and starts[0] == 0, (starts, out[-20000:])
        firsts.append(starts[1])
        trained += _lines(tmp_path / "run", rank)
    assert sum(firsts) == batches > 0, (firsts, batches, out[-20000:])
    np.testing.assert_array_equal(np.sort(np.concatenate(trained)), np.arange(total))
