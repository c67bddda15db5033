"""Every role kind SIGKILLed during one ``persia-launcher local`` job (2 parameter servers,
2 embedding workers, 2 data loaders, 2 NN ranks, a periodic checkpoint), on a seeded
schedule: the job heals itself and exits 0, every batch the loaders made is trained
exactly once between the last checkpoint restore and the end (by batch id), and the test
AUC is that of the same job without faults (within 0.005)."""

from __future__ import annotations

import os
import random
import re
import signal
import textwrap
from pathlib import Path

import pytest
from conftest import EXAMPLE, ROOT, RoleProcess, launcher_command, processes_with_marker

from persia_py import checkpoint_format as fmt
from persia_py.checkpoint import data_positions
from persia_py.data_position import DataPositions, batch_id

pytestmark = pytest.mark.processes

JOB = ROOT / "tests" / "chaos_job"
TRAIN_SAMPLES = 96_000  # 375 batches of 256, ~190 steps per rank
SEED = 2026
KINDS = ("parameter server", "embedding worker", "data loader", "NN worker")


def _argv_env(pid: int) -> tuple[list[str], dict[str, str]]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.partition("=")[::2] for item in
                   f.read().decode(errors="replace").split("\0") if "=" in item)
    return argv, env


def _victim(marker: str, kind: str, index: int) -> tuple[int, str]:
    """(pid, launcher role name) of the process that *is* replica ``index`` of ``kind``
    (for loaders and NN ranks the user's script, not the wrapper that started it)."""
    found = []
    for pid in processes_with_marker(marker):
        try:
            argv, env = _argv_env(pid)
        except OSError:
            continue
        wrapper = "persia_py.launcher.cli" in argv or "torch.distributed.run" in argv
        if kind == "parameter server" and "embedding-parameter-server" in argv and \
                argv[argv.index("--replica-index") + 1] == str(index):
            found.append((pid, f"ps-{index}"))
        elif kind == "embedding worker" and "embedding-worker" in argv and \
                argv[argv.index("--replica-index") + 1] == str(index):
            found.append((pid, f"embedding-worker-{index}"))
        elif kind == "data loader" and not wrapper and any(
                a.endswith("chaos_job/data_loader.py") for a in argv) and \
                env.get("PERSIA_DATA_LOADER_REPLICA_INDEX") == str(index):
            found.append((pid, f"data-loader-{index}"))
        elif kind == "NN worker" and not wrapper and any(
                a.endswith("chaos_job/train.py") for a in argv) and env.get("RANK") == str(index):
            found.append((pid, "nn-worker"))
    assert len(found) == 1, (kind, index, found)
    return found[0]


def _job(tmp_path: Path, name: str) -> RoleProcess:
    folder = tmp_path / name
    folder.mkdir()
    global_config = folder / "global_config.yml"
    global_config.write_text((EXAMPLE / "global_config.yml").read_text() + textwrap.dedent(f"""
        checkpoint_config:
          root: {folder}
          dir: {folder / "ckpt"}
          every_steps: 20
    """))
    return RoleProcess(launcher_command(
        "local", "--nn-worker", str(JOB / "train.py"), "--data-loader", str(JOB / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(global_config), "--num-ps", "2", "--num-embedding-workers", "2",
        "--num-data-loaders", "2", "--nproc-per-node", "2", "--no-metrics",
        "--run-dir", str(folder / "run"),
        "--data-loader-args", f"--train-samples {TRAIN_SAMPLES}"))


def _finish(job: RoleProcess) -> str:
    try:
        code = job.wait(timeout=900)
    finally:
        job.stop()
    out = "".join(job.lines)
    assert code == 0, out[-30000:]
    return out


def _auc(out: str) -> float:
    found = re.findall(r"test_auc: ([\d.]+)", out)
    assert len(found) == 1, out[-20000:]
    return float(found[0])


def test_every_role_killed_at_random_the_job_heals_and_trains_each_batch_once(
        tmp_path: Path) -> None:
    rng = random.Random(SEED)
    job = _job(tmp_path, "chaos")
    killed, steps = [], 0  # rank 0's steps in this run of the training
    restored = DataPositions()  # what the last restore holds as trained
    try:
        for kind in rng.sample(KINDS, len(KINDS)):
            # A random moment: some steps after the start or the last restart.
            steps += rng.choice([30, 40, 50, 60])
            job.wait_for_line(rf"rank 0 trained step {steps}\b", timeout=600)
            pid, name = _victim(job.marker, kind, rng.randrange(2))
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
            restart = job.wait_for_line(
                rf"\[launcher\] {name} died \((signal SIGKILL|code \d+)\); restarting "
                r"(the training from checkpoint (\S+):)?", timeout=60)
            if kind != "parameter server":  # the training restarted from its checkpoint
                steps = 0
                # Read now: two checkpoints later the launcher may have pruned it.
                restored = DataPositions()
                if restart.group(3):
                    manifest = fmt.load_json(fmt.resolve(restart.group(3)) / fmt.MANIFEST)
                    restored = DataPositions.from_json(data_positions(manifest))
    except BaseException:
        job.stop()
        raise
    out = _finish(job)
    print("killed:", killed)

    # The training restarts: each logged, the last one's checkpoint is where it resumed.
    restarts = re.findall(r"\[launcher\] (\S+) died \(.*?\); restarting the training "
                          r"(from checkpoint (\S+)|from the start)", out)
    assert len(restarts) == 3, out[-30000:]  # the embedding worker, loader and NN worker
    assert re.search(r"ps-\d died \(signal SIGKILL\); restarting it on the same port", out)
    assert re.search(r"restarts of the training: .*\(3 in all\)", out), out[-5000:]
    last = out.rindex("restarting the training")
    done = restored

    # Every batch the loaders made: trained before the restore xor after it, once.
    made = {int(i): int(n) for i, n in re.findall(r"loader (\d) made (\d+) batches", out[last:])}
    assert set(made) == {0, 1}, out[-20000:]
    everything = {batch_id(loader, seq) for loader, n in made.items() for seq in range(n)}
    before = {b for b in everything if done.of(b >> 40).done(b & ((1 << 40) - 1))}
    after = []
    for rank in (0, 1):
        found = re.findall(rf"rank {rank} trained batch ids ([\d,]*)", out[last:])
        assert len(found) == 1, out[-20000:]
        after += [int(i) for i in found[0].split(",") if i]
    assert len(after) == len(set(after)), "a batch was trained twice after the restore"
    assert not before & set(after), "a batch in the checkpoint was trained again"
    assert before | set(after) == everything

    clean = _finish(_job(tmp_path, "clean"))
    print(f"test AUC: with faults {_auc(out):.5f}, without {_auc(clean):.5f}")
    assert _auc(clean) > 0.70
    assert abs(_auc(out) - _auc(clean)) <= 0.005
