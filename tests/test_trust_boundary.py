"""The trust boundary, tried as an attacker would: black-box, through gRPC and the launcher,
against server processes started the way users start them.

What each item of the issue is tested by:

- Checkpoint paths and names: a planted link named like a checkpoint file, ``..``, ``.``,
  absolute, nested, over-long or non-ASCII names, NUL, a checkpoint or folder that is a link,
  and serving replicas' Dump and Load are refused; the rows' checksum and row count stay as
  they were and no file outside the checkpoint root is created or changed
  (``test_a_name_that_is_not_a_plain_name_is_refused``,
  ``test_dump_replaces_a_planted_link_never_its_target``,
  ``test_a_checkpoint_or_folder_that_is_a_link_is_refused``,
  ``test_a_serving_replica_offers_no_checkpoint_calls``).
- All-or-nothing Load: a Load that fails at any step (files named outside the folder, links,
  bad arrays, other settings, ...) leaves the rows, the settings and the exactly-once window
  untouched (``test_a_load_failing_at_any_step_changes_nothing``).
- Exports and applies of increments retried without losing rows: in ``tests/test_serving.py``
  (``test_failed_exports_and_applies_are_retried_and_lose_no_row``).
- Update identity (exactly-once): an empty update never pre-marks a sequence and bad worker
  ids are refused, workers draw random 128-bit ids, an update answered duplicate on its first
  sending is an error, and a restarted embedding worker (PID 1 again, as in a container) has
  its updates applied (``test_an_empty_update_never_marks_a_sequence_as_seen``,
  ``test_two_workers_never_share_an_update_identity``,
  ``test_an_update_answered_duplicate_on_first_sending_is_an_error``,
  ``test_a_restarted_embedding_worker_has_its_updates_applied``).
- Hash flooding: ids colliding under the public hashes used before keying are stored and
  served right (``test_flood_of_old_hash_collisions_is_stored_and_served_right``; the cost is
  measured by ``python -m benchmarks.hash_flood``).
- Memory before any check: lz4 bombs, claims no payload backs, many sub-messages, large
  control calls and unauthenticated bodies are refused before memory is taken for them
  (``test_bombs_and_unauthenticated_bodies_cost_the_server_little_memory`` reads the
  server's peak memory).
- Secure defaults: a role started by hand needs a job token or an explicit ``--insecure``;
  ``persia-launcher local`` makes a token per run that only its roles (and whoever can read
  its 0600 file) have and that no process's argv shows (``tests/test_secure_defaults.py``);
  the k8s manifest's token Secret, TLS and NetworkPolicy are in ``tests/test_k8s.py``.

Tests that start processes carry the ``processes`` marker; ``-m "not processes"`` runs the
others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import grpc
import lz4.block
import numpy as np
import pytest
import yaml
from conftest import (
    RoleProcess,
    env_without_token,
    launcher_command,
    processes_with_marker,
    start_server,
    token_channel,
)

from persia_py.checkpoint import layout as fmt
from persia_py.config import CommonConfig, GlobalConfig, embedding_config_from_dict
from persia_py.ids.hashing import HASH_STACK_SALT, inverse_mix64
from persia_py.ops import safe_files
from persia_py.proto import checkpoint_pb2 as ckpt_pb
from persia_py.proto import checkpoint_pb2_grpc, common_pb2, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.servers.initializer import initial_rows
from persia_py.wire import codec
from persia_py.wire.security import ENV_AUTH_TOKEN
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient, UpdateNotApplied, configure_request

processes = pytest.mark.processes

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _refused(call: Callable, request, code: grpc.StatusCode = INVALID) -> str:
    """``call(request)`` fails with ``code``; returns the details."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


# --- The servers attacked ---------------------------------------------------------------------
# `cluster`: a training parameter server with a checkpoint root, two tables and adagrad, with
# the session's job token (checkpoint, Load and empty-update tests; each compares the rows
# before and after its own attacks). `sgd_ps`: a parameter server with one table and SGD, its
# own token file and LIMIT as its message limit (update identity, hash flood and memory tests;
# each checks only rows it wrote itself, or compares with what it read first).

COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
DIMS = {"user": 4, "item": 8}
IDS = np.arange(1, 201, dtype=np.uint64)
WORKER = "embedding-worker-0-" + "ab" * 16
ADAGRAD_CONFIGURE = configure_request({"type": "adagrad", "lr": 0.1}, init_lower=-0.1,
                                      init_upper=0.1, weight_bound=None, seed=5)


class Cluster:
    """One training parameter server (a real process) and clients of its services."""

    def __init__(self, base: Path) -> None:
        self.base, self.root, self.outside = base, base / "root", base / "outside"
        self.root.mkdir()
        self.outside.mkdir()
        (self.outside / "victim.txt").write_text("precious\n")
        (base / "embedding_config.yml").write_text(
            "slots_config:\n" + "".join(f"  {s}:\n    dim: {d}\n" for s, d in DIMS.items()))
        self.proc, port = start_server(
            "embedding-parameter-server", "--checkpoint-root", str(self.root),
            "--embedding-config", str(base / "embedding_config.yml"))
        self.address = f"127.0.0.1:{port}"
        self.client = PSClient(self.address, COMMON)
        self.channel = token_channel(self.address)
        self.ckpt = checkpoint_pb2_grpc.ParameterServerCheckpointStub(self.channel)
        self.ps = parameter_server_pb2_grpc.ParameterServerStub(self.channel)
        self.sequence = 0
        self.client.configure(ADAGRAD_CONFIGURE)
        self.train()

    def train(self) -> None:
        """One training step over every id (the rows change)."""
        slots = [(s, IDS) for s in DIMS]
        self.client.lookup(slots, training=True)
        self.sequence += 1
        self.client.update([(s, IDS, np.full((IDS.size, d), 0.5, np.float32))
                            for s, d in DIMS.items()], worker_id=WORKER, sequence=self.sequence)

    def checksum(self) -> tuple[dict[str, int], str]:
        """Row counts per table and a hash of every row (read without inserting)."""
        entries = {t.table: t.entries for t in self.client.stats().tables}
        rows = self.client.lookup([(s, IDS) for s in DIMS], training=False)
        return entries, hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()

    def outside_files(self) -> dict[str, tuple[int, int, str]]:
        """Every file under the test's folder but outside the root: (size, mtime, hash)."""
        out = {}
        for folder, _, files in os.walk(self.base):
            if Path(folder).is_relative_to(self.root):
                continue
            for name in files:
                path = Path(folder) / name
                st = path.lstat()
                out[str(path)] = (st.st_size, st.st_mtime_ns,
                                  hashlib.sha256(path.read_bytes()).hexdigest())
        return out

    def dump_checkpoint(self, name: str) -> Path:
        """A complete checkpoint ``ROOT/name`` of the server's rows (as a job writes one)."""
        folder = self.root / name
        folder.mkdir()
        self.ckpt.Dump(ckpt_pb.DumpRequest(checkpoint=name), timeout=30)
        safe_files.save_json(folder / fmt.MANIFEST, {"format": fmt.FORMAT, "version": fmt.VERSION,
                                              "step": 1, "num_ps_replicas": 1})
        return folder

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("trust"))
    try:
        yield c
    finally:
        c.close()


LIMIT = 16 * 1024 * 1024
"""max_message_bytes of `sgd_ps`."""
LR = 0.5
DIM = 4
INIT_LOWER, INIT_UPPER, SGD_SEED = -0.1, 0.1, 3
KNOWN_IDS = np.arange(1, 65, dtype=np.uint64)
SGD_CONFIGURE = configure_request({"type": "sgd", "lr": LR}, init_lower=INIT_LOWER,
                                  init_upper=INIT_UPPER, weight_bound=None, seed=SGD_SEED)


