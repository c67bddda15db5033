"""Lookup answers and gradients through shared memory between an embedding worker and a
parameter server on one host (persia_py/wire/shm_calls.py): the same values as through
messages, bad descriptors refused while the server keeps serving, a server that cannot
map falling back to messages for good, and a killed embedding worker or parameter server
leaving no segment behind while the other side goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import grpc
import numpy as np
import pytest
from child_processes import start_server

from persia_py.config import CommonConfig, EmbeddingTablesConfig, GlobalConfig, SlotConfig
from persia_py.proto import common_pb2, parameter_server_pb2, parameter_server_pb2_grpc
from persia_py.wire import shm
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.ps_client import PSClient, UpdateNotApplied, configure_request

EMBEDDING_CONFIG = """
slots_config:
  user:
    dim: 8
  item:
    dim: 4
"""
CONFIGURE = configure_request({"type": "sgd", "lr": 0.5}, init_lower=-0.1, init_upper=0.1,
                              weight_bound=None, seed=7)
pytest_processes = pytest.mark.processes


def _segments_of(pid: int) -> set[str]:
    """The segments process ``pid`` made (other tests on the host make theirs)."""
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"persia-shm-{pid}-")}


def _client(port: int, *, fp16: bool = False, shared_memory: bool = True) -> PSClient:
    return PSClient(f"127.0.0.1:{port}", CommonConfig(
        rpc_timeout_sec=60, startup_timeout_sec=60, embedding_fp16=fp16,
        shared_memory=shared_memory))


@pytest.fixture(scope="module")
def ps(tmp_path_factory):
    """A configured parameter server; (process, port, its arguments)."""
    root = tmp_path_factory.mktemp("shm_ps")
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    args = ["--embedding-config", str(root / "embedding_config.yml")]
    proc, port = start_server("embedding-parameter-server", *args)
    state = {"proc": proc}
    try:
        client = _client(port)
        client.configure(CONFIGURE)
        client.close()
        yield state, port, args
    finally:
        state["proc"].stop()


def _tables(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("user", np.unique(rng.integers(1, 10**6, 300)).astype(np.uint64)),
            ("item", np.unique(rng.integers(1, 10**6, 50)).astype(np.uint64))]


def _grads(rows: np.ndarray) -> np.ndarray:
    """Gradients exact in float16 too."""
    return (np.arange(rows.size, dtype=np.float32).reshape(rows.shape) % 7 - 3) / 8


@pytest_processes
@pytest.mark.parametrize("fp16", [False, True])
def test_answers_and_gradients_go_through_shared_memory_with_the_same_values(ps, fp16) -> None:
    _, port, _ = ps
    shared, messages = _client(port, fp16=fp16), _client(port, fp16=fp16, shared_memory=False)
    tables = _tables(1 + fp16)
    try:
        first = shared.lookup(tables, training=True)  # inserts the rows
        for as_float32 in (True, False):
            via_shm = shared.lookup(tables, training=True, as_float32=as_float32)
            via_messages = messages.lookup(tables, training=True, as_float32=as_float32)
            for a, b, c in zip(via_shm, via_messages, first):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(a.astype(np.float32), c)
        # Views of the segment (read-only) hold it; once they are gone it is lent again.
        held = shared.lookup(tables, training=False, as_float32=False)
        assert not held[0].flags.writeable
        made = shared.segments.answers.num_made
        del held, via_shm
        shared.lookup(tables, training=False, as_float32=False)
        assert shared.segments.answers.num_made == made
        # Gradients through each path: each applied once, as sent.
        updates = [(t, ids, _grads(r)) for (t, ids), r in zip(tables, first)]
        assert shared.update(updates, worker_id=f"w-shm-{fp16}", sequence=1) == sum(
            ids.size for _, ids in tables)
        once = shared.lookup(tables, training=False)
        assert messages.update(updates, worker_id=f"w-msg-{fp16}", sequence=1) > 0
        twice = messages.lookup(tables, training=False)
        atol = 2e-3 if fp16 else 1e-6
        for a, b, c in zip(first, once, twice):
            np.testing.assert_allclose(b, a - 0.5 * _grads(a), atol=atol)
            np.testing.assert_allclose(c, b - 0.5 * _grads(a), atol=atol)
        assert shared.segments.num_answers == 6 and shared.segments.num_sends == 1
        assert messages.segments.num_answers == messages.segments.num_sends == 0
    finally:
        shared.close()
        messages.close()
    assert not _segments_of(os.getpid())  # mapped ones unlinked by the server, the rest by close


@pytest_processes
def test_bad_descriptors_are_refused_with_a_clear_error_and_the_server_keeps_serving(ps) -> None:
    _, port, _ = ps
    client = _client(port)
    stub = parameter_server_pb2_grpc.ParameterServerStub(client.channel)
    seg = common_pb2.ShmSegment
    ids = common_pb2.Tensor(dtype="uint64", shape=[2], data=np.array([3, 4], np.uint64).tobytes())

    def refused(request, needle: str) -> None:
        method = stub.Lookup if isinstance(request, parameter_server_pb2.LookupRequest) else stub.Update
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert needle in info.value.details(), info.value.details()

    def lookup(segment) -> parameter_server_pb2.LookupRequest:
        return parameter_server_pb2.LookupRequest(
            tables=[parameter_server_pb2.TableIds(table="user", ids=ids)], training=True,
            answer_segment=segment)

    def update(segment, offset: int) -> parameter_server_pb2.UpdateRequest:
        return parameter_server_pb2.UpdateRequest(
            worker_id="w-bad", sequence=1, grads_segment=segment,
            tables=[parameter_server_pb2.TableGradients(
                table="user", ids=ids, grads_offset=offset,
                grads=common_pb2.Tensor(dtype="float32", shape=[2, 8]))])

    try:
        refused(lookup(seg(name="/etc/passwd", nonce="0" * 32, size=4096)), "is not persia-shm-")
        refused(lookup(seg(name="persia-shm-1-" + "0" * 32, nonce="0" * 32, size=2**40)),
                "max_message_bytes")
        refused(update(seg(name="../x", nonce="0" * 32, size=4096), 64), "is not persia-shm-")
        made = shm.Segment.create(4096)
        try:
            mine = seg(name=made.descriptor.name, nonce=made.descriptor.nonce, size=made.size)
            refused(update(mine, 4090), "outside its data")  # gradients past its end
            other = seg(name=made.descriptor.name, nonce="1" * 32, size=made.size)
            refused(lookup(other), "nonce or size differ")
        finally:
            made.unlink()
        # Not on this host: the answer comes in the message, saying why ...
        elsewhere = stub.Lookup(lookup(seg(name="persia-shm-1-" + "f" * 32, nonce="0" * 32,
                                           size=4096)), timeout=30)
        assert not elsewhere.shm.used and "not on this host" in elsewhere.shm.refused
        assert len(elsewhere.embeddings[0].data) == 2 * 8 * 4
        # ... and an update is refused unapplied: its (worker, sequence) stays fresh.
        answer = stub.Update(update(seg(name="persia-shm-1-" + "f" * 32, nonce="0" * 32,
                                        size=4096), 64), timeout=30)
        assert not answer.shm.used and answer.num_updated == 0 and not answer.duplicate
        rows = client.lookup([("user", np.array([3, 4], np.uint64))], training=False)[0]
        grads = np.ones((2, 8), np.float32)
        assert client.update([("user", np.array([3, 4], np.uint64), grads)], worker_id="w-bad",
                             sequence=1) == 2
        after = client.lookup([("user", np.array([3, 4], np.uint64))], training=False)[0]
        np.testing.assert_allclose(after, rows - 0.5, rtol=1e-6)
    finally:
        client.close()


@pytest_processes
def test_a_parameter_server_that_cannot_map_gets_the_arrays_in_messages(ps, tmp_path) -> None:
    """Shared memory off on the server refuses a segment as another host would: the
    client goes back to messages for good, nothing lost or applied twice."""
    _, _, args = ps
    global_config = tmp_path / "global_config.yml"
    global_config.write_text("common_config:\n  shared_memory: false\n")
    elsewhere, port = start_server("embedding-parameter-server", *args,
                                   "--global-config", str(global_config))
    client = _client(port)
    try:
        client.configure(CONFIGURE)
        tables = _tables(3)
        first = client.lookup(tables, training=True)
        updates = [(t, ids, _grads(r)) for (t, ids), r in zip(tables, first)]
        assert client.update(updates, worker_id="w-off", sequence=1) > 0
        after = client.lookup(tables, training=False)
        for a, b in zip(first, after):
            np.testing.assert_allclose(b, a - 0.5 * _grads(a), atol=1e-6)
        assert client.segments.num_answers == client.segments.num_sends == 0
        assert not client.segments.answers.enabled and not client.segments.sends.enabled
        assert client.segments.sends.num_made == 0  # the lookup's refusal turned both off
        assert not _segments_of(os.getpid())  # the maker unlinked what was never mapped
    finally:
        client.close()
        elsewhere.stop()


class _AnswerLost(grpc.RpcError):
    """What a client sees when its server dies after applying a call, before answering."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Stream removed (Socket closed)"


