"""How fast a ``persia-launcher local`` job heals: seconds from a kill until training
steps resume, per role kind, and the throughput of a job that loses one process of each
kind beside the same job without faults, measured in the same run.

    python -m benchmarks.recovery --json recovery.json            # ~5-minute jobs
    python -m benchmarks.recovery --train-samples 150000          # a quicker look
    python -m benchmarks.recovery --nn-restarts torchrun          # NN ranks as on Kubernetes
    python -m benchmarks.recovery --smoke                         # does it run? (tests)

The job is the synthetic Criteo example (2 parameter servers, 2 embedding workers, 2 data
loaders, 2 NN ranks, a checkpoint every ``--every-steps`` steps). The clean job runs
first; the faulty one SIGKILLs a parameter server, an embedding worker, a data loader and
an NN rank (in that order) at 15, 35, 55 and 75 % of the clean job's wall time, each once
the training has logged a step after the previous kill, the NN rank's once there is a
checkpoint to restart from too.

``--smoke``: one process of each role, a short job and no clean job (each kill as soon as
the training has stepped since the one before; no throughput ratio): it checks that the
benchmark runs, in about half a minute.

What is measured, from the training log rank 0 appends one line per step to (each line
timestamped when it appears):

* ``<role>_recovery_s``: for an NN rank, whose death restarts the training from its
  checkpoint, seconds from the kill until the first step of the restarted training (the
  first step logged after its ``resume`` record: steps go on from the checkpoint's; or
  step 1, where there was no checkpoint to resume); for
  a parameter server, an embedding worker or a data loader (restarted alone while the
  training goes on or waits for it), seconds from the kill until the step that ends the
  longest pause in steps within a minute after it.
* ``chaos_throughput_ratio``: samples/s of the faulty job over samples/s of the clean
  one, both over the whole job (launch to exit; the same samples are trained by both,
  each exactly once after the last restore). Work trained after the last checkpoint and
  lost with a process is what the ratio pays for, with the restarts themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import parse_args_with_smoke
from benchmarks.role_processes import role_pid
from persia_py.checkpoint import layout as checkpoint_layout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "criteo_synthetic"
KILLS = (("parameter server", "ps_recovery_s", 0.15),
         ("embedding worker", "embedding_worker_recovery_s", 0.35),
         ("data loader", "data_loader_recovery_s", 0.55),
         ("NN worker", "nn_worker_recovery_s", 0.75))
RESTARTED_ALONE = ("parameter server", "embedding worker", "data loader")
_PS_WINDOW_S = 60.0  # after a server's kill, where the training's pause is looked for


class StepLog:
    """Follows a training log as it grows: (arrival time, record) of each line, in the
    log's order. A line that is not JSON (a process killed while writing it) is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        offset, partial = 0, b""
        while not self._stop.wait(0.02):
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            offset += len(data)
            now = time.monotonic()
            *lines, partial = (partial + data).split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    self.records.append((now, json.loads(line)))

    def steps_after(self, t: float) -> list[tuple[float, int]]:
        return [(at, r["step"]) for at, r in list(self.records) if at > t and "loss" in r]

    def first_step_of_restart(self, t: float) -> float | None:
        """Arrival time of the first step a training restarted after ``t`` logged: the
        first step after a ``resume`` record (a restart from a checkpoint goes on from its
        step), or a step 1 (a restart without one); None while there is none."""
        resumed = False
        for at, record in list(self.records):
            if at <= t:
                continue
            if record.get("event") == "resume":
                resumed = True
            elif "loss" in record and (resumed or record["step"] == 1):
                return at
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Job:
    """One ``persia-launcher local`` run of the example, its output printed through."""

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        n = str(args.replicas)
        folder.mkdir(parents=True)
        self.folder = folder
        config = folder / "global_config.yml"
        config.write_text((EXAMPLE / "global_config.yml").read_text() + (
            f"\ncheckpoint_config:\n  root: {folder}\n  dir: {folder / 'ckpt'}\n"
            f"  every_steps: {args.every_steps}\n"))
        command = [sys.executable, "-m", "persia_py.launcher.cli", "local",
                   "--nn-worker", str(EXAMPLE / "train.py"),
                   "--data-loader", str(EXAMPLE / "data_loader.py"),
                   "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
                   "--global-config", str(config), "--num-ps", n,
                   "--num-embedding-workers", n, "--num-data-loaders", n,
                   "--nproc-per-node", n, "--run-dir", str(folder / "run"), "--no-metrics",
                   "--data-loader-args", f"--train-samples {args.train_samples}",
                   "--nn-worker-args", f"--test-samples {args.test_samples}",
                   "--nn-restarts", args.nn_restarts]
        self.last_rank = args.replicas - 1
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.log = StepLog(folder / "run" / "train_log.jsonl")

    def _read(self) -> None:
        with open(self.folder / "output.log", "w") as out:  # the whole output, for --work-dir
            for raw in self.process.stdout:
                line = raw.decode(errors="replace")
                self.lines.append((time.monotonic(), line))
                out.write(line)
                if line.startswith("[launcher]") or "test_auc" in line or "Error" in line:
                    sys.stdout.write(line)
                    sys.stdout.flush()

    def kill(self, kind: str) -> float:
        pid = role_pid(self.process.pid, kind, self.last_rank if kind == "NN worker" else 0,
                       loader_script="criteo_synthetic/data_loader.py",
                       train_script="criteo_synthetic/train.py")
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def wait_until(self, t: float) -> None:
        while time.monotonic() < t:
            if self.process.poll() is not None:
                raise SystemExit(f"the job ended early:\n{self.tail()}")
            time.sleep(0.05)

    def wait_for_step_after(self, t: float, timeout_s: float, checkpoint: bool = False) -> None:
        """Until the training has logged a step after ``t`` (a kill lands on a training
        job, not on one still starting or healing), and has written a checkpoint if
        ``checkpoint``."""
        deadline = time.monotonic() + timeout_s
        while not self.log.steps_after(t) or (
                checkpoint and checkpoint_layout.latest(self.folder / "ckpt") is None):
            if self.process.poll() is not None:
                raise SystemExit(f"the job ended before its next kill:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no training step within {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> float:
        """Waits for the job to exit 0; its wall seconds."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise SystemExit(f"the job did not end within {timeout_s:.0f} s:\n{self.tail()}") from None
        wall = time.monotonic() - self.started
        self._reader.join(timeout=10)
        self.log.close()
        if code != 0:
            raise SystemExit(f"the job exited {code}:\n{self.tail()}")
        return wall

    def tail(self) -> str:
        return "".join(line for _, line in self.lines[-60:])


def wait_for_restart(job: Job, killed_at: float, timeout_s: float) -> float:
    """Seconds from an NN rank's kill until the first step of the restarted training
    (:meth:`StepLog.first_step_of_restart`)."""
    deadline = killed_at + timeout_s
    while time.monotonic() < deadline and job.process.poll() is None:
        restarted = job.log.first_step_of_restart(killed_at)
        if restarted is not None:
            return restarted - killed_at
        time.sleep(0.1)
    raise SystemExit(f"the training did not restart after the NN rank was killed:\n{job.tail()}")


def longest_pause(job: Job, killed_at: float, next_kill: float) -> float:
    """For a role restarted alone: seconds from the kill until the step that ends the
    longest pause in steps within a minute after it, and before the next kill (whose
    pause is its own); read once the job is over."""
    steps = job.log.steps_after(killed_at)
    if not steps:
        raise SystemExit(f"no training steps after a kill:\n{job.tail()}")
    end = min(killed_at + _PS_WINDOW_S, next_kill)
    times = [killed_at] + [at for at, _ in steps if at <= end]
    if len(times) == 1:
        times.append(steps[0][0])
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    return max(gaps)[1] - killed_at


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-samples", type=int, default=900_000,
                        help="samples of each job (the default runs ~5 min on 2 cores)")
    parser.add_argument("--every-steps", type=int, default=20, help="checkpoint period")
    parser.add_argument("--replicas", type=int, default=2,
                        help="processes of each role: parameter servers, embedding workers, "
                             "data loaders, NN ranks")
    parser.add_argument("--test-samples", type=int, default=5000,
                        help="samples of the test AUC at the end of each job")
    parser.add_argument("--nn-restarts", choices=("launcher", "torchrun"), default="launcher",
                        help="who restarts the killed NN rank (persia-launcher local "
                             "--nn-restarts): the launcher rolls the training roles back, "
                             "torchrun's restarted ranks rewind them (as on Kubernetes)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--work-dir", default=None,
                        help="run the jobs in this (new) folder and keep it (default: a "
                             "temporary folder, removed)")
    # The smoke's checkpoint period: its first checkpoint (the NN rank's kill waits for
    # one) comes after ~20 steps, and the ~75 steps the restarted training trains pay for
    # 3 more, not 15.
    args = parse_args_with_smoke(parser, argv, train_samples=24_000, every_steps=20,
                                 replicas=1, test_samples=500)
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")

    with (contextlib.nullcontext(args.work_dir) if args.work_dir else
          tempfile.TemporaryDirectory(prefix="persia-recovery-")) as tmp:
        clean_wall = None
        if not args.smoke:
            clean = Job(Path(tmp) / "clean", args)
            clean_wall = clean.finish(timeout_s=3600)
            print(f"clean job: {clean_wall:.1f} s", flush=True)

        faulty = Job(Path(tmp) / "faulty", args)
        figures: dict[str, float | None] = {}
        kills = []
        for kind, key, fraction in KILLS:
            if clean_wall is not None:
                faulty.wait_until(faulty.started + fraction * clean_wall)
            faulty.wait_for_step_after(kills[-1][2] if kills else faulty.started,
                                       timeout_s=600, checkpoint=kind not in RESTARTED_ALONE)
            killed_at = faulty.kill(kind)
            kills.append((kind, key, killed_at))
            if kind not in RESTARTED_ALONE:  # the next kill only once training is back
                figures[key] = round(wait_for_restart(faulty, killed_at, timeout_s=600), 2)
        faulty_wall = faulty.finish(timeout_s=3600)
        for i, (kind, key, killed_at) in enumerate(kills):
            if kind in RESTARTED_ALONE:
                next_kill = kills[i + 1][2] if i + 1 < len(kills) else float("inf")
                figures[key] = round(longest_pause(faulty, killed_at, next_kill), 2)
            print(f"{kind} killed: steps resumed after {figures[key]:.2f} s", flush=True)
        figures = {key: figures[key] for _, key, _ in KILLS}

    figures.update({
        "chaos_wall_s": round(faulty_wall, 1), "train_samples": args.train_samples,
        "replicas": args.replicas, "nn_restarts": args.nn_restarts,
        "chaos_samples_per_s": round(args.train_samples / faulty_wall, 1),
        "median_recovery_s": round(statistics.median(figures[k] for _, k, _ in KILLS), 2),
        "clean_wall_s": None, "clean_samples_per_s": None, "chaos_throughput_ratio": None,
    })
    if clean_wall is not None:
        figures.update({
            "clean_wall_s": round(clean_wall, 1),
            "clean_samples_per_s": round(args.train_samples / clean_wall, 1),
            "chaos_throughput_ratio": round(clean_wall / faulty_wall, 3)})
    print(json.dumps(figures, indent=2))
    if clean_wall is not None:
        print(f"chaos_throughput_ratio: {figures['chaos_throughput_ratio']:.3f} "
              f"(faulty {faulty_wall:.1f} s vs clean {clean_wall:.1f} s; target >= 0.8)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