class SgdServer(NamedTuple):
    proc: RoleProcess
    address: str
    trusted: CommonConfig
    """A client config with the server's token file and limits."""
    root: Path
    """The folder of its configs and token file."""
    env: dict[str, str]
    """The environment it was started with (no job token in it)."""


@pytest.fixture(scope="module")
def sgd_ps(tmp_path_factory):
    """A parameter server that requires a token (from its own file, not the session's), with
    LIMIT as its message limit, SGD, and the known ids stored."""
    root = tmp_path_factory.mktemp("wire")
    token = secrets.token_hex(32)
    (root / "token").write_text(token)
    (root / "token").chmod(0o600)
    (root / "embedding_config.yml").write_text(f"slots_config:\n  user:\n    dim: {DIM}\n")
    common = dict(max_message_bytes=LIMIT, rpc_timeout_sec=20, startup_timeout_sec=60,
                  auth_token_file=str(root / "token"))
    (root / "global_config.yml").write_text(yaml.safe_dump({"common_config": common}))
    env = env_without_token()
    proc, port = start_server("embedding-parameter-server", *_config_args(root), env=env)
    try:
        trusted = CommonConfig(**common)
        client = PSClient(f"127.0.0.1:{port}", trusted)
        client.configure(SGD_CONFIGURE)
        client.lookup([("user", KNOWN_IDS)], training=True)
        client.close()
        yield SgdServer(proc, f"127.0.0.1:{port}", trusted, root, env)
    finally:
        proc.stop()


def _config_args(root: Path) -> list[str]:
    return ["--embedding-config", str(root / "embedding_config.yml"),
            "--global-config", str(root / "global_config.yml")]


def _stored(address: str, common: CommonConfig) -> tuple[int, int, str]:
    """(rows stored, updates applied, sha256 of the known ids' rows), inserting nothing."""
    client = PSClient(address, common)
    try:
        stats = client.stats()
        rows = client.lookup([("user", KNOWN_IDS)], training=False)[0]
        return (sum(t.entries for t in stats.tables), stats.num_updates,
                hashlib.sha256(rows.tobytes()).hexdigest())
    finally:
        client.close()


# --- Checkpoint paths and names ---------------------------------------------------------------

@processes
@pytest.mark.parametrize("folder,checkpoint,field", [
    ("", "..", "checkpoint"), ("", ".", "checkpoint"), ("", "", "checkpoint"),
    ("", "/etc", "checkpoint"), ("", "../outside", "checkpoint"), ("", "a/b", "checkpoint"),
    ("", "x\x00y", "checkpoint"), ("", "x" * 300, "checkpoint"), ("", "x" * 5000, "checkpoint"),
    ("", ".hidden", "checkpoint"), ("", "caf\u00e9", "checkpoint"), ("..", "x", "folder"),
    ("/tmp", "x", "folder"), ("a\x00", "x", "folder"), ("y" * 4097, "x", "folder"),
])
def test_a_name_that_is_not_a_plain_name_is_refused(cluster, folder, checkpoint, field) -> None:
    before, files = cluster.checksum(), cluster.outside_files()
    for method, request in ((cluster.ckpt.Dump, ckpt_pb.DumpRequest),
                            (cluster.ckpt.Load, ckpt_pb.LoadRequest)):
        details = _refused(method, request(folder=folder, checkpoint=checkpoint))
        assert f"{field}:" in details, details
    assert cluster.checksum() == before
    assert cluster.outside_files() == files


@processes
def test_dump_replaces_a_planted_link_never_its_target(cluster) -> None:
    folder = cluster.root / "planted"
    folder.mkdir()
    victim = cluster.outside / "victim.txt"
    for name in ("ps-0.json", "ps-0-t0-ids.npy", "ps-0-seen0.npy"):
        (folder / name).symlink_to(victim)
    files = cluster.outside_files()
    cluster.ckpt.Dump(ckpt_pb.DumpRequest(checkpoint="planted"), timeout=30)
    assert cluster.outside_files() == files
    assert victim.read_text() == "precious\n"
    assert not (folder / "ps-0.json").is_symlink()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no leftovers


