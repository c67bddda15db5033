"""A parameter server SIGKILLed mid-training is restarted by ``persia-launcher local`` from
the last checkpoint; the embedding worker waits and retries meanwhile, and every batch the
data loader sent is trained exactly once. The job here has a disk tier holding most rows:
the killed server's tier (an unnamed file) is gone with it, and the restarted one
rebuilds its RAM and disk rows from the checkpoint and its update log. (The same kill
without a disk tier is tests/test_chaos.py's: its random job kills a server and trains
every batch once, its reproducible job has one replay its update log and end
bit-identical; tests/test_online_failures.py kills an online job's server and trains
every sample once; the outage's waiting and its end are checked in this module's
``test_lookups_wait_...``.)"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from checkout import EXAMPLE, ROOT
from child_processes import RoleProcess, launcher_command, processes_with_marker
from grpc_calls import LogWaiter

from persia_py.checkpoint import layout as fmt
from persia_py.config import CommonConfig, EmbeddingTablesConfig, GlobalConfig, SlotConfig
from persia_py.servers.checkpoint import dump_replica, load_replica
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.service import create_ps_server
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.ps_client import PSClient, configure_request

JOB = ROOT / "tests" / "ps_failure_job"
NUM_BATCHES = 100
"""Batches the job trains: the kill comes at step 30, after the step-20 checkpoint, and the
70 after it are trained through the restart (the server's outage, its update log replayed,
its calls going on)."""


GLOBAL = GlobalConfig(common_config=CommonConfig(rpc_timeout_sec=20, startup_timeout_sec=20))
EMBEDDING = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4)})
CONFIGURE = configure_request({"type": "sgd", "lr": 1.0}, init_lower=-0.01, init_upper=0.01,
                              weight_bound=None, seed=3)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection lost after the server applied the update"


@pytest.fixture
def worker_and_ps():
    """An embedding worker (in this process) and the gRPC parameter server it talks to."""
    ps = ParameterServer(GLOBAL, EMBEDDING)
    server, port = create_ps_server(ps, "127.0.0.1:0")
    client = PSClient(f"127.0.0.1:{port}", GLOBAL.common_config)
    client.wait_ready()
    worker = EmbeddingWorker(GLOBAL, EMBEDDING, [client])
    worker.configure(CONFIGURE)
    state = {"ps": ps, "server": server, "port": port}
    try:
        yield worker, state
    finally:
        worker.close()
        state["server"].stop(grace=None).wait(10)
        state["ps"].close()


def _looked_up(worker: EmbeddingWorker, ids: list[int]) -> tuple[int, np.ndarray]:
    ref = worker.put_batch([SlotIds("user", np.array(ids, dtype=np.uint64),
                                    np.ones(len(ids), dtype=np.int32))], len(ids), True)
    worker.lookup(ref)
    return ref, np.ones((len(set(ids)), 4), dtype=np.float32)


def test_a_retried_gradient_update_is_applied_once(worker_and_ps) -> None:
    worker, state = worker_and_ps
    ps = state["ps"]
    ref, grads = _looked_up(worker, [5, 6, 7])
    client = worker.ps_clients[0]
    send = client.update

    def applied_then_lost(*args, **kwargs):
        send(*args, **kwargs)
        raise _Unavailable()

    client.update = applied_then_lost
    with pytest.raises(grpc.RpcError):
        worker.update_gradients(ref, {"user": grads})
    assert ps.num_updates == 1 and worker.num_pending == 1  # applied; the batch is kept
    client.update = send
    assert worker.update_gradients(ref, {"user": grads}) == 0  # same sequence: a duplicate
    assert worker.update_gradients(ref, {"user": grads}) == 0  # a finished ref: acknowledged
    assert ps.num_updates == 1 and worker.num_pending == 0
    rows = ps.lookup([("user", np.array([5], dtype=np.uint64))], training=False)[0]
    initial = ParameterServer(GLOBAL, EMBEDDING)
    initial.configure(optimizer={"type": "sgd", "lr": 1.0}, seed=3)
    want = initial.lookup([("user", np.array([5], dtype=np.uint64))], training=True)[0] - 1.0
    np.testing.assert_allclose(rows, want)  # one SGD step of lr 1 with gradient 1


def test_lookups_wait_for_a_parameter_server_restarted_empty_and_configure_it(
        worker_and_ps, caplog) -> None:
    worker, state = worker_and_ps
    ref, grads = _looked_up(worker, [1, 2])
    worker.update_gradients(ref, {"user": grads})
    state["server"].stop(grace=None).wait(10)
    state["ps"].close()
    waiter = LogWaiter(r"parameter server \S+ unavailable")
    logging.getLogger("persia_py.wire.rpc").addHandler(waiter)
    result: dict = {}

    def train_one() -> None:
        try:
            ref, grads = _looked_up(worker, [1, 3])
            result["updated"] = worker.update_gradients(ref, {"user": grads})
        except BaseException as exc:  # noqa: BLE001 - checked below
            result["error"] = exc

    try:
        with caplog.at_level(logging.INFO):
            thread = threading.Thread(target=train_one)
            thread.start()
            assert waiter.event.wait(timeout=15), "no line about the outage"
            state["ps"] = ParameterServer(GLOBAL, EMBEDDING)  # empty, unconfigured, same port
            state["server"], _ = create_ps_server(state["ps"], f"127.0.0.1:{state['port']}")
            thread.join(timeout=30)
    finally:
        logging.getLogger("persia_py.wire.rpc").removeHandler(waiter)
    assert not thread.is_alive() and result == {"updated": 2}, result
    assert state["ps"].configured and state["ps"].num_updates == 1
    assert "is not configured (restarted without a checkpoint?)" in caplog.text
    assert re.search(r"parameter server \S+ reachable again", caplog.text)


def test_the_exactly_once_window_is_in_the_checkpoint(tmp_path: Path) -> None:
    ps = ParameterServer(GLOBAL, EMBEDDING)
    ps.configure(optimizer={"type": "sgd", "lr": 1.0})
    ids = np.array([1, 2], dtype=np.uint64)
    ps.lookup([("user", ids)], training=True)
    assert ps.update([("user", ids, np.ones((2, 4), np.float32))], worker_id="w", sequence=7)[1] is False
    tmp = fmt.new_tmp_dir(tmp_path)
    dump_replica(ps, tmp)
    fmt.commit(tmp, {"num_ps_replicas": 1, "rank_steps": [1]}, step=1)
    restored = ParameterServer(GLOBAL, EMBEDDING)
    load_replica(restored, tmp_path)
    grads = np.ones((2, 4), np.float32)
    assert restored.update([("user", ids, grads)], worker_id="w", sequence=7) == (0, True)
    assert restored.update([("user", ids, grads)], worker_id="w", sequence=8)[1] is False


def _ps_pid(marker: str, replica: int) -> int:
    """The process of parameter-server ``replica`` of the job carrying ``marker``."""
    found = []
    for pid in processes_with_marker(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if ("embedding-parameter-server" in argv
                and argv[argv.index("--replica-index") + 1] == str(replica)):
            found.append(pid)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.processes
def test_a_killed_parameter_server_with_a_disk_tier_is_restarted_and_every_batch_is_trained_once(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    global_config = tmp_path / "global_config.yml"
    config = yaml.safe_load((EXAMPLE / "global_config.yml").read_text())
    config["checkpoint_config"] = {"root": str(tmp_path), "dir": str(ckpt), "every_steps": 20}
    tier = tmp_path / "tier"
    # ~950 distinct ids per slot per server, 128 in RAM: most rows live on disk.
    tier.mkdir()
    config["embedding_parameter_server_config"].update(
        capacity=128, disk_tier={"path": str(tier), "capacity_rows": 100_000})
    global_config.write_text(yaml.safe_dump(config))
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(JOB / "train.py"),
        "--data-loader", str(JOB / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(global_config), "--num-ps", "2", "--no-metrics",
        "--run-dir", str(tmp_path / "run"),
        "--data-loader-args", f"--batches {NUM_BATCHES}"))
    try:
        job.wait_for_line(r"trained step 30\b", timeout=120)  # a checkpoint (step 20) exists
        os.kill(_ps_pid(job.marker, 1), signal.SIGKILL)
        job.wait_for_line(r"ps-1 died \(signal SIGKILL\); restarting", timeout=30)
        code = job.wait(timeout=180)
    finally:
        job.stop()
    out = "".join(job.lines)
    assert code == 0, out[-20000:]
    sent = re.search(r"\[data-loader-0\] sent (\d+) batches", out)
    trained = re.search(r"\[nn-worker\] trained (\d+) batches, (\d+) distinct", out)
    assert sent and trained, out[-20000:]
    assert int(sent.group(1)) == NUM_BATCHES
    assert (int(trained.group(1)), int(trained.group(2))) == (NUM_BATCHES, NUM_BATCHES)
    # The outage was noticed and waited out, and the server came back from the checkpoint.
    assert re.search(r"parameter server \S+ unavailable .*retrying until the call's deadline",
                     out), out[-20000:]
    assert re.search(r"ps-1 died \(signal SIGKILL\); restarting it on the same port \(restart "
                     r"1 of 3, its update log applied again to the checkpoint it starts from; "
                     r"else from checkpoint \S+ckpt-", out), out[-20000:]
    # Nothing it applied is lost: the updates since its checkpoint are applied again.
    replayed = re.search(r"\[ps-1\] embedding-parameter-server 1: \d+ rows from checkpoint "
                         r"\S+ckpt-\S+ and (\d+) updates replayed from its update log"
                         r"(?: \((\d+) rows on its disk tier\))?", out)
    assert replayed and int(replayed[1]) > 0, out[-20000:]
    # The restarted server rebuilt its disk rows; no file of the tier is left.
    assert replayed[2] is not None and int(replayed[2]) > 1_000, out[-20000:]
    assert os.listdir(tier) == []
    assert re.search(r"parameter server \S+ reachable again", out), out[-20000:]
