"""The trust boundary's wire side, tried as an attacker would, against a parameter server
that requires its own token and caps its messages (``sgd_ps``): update identities
(exactly-once), hash flooding and the memory a request may cost before any check. The
checkpoint side and what the issue's items are tested by: tests/test_trust_boundary.py.

Tests that start processes carry the ``processes`` marker; ``-m "not processes"`` runs the
others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from typing import NamedTuple

import grpc
import lz4.block
import numpy as np
import pytest
import yaml
from child_processes import RoleProcess, launcher_command, processes_with_marker, start_server
from grpc_calls import env_without_token

from persia_py.config import CommonConfig, GlobalConfig, embedding_config_from_dict
from persia_py.ids.hashing import HASH_STACK_SALT, inverse_mix64
from persia_py.proto import common_pb2
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.servers.initializer import initial_rows
from persia_py.wire import codec
from persia_py.wire.security import ENV_AUTH_TOKEN
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient, UpdateNotApplied, configure_request

processes = pytest.mark.processes

INVALID = grpc.StatusCode.INVALID_ARGUMENT


# --- The server attacked --------------------------------------------------------------------

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


# --- Update identity (exactly-once) -----------------------------------------------------------

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
    def call() -> None:
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=60, metadata=metadata)
        assert info.value.code() in codes, info.value.details()
        assert needle in (info.value.details() or ""), info.value.details()

    rise = _peak_rise_mib(pid, call)
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