@processes
def test_a_checkpoint_or_folder_that_is_a_link_is_refused(cluster) -> None:
    (cluster.root / "to-outside").symlink_to(cluster.outside, target_is_directory=True)
    before, files = cluster.checksum(), cluster.outside_files()
    for request in (ckpt_pb.DumpRequest(checkpoint="to-outside"),
                    ckpt_pb.DumpRequest(folder="to-outside", checkpoint="x")):
        assert "is not a folder (a link" in _refused(cluster.ckpt.Dump, request)
    _refused(cluster.ckpt.Load, ckpt_pb.LoadRequest(checkpoint="to-outside"))
    assert cluster.outside_files() == files
    assert cluster.checksum() == before


@processes
def test_a_serving_replica_offers_no_checkpoint_calls(tmp_path: Path) -> None:
    (tmp_path / "embedding_config.yml").write_text("slots_config:\n  user:\n    dim: 4\n")
    proc, port = start_server("embedding-parameter-server", "--inference",
                              "--checkpoint-root", str(tmp_path),
                              "--embedding-config", str(tmp_path / "embedding_config.yml"))
    channel = token_channel(f"127.0.0.1:{port}")
    try:
        stub = checkpoint_pb2_grpc.ParameterServerCheckpointStub(channel)
        _refused(stub.Dump, ckpt_pb.DumpRequest(checkpoint="x"), grpc.StatusCode.UNIMPLEMENTED)
        _refused(stub.Load, ckpt_pb.LoadRequest(checkpoint="x"), grpc.StatusCode.UNIMPLEMENTED)
    finally:
        channel.close()
        proc.stop()


# --- All-or-nothing Load ----------------------------------------------------------------------

def _variant(cluster: Cluster, good: Path, name: str,
             change: Callable[[Path, dict], None]) -> str:
    """A copy of checkpoint ``good`` named ``name`` with ``change(folder, ps-0.json)``."""
    folder = cluster.root / name
    shutil.copytree(good, folder)
    entry = json.loads((folder / "ps-0.json").read_text())
    change(folder, entry)
    (folder / "ps-0.json").write_text(json.dumps(entry))
    return name


def _table(entry: dict, name: str = "user") -> dict:
    return entry["tables"][name]


def _rewrite(folder: Path, file: str, array: np.ndarray) -> None:
    (folder / file).unlink()
    np.save(folder / file, array, allow_pickle=False)


def _set_file(key: str, value: str) -> Callable[[Path, dict], None]:
    return lambda folder, entry: _table(entry)["files"].__setitem__(key, value)


def _duplicate_ids(folder: Path, entry: dict) -> None:
    file = _table(entry)["files"]["ids"]
    ids = np.load(folder / file)
    ids[1] = ids[0]
    _rewrite(folder, file, ids)


def _bad_dim(folder: Path, entry: dict) -> None:
    table = _table(entry)
    weights = np.load(folder / table["files"]["weights"])
    _rewrite(folder, table["files"]["weights"], np.zeros((weights.shape[0], 5), np.float32))
    table["dim"] = 5


def _array_change(key: str, value: float) -> Callable[[Path, dict], None]:
    def change(folder: Path, entry: dict) -> None:
        file = _table(entry)["files"][key]
        array = np.load(folder / file)
        array.flat[0] = value
        _rewrite(folder, file, array)
    return change


def _manifest_says_two_replicas(folder: Path, entry: dict) -> None:
    manifest = json.loads((folder / fmt.MANIFEST).read_text())
    (folder / fmt.MANIFEST).write_text(json.dumps({**manifest, "num_ps_replicas": 2}))


def _seen(worker_id: str, file: str) -> Callable[[Path, dict], None]:
    return lambda folder, entry: entry.__setitem__("seen", [[worker_id, file]])


