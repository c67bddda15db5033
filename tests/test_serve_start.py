"""``persia-launcher serve`` started before the training job's first checkpoint: it says
so (a missing folder, a root with no checkpoint yet, and a torn checkpoint each get their
own message), and with ``--wait`` it serves the first checkpoint once it is complete, or
stops cleanly on SIGTERM while it waits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from child_processes import RoleProcess, launcher_command

from persia_py.checkpoint import layout as fmt
from persia_py.config import GlobalConfig, load_embedding_config
from persia_py.ops import safe_files
from persia_py.servers.checkpoint import dump_replica
from persia_py.servers.parameter_server import ParameterServer

EMBEDDING_CONFIG = "slots_config:\n  user:\n    dim: 4\n  item:\n    dim: 4\n"
MODEL = '''import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1 + 4 + 4, 1)

    def forward(self, non_id_tensors, embedding_tensors):
        return self.linear(torch.cat([non_id_tensors[0], *embedding_tensors], dim=1))
'''


@pytest.fixture
def job_files(tmp_path: Path) -> Path:
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    (tmp_path / "model.py").write_text(MODEL)
    return tmp_path


def _serve(folder: Path, checkpoint: Path, *flags: str) -> RoleProcess:
    return RoleProcess(launcher_command(
        "serve", "--checkpoint", str(checkpoint), *flags,
        "--embedding-config", str(folder / "embedding_config.yml"),
        "--model", f"{folder / 'model.py'}:Tiny"))


def _write_checkpoint(folder: Path, root: Path) -> tuple[ParameterServer, torch.nn.Module]:
    """A complete checkpoint in ``root`` as a training job writes it (the parameter
    server's rows, the dense model, the manifest last); returns what it holds."""
    ps = ParameterServer(GlobalConfig(), load_embedding_config(folder / "embedding_config.yml"))
    ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, init_lower=-1, init_upper=1)
    ids = np.arange(1, 11, dtype=np.uint64)
    ps.lookup([("user", ids), ("item", ids)], training=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(1 + 4 + 4, 1)
    tmp = fmt.new_tmp_dir(root)
    dump_replica(ps, tmp)
    fmt.save_tensors(tmp, "dense-model", {f"linear.{k}": v for k, v in model.state_dict().items()})
    fmt.commit(tmp, {"num_ps_replicas": 1, "rank_steps": [1]}, step=1)
    return ps, model


def test_resolve_tells_no_checkpoint_yet_from_a_torn_one(tmp_path: Path) -> None:
    with pytest.raises(fmt.NoCheckpointYet, match="does not exist"):
        fmt.resolve(tmp_path / "ckpt")
    root = tmp_path / "ckpt"
    fmt.new_tmp_dir(root)  # a first checkpoint being written
    (root / "inc").mkdir()  # and the incremental exports' folder
    with pytest.raises(fmt.NoCheckpointYet, match="holds no checkpoint yet"):
        fmt.resolve(root)
    assert fmt.latest(root) is None
    torn = root / "ckpt-000000000001-00000000"
    torn.mkdir()
    safe_files.save_json(torn / "ps-0.json", {})
    with pytest.raises(safe_files.CheckpointError, match="not a complete checkpoint") as err:
        fmt.resolve(torn)
    assert not isinstance(err.value, fmt.NoCheckpointYet)


@pytest.mark.processes
def test_serve_before_the_first_checkpoint_says_so_and_offers_wait(job_files: Path) -> None:
    for checkpoint in (job_files / "missing", job_files):  # no folder; a root, no checkpoint
        serve = _serve(job_files, checkpoint)
        try:
            assert serve.wait(timeout=120) != 0
        finally:
            serve.stop()
        output = serve.output()
        assert f"--checkpoint: {checkpoint} " in output, output
        assert "has not written its first checkpoint" in output, output
        assert "--wait" in output and "not a complete checkpoint" not in output, output
        assert "Traceback" not in output, output


@pytest.mark.processes
def test_serve_wait_serves_the_first_checkpoint_once_written(job_files: Path) -> None:
    root = job_files / "ckpt"
    serve = _serve(job_files, root, "--wait")
    try:
        serve.wait_for_line(r"waiting for the training job's first checkpoint", timeout=120)
        ps, model = _write_checkpoint(job_files, root)
        port = int(serve.wait_for_line(r"serve ready on port (\d+)", timeout=120).group(1))
        from persia_py.serving import ServingClient

        ids, dense = np.array([3, 7], np.uint64), np.array([[0.5], [-1.0]], np.float32)
        client = ServingClient(f"127.0.0.1:{port}")
        try:
            (got,) = client.predict([("user", ids, np.ones(2, np.int32)),
                                     ("item", ids, np.ones(2, np.int32))], [dense])
        finally:
            client.close()
        users, items = ps.lookup([("user", ids), ("item", ids)], training=False)
        with torch.no_grad():
            want = model(torch.from_numpy(np.concatenate([dense, users, items], axis=1)))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    finally:
        serve.stop()
    assert "Traceback" not in serve.output(), serve.output()


@pytest.mark.processes
def test_serve_wait_stops_cleanly_on_sigterm(job_files: Path) -> None:
    serve = _serve(job_files, job_files / "missing", "--wait")
    try:
        serve.wait_for_line(r"waiting for the training job's first checkpoint", timeout=120)
        serve.terminate()
        assert serve.wait(timeout=30) == 0, serve.output()
    finally:
        serve.stop()
    assert "stopped while waiting for the first checkpoint" in serve.output(), serve.output()
    assert "Traceback" not in serve.output(), serve.output()
