"""Lookup answers and gradients through shared memory between an NN worker and its
embedding worker on one host (persia_py/wire/shm.py): the segments' checks, the path
used and equal to the messages' path, bad descriptors refused while the server keeps
serving, and restarted processes working again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
from checkout import EXAMPLE
from child_processes import RoleProcess, launcher_command, start_server

from persia_py.config import CommonConfig
from persia_py.proto import common_pb2, embedding_worker_pb2, embedding_worker_pb2_grpc
from persia_py.wire import shm
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import configure_request

EMBEDDING_CONFIG = """
slots_config:
  user:
    dim: 8
  tags:
    dim: 8
    embedding_summation: false
    sample_fixed_size: 3
"""
COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
MESSAGES = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60, shared_memory=False)


def _our_segments() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("persia-shm-")}


# -- the segments themselves ---------------------------------------------------------


def test_a_segment_opens_only_with_its_nonce_and_is_unlinked_once_mapped() -> None:
    made = shm.Segment.create(4096)
    try:
        assert os.stat(os.path.join(shm.SHM_DIR, made.descriptor.name)).st_mode & 0o777 == 0o600
        wrong = shm.Descriptor(made.descriptor.name, "0" * 32, 4096)
        with pytest.raises(shm.ShmUnavailable, match="lacks the caller's nonce"):
            shm.Segment.open(wrong, 1 << 20)
        assert not made.name_gone()  # a refused open leaves it
        opened = shm.Segment.open(made.descriptor, 1 << 20)
        assert made.name_gone()  # both sides have it mapped: its name is gone
        opened.array(shm.HEADER_BYTES, "int64", (4,))[:] = [1, 2, 3, 4]
        assert made.array(shm.HEADER_BYTES, "int64", (4,)).tolist() == [1, 2, 3, 4]
        with pytest.raises(shm.ShmUnavailable, match="not on this host"):
            shm.Segment.open(made.descriptor, 1 << 20)  # a restarted peer
    finally:
        made.unlink()


@pytest.mark.parametrize("descriptor, message", [
    (shm.Descriptor("../etc/passwd", "0" * 32, 4096), "is not persia-shm-"),
    (shm.Descriptor("persia-shm-1-" + "a" * 31 + "/", "0" * 32, 4096), "is not persia-shm-"),
    (shm.Descriptor("persia-shm-" + "a" * 32, "0" * 32, 4096), "is not persia-shm-"),
    (shm.Descriptor("persia-shm-1-" + "a" * 32, "xyz", 4096), "nonce is not 32 hex"),
    (shm.Descriptor("persia-shm-1-" + "a" * 32, "0" * 32, 2**40), "max_message_bytes"),
    (shm.Descriptor("persia-shm-1-" + "a" * 32, "0" * 32, 8), "outside"),
])
def test_malformed_descriptors_are_refused_before_anything_is_opened(descriptor,
                                                                    message) -> None:
    with pytest.raises(shm.ShmError, match=message):
        shm.Segment.open(descriptor, 1 << 20)


def test_a_size_or_mode_other_than_described_is_refused() -> None:
    made = shm.Segment.create(4096)
    try:
        bigger = shm.Descriptor(made.descriptor.name, made.descriptor.nonce, 8192)
        with pytest.raises(shm.ShmError, match="has 4096 bytes, not 8192"):
            shm.Segment.open(bigger, 1 << 20)
        os.chmod(os.path.join(shm.SHM_DIR, made.descriptor.name), 0o644)
        with pytest.raises(shm.ShmError, match="not this user's alone"):
            shm.Segment.open(made.descriptor, 1 << 20)
    finally:
        made.unlink()


def test_offsets_are_checked_against_the_mapping() -> None:
    made = shm.Segment.create(4096)
    try:
        for offset, num_bytes in [(0, 8), (4090, 8), (shm.HEADER_BYTES, 2**62), (2**63, 1)]:
            with pytest.raises(shm.ShmError, match="outside its data"):
                made.at(offset, num_bytes)
        tensor = common_pb2.Tensor(dtype="float32", shape=[2000])
        with pytest.raises(shm.ShmError, match="outside its data"):
            made.tensor_data(tensor, shm.HEADER_BYTES)
        assert made.at(shm.HEADER_BYTES, 8).readonly
    finally:
        made.unlink()


def test_a_pool_turns_itself_off_when_the_peer_is_elsewhere() -> None:
    pool = shm.SegmentPool(1 << 20, max_segments=2)
    first = pool.acquire(1000)
    assert first is not None and first.size >= 1000
    pool.refused(first, "not on this host")  # its name is still there: the peer is elsewhere
    assert not pool.enabled and pool.acquire() is None
    assert first.name_gone()  # the maker unlinks what was never mapped
    pool = shm.SegmentPool(1 << 20, max_segments=2)
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None and pool.acquire() is None  # at most 2 lent
    pool.give_back(a)
    assert pool.acquire() is a  # lent again once given back
    pool.close()
    assert a.name_gone() and b.name_gone()


def test_a_segment_given_back_later_is_lent_again_unless_discarded_meanwhile() -> None:
    """What a finalizer returns (no lock taken) comes back at the next acquire; a
    segment whose call failed in between stays retired."""
    pool = shm.SegmentPool(1 << 20, max_segments=3)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert a is not None and b is not None and c is not None
    pool.give_back_later(a, lend_again=True)
    pool.give_back_later(b, lend_again=False)  # an attempt given up may write into it
    pool.discard(c)
    pool.give_back_later(c, lend_again=True)  # too late: discarded
    assert pool.acquire() is a
    assert b.name_gone() and c.name_gone()
    fresh = pool.acquire()
    assert fresh is not None and fresh not in (b, c)
    pool.close()


@pytest.mark.processes
def test_segments_of_makers_that_ended_are_removed_once_old() -> None:
    """A maker killed between making a segment and its peer mapping it leaves the name
    behind: the next pool made on the host removes it (its maker gone, old enough)."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead_pid = int(ended.stdout)
    orphan = os.path.join(shm.SHM_DIR, f"persia-shm-{dead_pid}-{'e' * 32}")
    os.close(os.open(orphan, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    ours = shm.Segment.create(4096)  # this process runs: kept however old
    try:
        young = shm.remove_orphans()
        assert os.path.basename(orphan) not in young and os.path.exists(orphan)
        later = os.stat(orphan).st_mtime + 61
        assert os.path.basename(orphan) in shm.remove_orphans(now=later)
        assert not os.path.exists(orphan) and not ours.name_gone()
    finally:
        ours.unlink()
        if os.path.exists(orphan):
            os.unlink(orphan)


def test_a_pool_retires_every_segment_its_peer_lost() -> None:
    """A restarted peer knows none of the segments it had mapped: the first refusal
    retires them all, so that the next calls make new ones instead of each being refused."""
    pool = shm.SegmentPool(1 << 20, max_segments=4)
    segments = [pool.acquire() for _ in range(3)]
    for s in segments:
        assert s is not None
        shm.Segment.open(s.descriptor, 1 << 20)  # the peer maps it (and unlinks the name)
        s.used = True
        pool.give_back(s)
    first = pool.acquire()
    pool.refused(first, "not on this host")
    assert pool.enabled
    fresh = pool.acquire()
    assert fresh not in segments and not fresh.name_gone()
    assert {d.name for d in pool.take_forget()} == {s.descriptor.name for s in segments}
    pool.close()


def test_the_cache_drops_segments_idle_too_long_and_beyond_its_bounds() -> None:
    made = [shm.Segment.create(4096) for _ in range(3)]
    try:
        now = [0.0]
        idle = shm.SegmentCache(1 << 20, max_idle_sec=60.0, clock=lambda: now[0])
        idle.get(made[0].descriptor)
        now[0] = 61.0
        # Opening another finds the first idle: a dead NN worker's would go this way.
        idle.get(made[1].descriptor)
        assert len(idle) == 1
        with pytest.raises(shm.ShmUnavailable, match="not on this host"):
            idle.get(made[0].descriptor)  # dropped; its name was unlinked when mapped
        bounded = shm.SegmentCache(1 << 20, max_segments=1)
        bounded.get(made[2].descriptor)
        with pytest.raises(shm.ShmUnavailable):  # mapped by the cache above: unlinked
            bounded.get(made[1].descriptor)
        assert len(bounded) == 1
        bounded.forget([shm.Descriptor(made[2].descriptor.name, "0" * 32, 4096)])
        assert len(bounded) == 1  # a forget needs the nonce
        bounded.forget([made[2].descriptor])
        assert len(bounded) == 0
    finally:
        for m in made:
            m.unlink()


# -- a real embedding worker ---------------------------------------------------------


pytest_processes = pytest.mark.processes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A parameter server and an embedding worker, configured with SGD; a client that
    uses shared memory and one that does not."""
    root = tmp_path_factory.mktemp("shm")
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    procs = []
    try:
        ps, ps_port = start_server("embedding-parameter-server", *config)
        procs.append(ps)
        ew_args = [*config, "--ps-addrs", f"127.0.0.1:{ps_port}"]
        ew, ew_port = start_server("embedding-worker", *ew_args)
        procs.append(ew)
        address = f"127.0.0.1:{ew_port}"
        clients = EmbeddingWorkerClient(address, COMMON), EmbeddingWorkerClient(address, MESSAGES)
        clients[0].configure(configure_request({"type": "sgd", "lr": 0.5}, init_lower=-0.1,
                                               init_upper=0.1, weight_bound=None, seed=7))
        yield clients, procs, ew_args
        for c in clients:
            c.close()
    finally:
        for proc in procs:
            proc.stop()


def _features(rng: np.random.Generator, batch: int = 64):
    user = rng.integers(1, 500, batch).astype(np.uint64)
    lengths = rng.integers(0, 4, batch).astype(np.int32)
    tags = rng.integers(1, 500, int(lengths.sum())).astype(np.uint64)
    return [("user", user, np.ones(batch, np.int32)), ("tags", tags, lengths)], batch


def _grads(rows: np.ndarray) -> np.ndarray:
    """Gradients exact in float16 too."""
    return (np.arange(rows.size, dtype=np.float32).reshape(rows.shape) % 7 - 3) / 8


def _train_step(client: EmbeddingWorkerClient, features, batch: int):
    ref = client.put_batch(features, batch, True)
    slots = client.lookup(ref)
    grads = [(s.slot, _grads(s.rows)) for s in slots]
    assert client.update_gradients(ref, grads) == sum(s.rows.shape[0] for s in slots)
    return slots


@pytest_processes
@pytest.mark.parametrize("fp16", [False, True])
def test_answers_and_gradients_go_through_shared_memory_with_the_same_values(cluster,
                                                                            fp16) -> None:
    (configured, _), _, _ = cluster
    shared, messages = (EmbeddingWorkerClient(configured.address, CommonConfig(
        rpc_timeout_sec=30, embedding_fp16=fp16, shared_memory=on)) for on in (True, False))
    features, batch = _features(np.random.default_rng(1))
    # The same batch looked up through each path (a lookup changes nothing) ...
    via_shm = shared.lookup(shared.put_batch(features, batch, False))
    via_messages = messages.lookup(messages.put_batch(features, batch, False))
    for a, b in zip(via_shm, via_messages):
        for field in ("rows", "index", "lengths"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            assert getattr(a, field).dtype == getattr(b, field).dtype
    # ... and gradients sent through each: each applied once, as sent.
    once = _train_step(shared, features, batch)
    twice = _train_step(messages, features, batch)
    after = messages.lookup(messages.put_batch(features, batch, False))
    for a, b, c in zip(once, twice, after):
        np.testing.assert_allclose(b.rows, a.rows - 0.5 * _grads(a.rows), atol=2e-3 if fp16 else 1e-6)
        np.testing.assert_allclose(c.rows, b.rows - 0.5 * _grads(b.rows), atol=2e-3 if fp16 else 1e-6)
    assert shared.num_shm_lookups == 2 and shared.num_shm_updates == 1
    assert messages.num_shm_lookups == messages.num_shm_updates == 0
    free = _free(shared)
    shared.close()
    messages.close()
    assert all(s.name_gone() for s in free)


def _free(client: EmbeddingWorkerClient) -> list[shm.Segment]:
    return [*client.segments.answers._free, *client.segments.sends._free]


@pytest_processes
def test_bad_descriptors_are_refused_with_a_clear_error_and_the_server_keeps_serving(
        cluster) -> None:
    (shared, _), _, _ = cluster
    stub = embedding_worker_pb2_grpc.EmbeddingWorkerStub(shared.channel)
    features, batch = _features(np.random.default_rng(2), 4)
    ref = shared.put_batch(features, batch, True)
    slots = shared.lookup(ref)

    def refused(request_field, descriptor, needle, method="Lookup"):
        if method == "Lookup":
            request = embedding_worker_pb2.LookupBatchRequest(ref=ref)
        else:
            request = embedding_worker_pb2.UpdateGradientsRequest(ref=ref)
        getattr(request, request_field).CopyFrom(descriptor)
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert needle in info.value.details(), info.value.details()

    seg = common_pb2.ShmSegment
    refused("answer_segment", seg(name="/etc/passwd", nonce="0" * 32, size=4096),
            "is not persia-shm-")
    refused("answer_segment", seg(name="persia-shm-1-" + "0" * 32, nonce="0" * 32,
                                  size=2**40), "max_message_bytes")
    refused("grads_segment", seg(name="../x", nonce="0" * 32, size=4096), "is not persia-shm-",
            method="UpdateGradients")
    # A real segment, gradients said to lie past its end.
    made = shm.Segment.create(4096)
    try:
        request = embedding_worker_pb2.UpdateGradientsRequest(
            ref=ref, grads_segment=seg(name=made.descriptor.name, nonce=made.descriptor.nonce,
                                       size=made.size))
        for s in slots:
            request.slots.add(slot=s.slot, shm_offset=4000,
                              grads=common_pb2.Tensor(dtype="float32", shape=s.rows.shape))
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateGradients(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside its data" in info.value.details(), info.value.details()
        # The same segment under another nonce: not the caller's, refused.
        stale = embedding_worker_pb2.LookupBatchRequest(
            ref=ref, answer_segment=seg(name=made.descriptor.name, nonce="1" * 32,
                                        size=made.size))
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(stale, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "nonce or size differ" in info.value.details(), info.value.details()
    finally:
        made.unlink()
    # A segment that is not on this host: the answer comes in the message, saying why.
    elsewhere = stub.Lookup(embedding_worker_pb2.LookupBatchRequest(
        ref=ref, answer_segment=seg(name="persia-shm-1-" + "f" * 32, nonce="0" * 32,
                                    size=4096)), timeout=10)
    assert not elsewhere.shm.used and "not on this host" in elsewhere.shm.refused
    assert elsewhere.slots[0].rows.data
    # Nothing was applied by the refused calls; the batch takes its update once.
    grads = [(s.slot, np.ones_like(s.rows)) for s in slots]
    assert shared.update_gradients(ref, grads) == sum(s.rows.shape[0] for s in slots)
    again = shared.lookup(shared.put_batch(features, batch, False))
    for a, b in zip(slots, again):
        np.testing.assert_allclose(b.rows, a.rows - 0.5, rtol=1e-6)


@pytest_processes
def test_an_embedding_worker_that_cannot_map_gets_the_arrays_in_messages(cluster,
                                                                         tmp_path) -> None:
    """An embedding worker on another host finds no segment; one with shared memory off
    refuses it alike: the client falls back to messages for good, nothing lost or repeated."""
    (configured, _), procs, ew_args = cluster
    global_config = tmp_path / "global_config.yml"
    global_config.write_text("common_config:\n  shared_memory: false\n")
    elsewhere, port = start_server("embedding-worker", *ew_args,
                                   "--global-config", str(global_config))
    client = EmbeddingWorkerClient(f"127.0.0.1:{port}", COMMON)
    before = _our_segments()
    try:
        features, batch = _features(np.random.default_rng(4))
        first = _train_step(client, features, batch)
        second = _train_step(client, features, batch)  # sees the first update once
        for a, b in zip(first, second):
            np.testing.assert_allclose(b.rows, a.rows - 0.5 * _grads(a.rows), rtol=1e-6)
        assert client.num_shm_lookups == client.num_shm_updates == 0
        # The first lookup's refusal turned both directions off: no gradients were offered.
        assert not client.segments.answers.enabled and not client.segments.sends.enabled
        assert client.segments.sends.num_made == 0
        assert _our_segments() == before  # the maker unlinked what was never mapped
    finally:
        client.close()
        elsewhere.stop()


NN_WORKER_DIES = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from persia_py.config import CommonConfig
    from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
    client = EmbeddingWorkerClient(sys.argv[1], CommonConfig(rpc_timeout_sec=30))
    ids = np.arange(1, 65, dtype=np.uint64)
    one = np.ones(64, np.int32)
    ref = client.put_batch([("user", ids, one), ("tags", ids, one)], 64, True)
    client.lookup(ref)
    client.lookup(client.put_batch([("user", ids, one), ("tags", ids, one)], 64, True))
    assert client.num_shm_lookups >= 1, client.num_shm_lookups
    print("looked up through shared memory", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # holding its segments, its batches unfinished
""")


@pytest_processes
def test_killed_nn_worker_and_restarted_embedding_worker_work_again(cluster, tmp_path) -> None:
    (shared, _), procs, ew_args = cluster
    before = _our_segments()
    script = tmp_path / "dies.py"
    script.write_text(NN_WORKER_DIES)
    done = subprocess.run([sys.executable, str(script), shared.address], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "looked up through shared memory" in done.stdout
    assert _our_segments() == before  # its segments were unlinked once mapped
    features, batch = _features(np.random.default_rng(3))
    _train_step(shared, features, batch)  # the embedding worker goes on serving

    # The embedding worker dies and comes back on the same address, empty: the client's
    # segments are not known there; it makes new ones and goes on through them.
    ew = procs[1]
    port = shared.address.rsplit(":", 1)[1]
    os.kill(ew.process.pid, signal.SIGKILL)
    ew.process.wait(timeout=60)
    procs[1] = start_server("embedding-worker", *ew_args, port=port)[0]
    shared.configure(configure_request({"type": "sgd", "lr": 0.5}, init_lower=-0.1,
                                       init_upper=0.1, weight_bound=None, seed=7))
    lookups = shared.num_shm_lookups
    for _ in range(2):  # the first finds its segments gone, the second uses new ones
        _train_step(shared, features, batch)
    assert shared.segments.answers.enabled and shared.segments.sends.enabled
    assert shared.num_shm_lookups > lookups


@pytest_processes
def test_a_local_job_trains_the_same_through_shared_memory_and_through_messages(
        tmp_path: Path) -> None:
    """Reproducible mode, one rank: the same loss at every step either way, and the
    embedding worker says it used shared memory only when it is on."""
    # Both jobs at once (reproducible mode: the losses depend on no timing).
    paths, jobs = [], []
    try:
        for shared_memory in ("true", "false"):
            global_config = tmp_path / f"global_{shared_memory}.yml"
            global_config.write_text((EXAMPLE / "global_config.yml").read_text().replace(
                "  job_type: Train\n", f"  job_type: Train\n  shared_memory: {shared_memory}\n"))
            paths.append(tmp_path / f"losses_{shared_memory}.txt")
            jobs.append(RoleProcess(launcher_command(
                "local", "--nn-worker", str(EXAMPLE / "train.py"),
                "--data-loader", str(EXAMPLE / "data_loader.py"),
                "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
                "--global-config", str(global_config),
                "--run-dir", str(tmp_path / f"run_{shared_memory}"),
                "--data-loader-args", "--train-samples 4000",
                "--nn-worker-args", f"--reproducible --embedding-staleness 1 "
                                    f"--test-samples 1000 --loss-log {paths[-1]}",
            )))
        for job in jobs:
            assert job.wait(timeout=300) == 0, job.output()
    finally:
        for job in jobs:
            job.stop()
    logs = [log.read_text().split() for log in paths]
    outputs = [job.output() for job in jobs]
    assert len(logs[0]) == 4000 // 256 + 1
    assert logs[0] == logs[1]
    for flow in ("lookup answers go", "gradients come"):
        assert f"{flow} through shared memory" in outputs[0], outputs[0]
        assert f"{flow} through shared memory" not in outputs[1]