FAILING_LOADS = {
    "escaping-file": _set_file("ids", "../outside/victim.txt"),
    "absolute-file": _set_file("weights", "/etc/passwd"),
    "nested-file": _set_file("state", "sub/ids.npy"),
    "linked-file": lambda folder, entry: (
        (folder / "link.npy").symlink_to(folder.parent.parent / "outside" / "victim.txt"),
        _table(entry)["files"].__setitem__("ids", "link.npy")),
    "missing-file": lambda folder, entry: (folder / _table(entry)["files"]["state"]).unlink(),
    "duplicate-ids": _duplicate_ids,
    "bad-dim": _bad_dim,
    "negative-last-access": _array_change("last_access", -1),
    "last-access-past-clock": _array_change("last_access", 2**62),
    "nan-weight": _array_change("weights", np.nan),
    "wrong-dtype": lambda folder, entry: _rewrite(
        folder, _table(entry)["files"]["ids"],
        np.load(folder / _table(entry)["files"]["ids"]).astype(np.int64)),
    "replica-count": _manifest_says_two_replicas,
    "bad-worker-id": _seen("../../etc/x y", "ps-0-seen0.npy"),
    "escaping-seen-file": _seen(WORKER, "../outside/victim.txt"),
    "unknown-table": lambda folder, entry: entry["tables"].__setitem__(
        "nope", _table(entry)),
    "other-settings": lambda folder, entry: entry["settings"]["optimizer"].__setitem__("lr", 9.0),
}


@processes
def test_a_load_failing_at_any_step_changes_nothing(cluster) -> None:
    good = cluster.dump_checkpoint("good")
    assert "complete" in _refused(cluster.ckpt.Dump, ckpt_pb.DumpRequest(checkpoint="good"),
                                  grpc.StatusCode.FAILED_PRECONDITION)
    names = [_variant(cluster, good, f"bad-{kind}", change)
             for kind, change in FAILING_LOADS.items()]
    cluster.train()  # the live rows differ from the checkpoint's now
    before, files = cluster.checksum(), cluster.outside_files()
    for name in names:
        code = (grpc.StatusCode.FAILED_PRECONDITION if name == "bad-other-settings"
                else INVALID)
        details = _refused(cluster.ckpt.Load, ckpt_pb.LoadRequest(checkpoint=name), code)
        assert details, name
        assert cluster.checksum() == before, name
    assert cluster.outside_files() == files
    # The exactly-once window is the live one still: the last update is a duplicate.
    answer = cluster.ps.Update(ps_pb.UpdateRequest(
        worker_id=WORKER, sequence=cluster.sequence, tables=[ps_pb.TableGradients(
            table="user", ids=codec.encode(IDS[:1]), grads=codec.encode(np.ones((1, 4), np.float32)))]),
        timeout=30)
    assert answer.duplicate
    # The unchanged checkpoint loads: the rows go back to what it holds.
    cluster.ckpt.Load(ckpt_pb.LoadRequest(checkpoint="good"), timeout=30)
    assert cluster.checksum() != before


# --- Update identity (exactly-once) -----------------------------------------------------------

@processes
def test_an_empty_update_never_marks_a_sequence_as_seen(cluster) -> None:
    before = cluster.checksum()
    worker, sequence = "embedding-worker-1-" + "cd" * 16, 7
    empty_slot = ps_pb.TableGradients(table="user", ids=codec.encode(np.zeros(0, np.uint64)),
                                     grads=codec.encode(np.zeros((0, 4), np.float32)))
    for request in (ps_pb.UpdateRequest(worker_id=worker, sequence=sequence),
                    ps_pb.UpdateRequest(worker_id=worker, sequence=sequence, tables=[empty_slot])):
        assert "tables" in _refused(cluster.ps.Update, request)
    assert cluster.checksum() == before
    for bad in ("", "w" * 129, "a/b", "x\x00", "-x", "\u00e9"):
        if bad:
            request = ps_pb.UpdateRequest(worker_id=bad, sequence=1, tables=[
                ps_pb.TableGradients(table="user", ids=codec.encode(IDS[:1]),
                                    grads=codec.encode(np.ones((1, 4), np.float32)))])
            assert "worker_id" in _refused(cluster.ps.Update, request)
    assert cluster.checksum() == before
    # The pair was never taken: the real update with it is applied.
    answer = cluster.ps.Update(ps_pb.UpdateRequest(
        worker_id=worker, sequence=sequence, tables=[ps_pb.TableGradients(
            table="user", ids=codec.encode(IDS[:1]), grads=codec.encode(np.ones((1, 4), np.float32)))]),
        timeout=30)
    assert not answer.duplicate and answer.num_updated == 1
    assert cluster.checksum() != before


