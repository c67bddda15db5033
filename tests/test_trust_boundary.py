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
  ``test_a_restarted_embedding_worker_has_its_updates_applied``; the last two in
  ``tests/test_wire_bounds.py``).
- Hash flooding: ids colliding under the public hashes used before keying are stored and
  served right (``tests/test_wire_bounds.py``'s
  ``test_flood_of_old_hash_collisions_is_stored_and_served_right``; the cost is measured by
  ``python -m benchmarks.hash_flood``).
- Memory before any check: lz4 bombs, claims no payload backs, many sub-messages, large
  control calls and unauthenticated bodies are refused before memory is taken for them
  (``tests/test_wire_bounds.py``'s
  ``test_bombs_and_unauthenticated_bodies_cost_the_server_little_memory`` reads the
  server's peak memory).
- Secure defaults: a role started by hand needs a job token or an explicit ``--insecure``;
  ``persia-launcher local`` makes a token per run that only its roles (and whoever can read
  its 0600 file) have and that no process's argv shows (``tests/test_secure_defaults.py``);
  the k8s manifest's token Secret, TLS and NetworkPolicy are in ``tests/test_k8s.py``.

Tests that start processes carry the ``processes`` marker; ``-m "not processes"`` runs the
others.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from child_processes import start_server
from grpc_calls import refused, token_channel

from persia_py.checkpoint import layout as fmt
from persia_py.config import CommonConfig, GlobalConfig, embedding_config_from_dict
from persia_py.ops import safe_files
from persia_py.proto import checkpoint_pb2 as ckpt_pb
from persia_py.proto import checkpoint_pb2_grpc, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.wire import codec
from persia_py.workers.embedding_worker import EmbeddingWorker
from persia_py.workers.ps_client import PSClient, configure_request

processes = pytest.mark.processes

INVALID = grpc.StatusCode.INVALID_ARGUMENT


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


# --- Checkpoint paths and names ---------------------------------------------------------------

@processes
@pytest.mark.parametrize("folder,checkpoint,field", [
    ("", "..", "checkpoint"), ("", ".", "checkpoint"), ("", "", "checkpoint"),
    ("", "/etc", "checkpoint"), ("", "../outside", "checkpoint"), ("", "a/b", "checkpoint"),
    ("", "x\x00y", "checkpoint"), ("", "x" * 300, "checkpoint"), ("", "x" * 5000, "checkpoint"),
    ("", ".hidden", "checkpoint"), ("", "caf\u00e9", "checkpoint"), ("..", "x", "folder"),
    ("/tmp", "x", "folder"), ("a\x00", "x", "folder"), ("y" * 4097, "x", "folder"),
])
def test_a_name_that_is_not_a_plain_name_isrefused(cluster, folder, checkpoint, field) -> None:
    before, files = cluster.checksum(), cluster.outside_files()
    for method, request in ((cluster.ckpt.Dump, ckpt_pb.DumpRequest),
                            (cluster.ckpt.Load, ckpt_pb.LoadRequest)):
        details = refused(method, request(folder=folder, checkpoint=checkpoint))
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
def test_a_checkpoint_or_folder_that_is_a_link_isrefused(cluster) -> None:
    (cluster.root / "to-outside").symlink_to(cluster.outside, target_is_directory=True)
    before, files = cluster.checksum(), cluster.outside_files()
    for request in (ckpt_pb.DumpRequest(checkpoint="to-outside"),
                    ckpt_pb.DumpRequest(folder="to-outside", checkpoint="x")):
        assert "is not a folder (a link" in refused(cluster.ckpt.Dump, request)
    refused(cluster.ckpt.Load, ckpt_pb.LoadRequest(checkpoint="to-outside"))
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
        refused(stub.Dump, ckpt_pb.DumpRequest(checkpoint="x"), grpc.StatusCode.UNIMPLEMENTED)
        refused(stub.Load, ckpt_pb.LoadRequest(checkpoint="x"), grpc.StatusCode.UNIMPLEMENTED)
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
    assert "complete" in refused(cluster.ckpt.Dump, ckpt_pb.DumpRequest(checkpoint="good"),
                                  grpc.StatusCode.FAILED_PRECONDITION)
    names = [_variant(cluster, good, f"bad-{kind}", change)
             for kind, change in FAILING_LOADS.items()]
    cluster.train()  # the live rows differ from the checkpoint's now
    before, files = cluster.checksum(), cluster.outside_files()
    for name in names:
        code = (grpc.StatusCode.FAILED_PRECONDITION if name == "bad-other-settings"
                else INVALID)
        details = refused(cluster.ckpt.Load, ckpt_pb.LoadRequest(checkpoint=name), code)
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
        assert "tables" in refused(cluster.ps.Update, request)
    assert cluster.checksum() == before
    for bad in ("", "w" * 129, "a/b", "x\x00", "-x", "\u00e9"):
        if bad:
            request = ps_pb.UpdateRequest(worker_id=bad, sequence=1, tables=[
                ps_pb.TableGradients(table="user", ids=codec.encode(IDS[:1]),
                                    grads=codec.encode(np.ones((1, 4), np.float32)))])
            assert "worker_id" in refused(cluster.ps.Update, request)
    assert cluster.checksum() == before
    # The pair was never taken: the real update with it is applied.
    answer = cluster.ps.Update(ps_pb.UpdateRequest(
        worker_id=worker, sequence=sequence, tables=[ps_pb.TableGradients(
            table="user", ids=codec.encode(IDS[:1]), grads=codec.encode(np.ones((1, 4), np.float32)))]),
        timeout=30)
    assert not answer.duplicate and answer.num_updated == 1
    assert cluster.checksum() != before


def test_two_workers_never_share_an_update_identity() -> None:
    emb = embedding_config_from_dict({"slots_config": {"user": {"dim": DIMS["user"]}}})
    ids = {EmbeddingWorker(GlobalConfig(), emb, [], index=0).worker_id for _ in range(8)}
    assert len(ids) == 8
    for worker_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", worker_id), worker_id
        assert len(worker_id.rsplit("-", 1)[1]) == 32  # 128 random bits