@pytest_processes
def test_an_update_applied_before_its_server_moved_where_segments_are_refused_counts_once(
        ps, tmp_path) -> None:
    """The Slurm spare-node move: an update through shared memory is applied, its server
    dies before answering, and the call goes on at the replacement on another host, which
    replayed that update from its log and cannot map the segment. The message it then
    gets is answered ``duplicate``: a retry of an applied update, not a forged one."""
    _, port, args = ps
    global_config = tmp_path / "global_config.yml"
    global_config.write_text("common_config:\n  shared_memory: false\n")
    elsewhere, other_port = start_server("embedding-parameter-server", *args,
                                         "--global-config", str(global_config))
    client, replacement = _client(port), _client(other_port)
    try:
        replacement.configure(CONFIGURE)
        tables = _tables(5)
        first = client.lookup(tables, training=True)
        assert replacement.lookup(tables, training=True)[0].shape == first[0].shape
        updates = [(t, ids, _grads(r)) for (t, ids), r in zip(tables, first)]
        replacement.update(updates, worker_id="w-moved", sequence=1)  # its replayed log
        real, calls = client._update, []

        def moving(request, **kwargs):
            calls.append(request)
            if len(calls) == 1:
                real(request, **kwargs)  # applied through the segment; the answer is lost
                raise _AnswerLost()
            return replacement._update(request, **kwargs)

        client._update = moving
        assert client.update(updates, worker_id="w-moved", sequence=1) == 0
        assert len(calls) == 3  # the segment, refused there, then the message
        with pytest.raises(UpdateNotApplied, match="first sending"):  # a pair never sent
            client.update(updates, worker_id="w-moved", sequence=1)
    finally:
        client.close()
        replacement.close()
        elsewhere.stop()