def test_two_workers_never_share_an_update_identity() -> None:
    emb = embedding_config_from_dict({"slots_config": {"user": {"dim": DIM}}})
    ids = {EmbeddingWorker(GlobalConfig(), emb, [], index=0).worker_id for _ in range(8)}
    assert len(ids) == 8
    for worker_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", worker_id), worker_id
        assert len(worker_id.rsplit("-", 1)[1]) == 32  # 128 random bits


def _one_batch(worker: EmbeddingWorker, ids: np.ndarray) -> tuple[int, np.ndarray]:
    """A looked-up training batch of distinct ``ids``: its ref and the rows it read."""
    ref = worker.put_batch([SlotIds("user", ids, np.ones(ids.size, np.int32))], ids.size, True)
    (slot,) = worker.lookup(ref)
    return ref, slot.rows.astype(np.float32)


@processes
def test_an_update_answered_duplicate_on_first_sending_is_an_error(sgd_ps) -> None:
    """Two workers forced to share an id (what a reused PID did): the second one's update
    is refused as not applied, naming the replica, and applied when sent again."""
    _, address, trusted, _, _ = sgd_ps
    emb = embedding_config_from_dict({"slots_config": {"user": {"dim": DIM}}})
    first, second = (EmbeddingWorker(GlobalConfig(common_config=trusted), emb,
                                     [PSClient(address, trusted)]) for _ in range(2))
    try:
        second.worker_id = first.worker_id
        ids = np.array([1, 2, 3], np.uint64)
        ones = np.ones((3, DIM), np.float32)
        ref, rows = _one_batch(first, ids)
        assert first.update_gradients(ref, {"user": ones}) == 3
        ref, _ = _one_batch(second, ids)
        with pytest.raises(UpdateNotApplied, match=re.escape(address)):
            second.update_gradients(ref, {"user": ones})
        assert second.update_gradients(ref, {"user": ones}) == 3  # a new sequence: applied
        final = second.lookup_direct([SlotIds("user", ids, np.ones(3, np.int32))], 3)[0].rows
        np.testing.assert_allclose(final, rows - 2 * LR, rtol=1e-6)  # two steps, not three
    finally:
        first.close()
        second.close()


