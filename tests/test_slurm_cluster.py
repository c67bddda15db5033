"""The Slurm cluster of tests/slurm_cluster.py works as issue 41's Slurm tests use it: a
batch job's steps run one task on each of three emulated hosts, a heterogeneous job puts
its parts in the partitions and on the nodes it names, ``scontrol requeue`` runs a job
again, and a node lost mid-job (its slurmd and processes killed, or its network cut) is
marked DOWN, the job requeued, and the node back once it answers again."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.processes

JOB_TIMEOUT_S = 60
LOSS_TIMEOUT_S = 60
"""A bound on how long Slurm takes to mark a lost node DOWN: 7-16 s here (the report of
``test_lost_nodes_marked_down_and_job_requeued``), longer on a loaded machine."""

TASK = """\
echo "task $SLURM_PROCID on $SLURMD_NODENAME host $(hostname) ip $(hostname -I)"
if [ -n "$1" ]; then
  # at most 120 s: a test that failed before releasing the job leaves nothing running long
  timeout 120 sh -c 'until [ -e "$0" ]; do sleep 0.1; done' "$1" || { echo never released; exit 1; }
fi
"""
"""A task: says where it runs, then, given a file's path, waits until that file exists."""
TASK_LINE = r"^task (\d+) on (\S+) host (\S+) ip (\S+)"


@pytest.fixture
def task(slurm) -> str:
    path = slurm.folder / "task.sh"
    path.write_text(TASK)
    return f"sh {path}"


def test_batch_steps_run_one_task_on_each_host(slurm, task):
    job = slurm.submit(f"""#!/bin/sh
#SBATCH --nodes=3 --ntasks-per-node=1
echo "batch on $(hostname) nodes $SLURM_JOB_NODELIST"
srun --ntasks-per-node=1 {task}
""")
    state = slurm.wait_for_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    out = slurm.output(job)
    assert state["JobState"] == "COMPLETED", out
    assert "batch on node1 nodes node[1-3]" in out, out
    tasks = sorted(m.groups() for m in slurm.wait_for_output(job, TASK_LINE, 5, count=3))
    assert [(node, host, ip) for _, node, host, ip in tasks] == [
        (name, name, slurm.nodes[name].ip) for name in ("node1", "node2", "node3")], out
    # srun from the controller host, as a launcher's processes may be started
    direct = slurm.start("srun", "--nodes=3", "--ntasks-per-node=1", *task.split())
    tasks = sorted(line.split()[3] for line in direct.finish(JOB_TIMEOUT_S).splitlines()
                   if line.startswith("task "))
    assert tasks == ["node1", "node2", "node3"], direct.output()


def test_heterogeneous_job_parts_in_their_partitions(slurm, task):
    """The real job's shape: its parameter servers in ``highmem``, NN workers in ``gpu``,
    a step pinned to a chosen node with ``--nodelist``."""
    job = slurm.submit(f"""#!/bin/sh
#SBATCH --partition=highmem --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --partition=gpu --nodes=2 --ntasks-per-node=1
srun --het-group=0 sh -c 'echo "ps: $(hostname) $(hostname -I)"'
srun --het-group=1 {task}
srun --het-group=1 --nodes=1 --ntasks=1 --nodelist=node3 sh -c 'echo "pinned: $(hostname)"'
""")
    state = slurm.wait_for_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    out = slurm.output(job)
    assert state["JobState"] == "COMPLETED", out
    assert f"ps: node1 {slurm.nodes['node1'].ip}" in out, out
    tasks = sorted(m.groups() for m in slurm.wait_for_output(job, TASK_LINE, 5, count=2))
    assert [host for _, _, host, _ in tasks] == ["node2", "node3"], out
    assert "pinned: node3" in out, out


def test_requeued_job_runs_again(slurm, task):
    flag = slurm.folder / "release-requeue"
    job = slurm.submit(f"""#!/bin/sh
#SBATCH --nodes=1
echo "run ${{SLURM_RESTART_COUNT:-0}} on $(hostname)"
{task} {flag}
""")
    slurm.wait_for_output(job, r"^run 0 on", JOB_TIMEOUT_S)
    requeued = time.monotonic()
    slurm.requeue(job)
    slurm.wait_for_output(job, r"^run 1 on", JOB_TIMEOUT_S)
    print(f"requeued job running again after {time.monotonic() - requeued:.1f} s")
    flag.touch()
    state = slurm.wait_for_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state,
                                                                           slurm.output(job))


def test_lost_nodes_marked_down_and_job_requeued(slurm, task):
    """Two nodes lost while a 3-node job runs on them, node2 cut off from the network
    (its processes run on) and node3 killed (slurmd, job step and tasks): Slurm marks both
    DOWN and requeues the job (``JobRequeue=1``); once they answer again they are back
    (``ReturnToService=2``) and the job runs again, with ``SLURM_RESTART_COUNT=1``."""
    flag = slurm.folder / "release-lost"
    job = slurm.submit(f"""#!/bin/sh
#SBATCH --nodes=3 --ntasks-per-node=1
echo "run ${{SLURM_RESTART_COUNT:-0}}"
srun --ntasks-per-node=1 {task} {flag}
""")
    slurm.wait_for_output(job, TASK_LINE, JOB_TIMEOUT_S, count=3)
    lost = time.monotonic()
    slurm.cut_node("node2")
    slurm.kill_node("node3")
    down_s = {}
    while len(down_s) < 2:
        states = slurm.wait_for_nodes(["node2", "node3"], {"down*"}, LOSS_TIMEOUT_S,
                                      any_of=True)
        down_s.update({name: time.monotonic() - lost for name in ("node2", "node3")
                       if states[name] == "down*" and name not in down_s})
    state = slurm.wait_for_job(job, {"PENDING", "CONFIGURING", "RUNNING"}, JOB_TIMEOUT_S)
    assert state["Restarts"] == "1", state
    requeued_s = time.monotonic() - lost
    slurm.join_node("node2")
    slurm.restart_node("node3")
    slurm.wait_for_nodes(["node2", "node3"], {"idle", "mix", "alloc"}, LOSS_TIMEOUT_S)
    back_s = time.monotonic() - lost
    slurm.wait_for_output(job, r"^run 1$", JOB_TIMEOUT_S)
    again_s = time.monotonic() - lost
    flag.touch()
    state = slurm.wait_for_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    print(f"after the loss: node2 (cut off) DOWN at {down_s['node2']:.1f} s, node3 (killed) "
          f"at {down_s['node3']:.1f} s; the job requeued by {requeued_s:.1f} s; both nodes "
          f"back by {back_s:.1f} s; the job running again at {again_s:.1f} s")
    assert state["JobState"] == "COMPLETED", (state, slurm.output(job))