EMBEDDING_WORKER_DIES = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from persia_py.config import CommonConfig
    from persia_py.workers.ps_client import PSClient
    client = PSClient(sys.argv[1], CommonConfig(rpc_timeout_sec=60))
    ids = np.arange(1, 65, dtype=np.uint64)
    rows = client.lookup([("user", ids)], training=True)
    client.update([("user", ids, np.ones_like(rows[0]))], worker_id="w-dies", sequence=1)
    held = client.lookup([("user", ids)], training=True, as_float32=False)
    assert client.segments.num_answers == 2 and client.segments.num_sends == 1
    print("through shared memory", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # holding a segment, others free
""")


@pytest_processes
def test_a_killed_embedding_worker_leaves_no_segment_and_the_server_goes_on(ps, tmp_path) -> None:
    _, port, _ = ps
    script = tmp_path / "dies.py"
    script.write_text(EMBEDDING_WORKER_DIES)
    child = subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    assert "through shared memory" in out
    assert not _segments_of(child.pid)  # the server unlinked each once it mapped it
    client = _client(port)
    try:
        tables = _tables(4)
        assert [r.shape for r in client.lookup(tables, training=True)] == [
            (ids.size, dim) for (_, ids), dim in zip(tables, (8, 4))]
    finally:
        client.close()


@pytest_processes
def test_a_parameter_server_killed_mid_traffic_loses_nothing_and_shared_memory_goes_on(
        ps) -> None:
    """An embedding worker trains through shared memory while its parameter server is
    SIGKILLed and started again on its port, empty: its calls fail, are retried until the
    server is back (configured again), and every batch's update is applied; the segments
    the old server had mapped are retired and new ones made, none left behind."""
    state, port, args = ps
    config = GlobalConfig(common_config=CommonConfig(rpc_timeout_sec=120, startup_timeout_sec=60))
    embedding = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=8),
                                                    "item": SlotConfig(dim=4)})
    client = PSClient(f"127.0.0.1:{port}", config.common_config)
    worker = EmbeddingWorker(config, embedding, [client])
    worker.configure(CONFIGURE)
    steps_done, errors = [0], []
    progress, stop = threading.Condition(), threading.Event()

    def train() -> None:
        rng = np.random.default_rng(5)
        try:
            while not stop.is_set():
                ids = rng.integers(1, 5000, 256).astype(np.uint64)
                one = np.ones(256, np.int32)
                ref = worker.put_batch([SlotIds("user", ids, one), SlotIds("item", ids, one)],
                                       256, True)
                rows = worker.lookup(ref)
                assert worker.update_gradients(ref, {r.slot: np.full(r.rows.shape, 0.25, np.float32)
                                                     for r in rows}) > 0
                with progress:
                    steps_done[0] += 1
                    progress.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            with progress:
                errors.append(exc)
                progress.notify_all()

    def trained(num_steps: int) -> bool:
        with progress:
            return progress.wait_for(lambda: steps_done[0] >= num_steps or errors, timeout=300)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert trained(3) and not errors, errors
        used_before = client.segments.num_answers
        state["proc"].process.send_signal(signal.SIGKILL)
        state["proc"].process.wait(timeout=60)
        state["proc"] = start_server("embedding-parameter-server", *args, port=port)[0]
        at_restart = steps_done[0]
        trained(at_restart + 4)
    finally:
        stop.set()
        thread.join(timeout=180)
        worker.close()
    assert not errors, errors
    assert not thread.is_alive()
    assert steps_done[0] >= at_restart + 4
    assert client.segments.answers.enabled and client.segments.sends.enabled
    assert client.segments.num_answers > used_before + 2
    assert not _segments_of(os.getpid())
    # The restarted server was configured again by the worker and serves.
    again = _client(port)
    try:
        assert again.lookup(_tables(6), training=True)[0].shape[1] == 8
    finally:
        again.close()