def _pid_namespace_command() -> list[str]:
    """A prefix that runs a command as PID 1 of a new PID namespace, as in a container."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) not installed")
    command = [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("user and PID namespaces are not available here")
    return command


def _ns_pid(marker: str) -> int:
    """The PID, inside its namespace, of the embedding worker marked ``marker``."""
    for pid in processes_with_marker(marker):
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        if "persia_py.launcher.cli" in open(f"/proc/{pid}/cmdline").read():
            ns_pids = fields["NSpid"].split()
            if len(ns_pids) > 1:
                return int(ns_pids[-1])
    raise AssertionError("embedding worker process not found")


@processes
def test_a_restarted_embedding_worker_has_its_updates_applied(sgd_ps) -> None:
    _, address, trusted, root, env = sgd_ps
    prefix = _pid_namespace_command()
    env = dict(env, **{ENV_AUTH_TOKEN: (root / "token").read_text()})
    ids = np.array([101, 102, 103], np.uint64)
    rows_seen = []
    for _attempt in range(2):
        worker = RoleProcess([*prefix, *launcher_command(
            "embedding-worker", "--port", "0", *_config_args(root), "--ps-addrs", address)],
            env=env)
        try:
            port = int(worker.wait_for_line(r"on port (\d+) ready", timeout=120).group(1))
            assert _ns_pid(worker.marker) == 1  # the same PID both times
            client = EmbeddingWorkerClient(f"127.0.0.1:{port}", trusted)
            _, num_updates, _ = _stored(address, trusted)
            ref = client.put_batch([("user", ids, np.ones(3, np.int32))], 3, True)
            (slot,) = client.lookup(ref)
            rows_seen.append(slot.rows)
            assert client.update_gradients(ref, [("user", np.ones_like(slot.rows))]) == 3
            assert _stored(address, trusted)[1] == num_updates + 1
            client.close()
        finally:
            os.killpg(worker.process.pid, signal.SIGKILL)  # a crash, not a clean stop
            worker.process.wait(timeout=30)
            worker.stop()
    # The second worker saw the first one's step applied, and its own step was applied too.
    np.testing.assert_allclose(rows_seen[1], rows_seen[0] - LR, rtol=1e-6)
    client = PSClient(address, trusted)
    final = client.lookup([("user", ids)], training=False)[0]
    client.close()
    np.testing.assert_allclose(final, rows_seen[0] - 2 * LR, rtol=1e-6)


# --- Hash flooding ----------------------------------------------------------------------------

def _colliding(count: int, salt: int, first: int = 1) -> np.ndarray:
    """Ids whose public ``mix64(id, salt)`` share their low 20 bits (one home slot)."""
    hashed = np.arange(first, first + count, dtype=np.uint64) << np.uint64(20)
    return inverse_mix64(hashed, salt)


def _initial(ids: np.ndarray) -> np.ndarray:
    """The rows `sgd_ps` creates for ``ids``."""
    return initial_rows(ids, DIM, INIT_LOWER, INIT_UPPER, SGD_SEED)


@processes
def test_flood_of_old_hash_collisions_is_stored_and_served_right(sgd_ps) -> None:
    """Ids crafted to collide under the public hashes the server used before keying are
    stored and served right (the other tests on `sgd_ps` store ids far from these)."""
    server = PSClient(sgd_ps.address, dataclasses.replace(sgd_ps.trusted, rpc_timeout_sec=120))
    try:
        (table,) = server.stats().tables
        stored_before = table.entries
        index_flood = _colliding(40_000, HASH_STACK_SALT)  # the old index hash
        dedup_flood = _colliding(20_000, 0)  # the old dedup hash (plain splitmix64)
        honest = np.random.default_rng(0).integers(1, 2**63, 2000, dtype=np.uint64)
        for ids in (index_flood, np.repeat(dedup_flood, 2), honest):
            np.testing.assert_array_equal(server.lookup([("user", ids)], training=True)[0],
                                          _initial(ids))
        # Everything is stored once and reads back the same, flooded ids and honest ones
        # alike; ids never inserted still read as zeros.
        everything = np.concatenate([honest, index_flood[::-1], dedup_flood])
        np.testing.assert_array_equal(server.lookup([("user", everything)], training=False)[0],
                                      _initial(everything))
        absent = _colliding(1000, HASH_STACK_SALT, first=50_000)
        assert not server.lookup([("user", absent)], training=False)[0].any()
        (table,) = server.stats().tables
        assert table.entries == stored_before + index_flood.size + dedup_flood.size + honest.size
        assert table.evicted == 0
    finally:
        server.close()


# --- Memory before any check ------------------------------------------------------------------

UPDATE_METHOD = f"/{ps_pb.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Update"
CONFIGURE_METHOD = UPDATE_METHOD.replace("/Update", "/Configure")


def _memory_mib(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmHWM", "VmRSS")}


def _peak_rise_mib(pid: int, fn) -> float:
    """How far the resident memory of process ``pid`` peaks above its current level while
    ``fn()`` runs. (Memory a call freed is kept for the next one, in the malloc arenas the server
    threads share (persia_py.ops.allocator), so each call is measured from where it starts.)"""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    idle = _memory_mib(pid)["VmRSS"]
    fn()
    return _memory_mib(pid)["VmHWM"] - idle


def _update_bytes(slot_tensors: list[tuple[common_pb2.Tensor, common_pb2.Tensor]]) -> bytes:
    return ps_pb.UpdateRequest(worker_id="attacker", sequence=1, tables=[
        ps_pb.TableGradients(table="user", ids=ids, grads=grads)
        for ids, grads in slot_tensors]).SerializeToString()


def _refused_cheaply(pid: int, method, request: bytes, metadata,
                     codes: tuple[grpc.StatusCode, ...], needle: str = "") -> None:
    """``method(request)`` fails with one of ``codes`` and ``needle`` in its details, while
    the server's memory (process ``pid``) peaks less than twice the limit above idle."""
    def refused() -> None:
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=60, metadata=metadata)
        assert info.value.code() in codes, info.value.details()
        assert needle in (info.value.details() or ""), info.value.details()

    rise = _peak_rise_mib(pid, refused)
    assert rise < 2 * LIMIT / 2**20, f"{needle or codes}: server memory rose by {rise:.0f} MiB"


