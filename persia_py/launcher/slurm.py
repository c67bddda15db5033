"""``persia-launcher slurm``: one batch script for a whole job (``--submit`` hands it to
``sbatch``).

The script asks for a heterogeneous job: component 0 on ``--ps-partition`` (the parameter
servers: memory), component 1 on ``--worker-partition`` (the NN workers, one node each,
with the embedding workers and data loaders beside them: GPUs). Its only command is
``persia-launcher slurm-run`` with the same flags: on the allocation's first node it runs
the job under persia_py's own supervisor (:func:`persia_py.launcher.job_run.run_job`),
each role as a job step (``srun`` pinned to its node), so a role that dies is restarted
alone by the job itself, as under ``local`` (:mod:`persia_py.launcher.slurm_run`).
``#SBATCH --requeue``: a requeued job runs the script again, which resumes from the newest
checkpoint. The run folder (``--run-dir``) must be on a file system every node mounts at
the same path: it holds the job token (mode 0600), the roles' logs and the Slurm output.
With ``--spare-nodes N`` component 0 has N more nodes and the script asks for
``--no-kill``: a parameter server whose node is lost moves to a spare
(:mod:`persia_py.launcher.slurm_spares`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

from persia_py.launcher.job_model import Job

__all__ = ["PORT_OFFSETS", "SlurmJob", "add_slurm_flags", "render_script", "run_slurm"]

PORT_OFFSETS = {"ps": 0, "embedding-worker": 100, "data-loader": 200, "rendezvous": 300}
"""Each role kind's ports from ``--port-base``: replica i of a kind listens on base +
offset + i on its node."""


@dataclass(frozen=True)
class SlurmJob:
    """A job as ``persia-launcher slurm`` renders it (its flags: docs/cli.md)."""

    job: Job
    job_name: str
    run_dir: str
    """On a file system every node mounts at the same path."""
    ps_partition: str | None = None
    ps_nodes: int = 1
    worker_partition: str | None = None
    time_limit: str | None = None
    port_base: int = 23000
    gpus_per_node: int = 0
    spare_nodes: int = 0
    """Nodes of component 0 that run no role at first: a parameter server whose node is
    lost is started on one (:mod:`persia_py.launcher.slurm_spares`)."""
    flags: tuple[str, ...] = ()
    """The job's flags, as ``slurm-run`` takes them again inside the allocation."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.run_dir):
            raise SystemExit(f"--run-dir {self.run_dir!r}: an absolute path, on a file system "
                             "every node mounts at the same path")
        if self.ps_nodes < 1:
            raise SystemExit(f"--ps-nodes must be >= 1; got {self.ps_nodes}")
        if self.spare_nodes < 0:
            raise SystemExit(f"--spare-nodes must be >= 0; got {self.spare_nodes}")
        if not 1024 <= self.port_base <= 65535 - 400:
            raise SystemExit(f"--port-base {self.port_base}: between 1024 and {65535 - 400}")


def _component(partition: str | None, nodes: int, gpus: int = 0) -> list[str]:
    options = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if partition:
        options.insert(0, f"--partition={partition}")
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    return [f"#SBATCH {o}" for o in options]


LAUNCHER = (sys.executable, "-m", "persia_py.launcher.cli")
"""``persia-launcher`` as the batch script starts it: this interpreter, at this path on
every node (a virtual environment on the shared file system)."""


def render_script(spec: SlurmJob) -> str:
    """The batch script."""
    out = os.path.join(spec.run_dir, "slurm-%j.out")
    lines = ["#!/bin/bash",
             f"# {spec.job_name}: rendered by persia-launcher slurm; submit with sbatch",
             f"#SBATCH --job-name={spec.job_name}", f"#SBATCH --output={out}",
             "#SBATCH --open-mode=append", "#SBATCH --requeue"]
    if spec.time_limit:
        lines.append(f"#SBATCH --time={spec.time_limit}")
    if spec.spare_nodes:
        # A lost node leaves the allocation, not the job: its parameter servers move to
        # a spare (without spares Slurm ends the job and requeues it).
        lines.append("#SBATCH --no-kill")
    lines += _component(spec.ps_partition, spec.ps_nodes + spec.spare_nodes)
    lines.append("#SBATCH hetjob")
    lines += _component(spec.worker_partition, spec.job.nn_nodes, spec.gpus_per_node)
    run = [*LAUNCHER, "slurm-run", *spec.flags]
    lines += ["set -euo pipefail",
              "# The job's supervisor, on this first node: each role is a job step.",
              "exec " + shlex.join(run), ""]
    return "\n".join(lines)


def run_slurm(spec: SlurmJob, output: str, submit: bool) -> int:
    """Write the batch script to ``output`` (``-``: stdout); with ``submit``, hand it to
    ``sbatch`` and print the job id."""
    text = render_script(spec)
    os.makedirs(spec.run_dir, mode=0o700, exist_ok=True)
    if output == "-" and not submit:
        sys.stdout.write(text)
        return 0
    path = output if output != "-" else os.path.join(spec.run_dir, f"{spec.job_name}.sbatch")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)
    if not submit:
        return 0
    done = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return done.returncode
    print(done.stdout.strip().split(";")[0])
    return 0


def add_slurm_flags(p: argparse.ArgumentParser, *, render: bool) -> None:
    """Slurm's own flags of ``slurm`` (``render``: and the script's own) and of
    ``slurm-run``, beside the job's and the supervisor's
    (:mod:`persia_py.launcher.job_flags`)."""
    p.add_argument("--job-name", required=True, help="name of the Slurm job")
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="the job's folder, on a file system every node mounts at the same "
                        "path: job token (mode 0600), roles' logs, Slurm's output")
    p.add_argument("--ps-nodes", type=int, default=1,
                   help="nodes of the parameter servers (component 0), round robin")
    p.add_argument("--spare-nodes", type=int, default=0,
                   help="more nodes of the parameter servers' component, idle at first "
                        "(the job's supervisor runs on the first): a parameter server whose "
                        "node is lost starts on one, from its checkpoint and update log, and "
                        "the other roles find it there (default: 0; a lost node ends the "
                        "job, which Slurm requeues)")
    p.add_argument("--ps-partition", default=None,
                   help="partition of the parameter servers (default: Slurm's default)")
    p.add_argument("--worker-partition", default=None,
                   help="partition of the NN workers (component 1), embedding workers and "
                        "data loaders")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per NN-worker node")
    p.add_argument("--time", default=None, dest="time_limit",
                   help="the job's time limit (sbatch --time)")
    p.add_argument("--port-base", type=int, default=23000,
                   help="first port of the roles on each node (parameter servers from it, "
                        "embedding workers +100, data loaders +200, the rendezvous +300)")
    if render:
        p.add_argument("--submit", action="store_true", help="submit the script with sbatch")
        p.add_argument("-o", "--output", default="-",
                       help="file to write (default: stdout; with --submit, "
                            "RUN_DIR/<job>.sbatch)")