@processes
def test_bombs_and_unauthenticated_bodies_cost_the_server_little_memory(sgd_ps) -> None:
    proc, address, trusted, root, _ = sgd_ps
    before = _stored(address, trusted)
    auth = [("authorization", "Bearer " + (root / "token").read_text())]
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    update = channel.unary_unary(UPDATE_METHOD)
    configure = channel.unary_unary(CONFIGURE_METHOD)
    ids = codec.encode(KNOWN_IDS[:1])
    pid = proc.process.pid

    # Without the token: neither a body just under the limit nor one far over it is read.
    near_limit = _update_bytes([(ids, codec.encode(np.zeros((LIMIT // 17, DIM), np.float32)))])
    assert 0.9 * LIMIT < len(near_limit) < LIMIT
    for body in (near_limit, near_limit * 4):
        for metadata in ((), [("authorization", "Bearer " + "x" * 64)]):
            _refused_cheaply(pid, update, body, metadata,
                             (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED))
    # With the token, sizes a request claims are checked before anything is allocated.
    # A real lz4 bomb: 256 KiB that decompress to 64 MiB of gradients.
    rows = 4 * LIMIT // (4 * DIM)
    bomb = lz4.block.compress(bytes(4 * LIMIT), store_size=False)
    _refused_cheaply(pid, update, _update_bytes([(ids, common_pb2.Tensor(
        dtype="float32", shape=[rows, DIM], data=bomb, lz4=True))]),
        auth, (INVALID,), "tables[0].grads: lz4 payload claims")
    # A claim no payload backs: 255x of half the limit; believed, it would be allocated
    # before decompression failed.
    junk = secrets.token_bytes(LIMIT // 2)
    claimed = 255 * len(junk) // (4 * DIM)
    _refused_cheaply(pid, update, _update_bytes([(ids, common_pb2.Tensor(
        dtype="float32", shape=[claimed, DIM], data=junk, lz4=True))]),
        auth, (INVALID,), "max_message_bytes")
    # Many small claims that add up.
    small = common_pb2.Tensor(dtype="float32", shape=[LIMIT // (16 * DIM), DIM],
                              data=lz4.block.compress(bytes(LIMIT // 4), store_size=False),
                              lz4=True)
    _refused_cheaply(pid, update, _update_bytes([(ids, small)] * 8), auth, (INVALID,),
                     "larger than max")
    # Empty entries: two bytes each on the wire, hundreds of bytes each once parsed.
    _refused_cheaply(pid, update, b"\x0a\x00" * (LIMIT // 4), auth, (INVALID,), "sub-messages")
    # A call that carries no arrays has the small limit.
    big_json = common_pb2.ConfigureRequest(optimizer_json=" " * (2 << 20)).SerializeToString()
    _refused_cheaply(pid, configure, big_json, auth, (INVALID,), "max_control_message_bytes")
    channel.close()
    assert _stored(address, trusted) == before  # still serving; nothing changed
