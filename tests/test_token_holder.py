"""What a caller holding the job's token can make a parameter server do, beyond what
``tests/test_trust_boundary.py`` tries without it: calls within the limits cost the server
under twice ``max_message_bytes`` (its peak memory read from /proc), an answer too big for
the limit is refused before it is built, fresh worker ids never push out a live
exactly-once window, and an update pre-marked under a batch's identity is an error, not a
batch silently left untrained.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import grpc
import lz4.block
import numpy as np
import pytest
import yaml
from child_processes import RoleProcess, start_server
from grpc_calls import token_channel

from persia_py.config import CommonConfig, GlobalConfig, embedding_config_from_dict
from persia_py.proto import common_pb2
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.servers.call_memory import UPDATE_BYTES_PER_ID, WORK_PER_MESSAGE_LIMIT
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.update_window import MAX_UPDATE_WORKERS, UpdateWindow, WindowFull
from persia_py.wire.rpc import FailedPrecondition
from persia_py.workers.data_loader import new_stream
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.ps_client import PSClient, UpdateNotApplied, configure_request

processes = pytest.mark.processes

LIMIT = 16 * 1024 * 1024
"""max_message_bytes of the server."""
DIM = 4
LR = 0.5
KNOWN_IDS = np.arange(1, 65, dtype=np.uint64)
SERVICE = "/persia_py.ParameterServer/"


class Server(NamedTuple):
    proc: RoleProcess
    address: str
    common: CommonConfig
    channel: grpc.Channel


def _start(root: Path) -> Server:
    """A parameter server with LIMIT as its message limit, SGD, and the known ids stored."""
    (root / "embedding_config.yml").write_text(f"slots_config:\n  user:\n    dim: {DIM}\n")
    common = dict(max_message_bytes=LIMIT, rpc_timeout_sec=20, startup_timeout_sec=60)
    (root / "global_config.yml").write_text(yaml.safe_dump({"common_config": common}))
    proc, port = start_server("embedding-parameter-server",
                              "--embedding-config", str(root / "embedding_config.yml"),
                              "--global-config", str(root / "global_config.yml"))
    address = f"127.0.0.1:{port}"
    channel = token_channel(address, [("grpc.max_send_message_length", -1),
                                      ("grpc.max_receive_message_length", -1)])
    try:
        client = PSClient(address, CommonConfig(**common))
        client.configure(configure_request({"type": "sgd", "lr": LR}, init_lower=-0.1,
                                           init_upper=0.1, weight_bound=None, seed=3))
        client.lookup([("user", KNOWN_IDS)], training=True)
        client.close()
    except BaseException:
        channel.close()
        proc.stop()
        raise
    return Server(proc, address, CommonConfig(**common), channel)


def _stop(server: Server) -> None:
    server.channel.close()
    server.proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = _start(tmp_path_factory.mktemp("holder"))
    try:
        yield started
    finally:
        _stop(started)


def _lz4(array: np.ndarray) -> common_pb2.Tensor:
    array = np.ascontiguousarray(array)
    return common_pb2.Tensor(dtype=array.dtype.name, shape=array.shape, lz4=True,
                             data=lz4.block.compress(array.tobytes(), store_size=False))


def _update(num_ids: int, sequence: int) -> bytes:
    """An lz4 update of ``num_ids`` times one known id (a few KB on the wire)."""
    return ps_pb.UpdateRequest(worker_id="holder", sequence=sequence, tables=[
        ps_pb.TableGradients(table="user", ids=_lz4(np.full(num_ids, KNOWN_IDS[0])),
                             grads=_lz4(np.zeros((num_ids, DIM), np.float32)))
    ]).SerializeToString()


def _lookup(num_ids: int) -> bytes:
    return ps_pb.LookupRequest(training=False, tables=[ps_pb.TableIds(
        table="user", ids=_lz4(np.full(num_ids, KNOWN_IDS[1])))]).SerializeToString()


def _memory_mib(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f)
                    if k == key)


def _peak_above_idle(server: Server, request: bytes, method: str) -> float:
    """How far the memory of a fresh ``server`` peaks above its idle level while it
    serves ``request`` (MiB); the call must be answered."""
    pid = server.proc.process.pid
    call = server.channel.unary_unary(SERVICE + method)
    call(_update(100, 1) if method == "Update" else _lookup(100), timeout=60)  # warm
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    idle = _memory_mib(pid, "VmRSS")
    call(request, timeout=60)
    return _memory_mib(pid, "VmHWM") - idle


WORK = int(WORK_PER_MESSAGE_LIMIT * LIMIT)


@processes
@pytest.mark.parametrize("method,request_", [
    # The largest update of one id repeated throughout (the most work per id).
    ("Update", _update(WORK // (8 + 4 * DIM + UPDATE_BYTES_PER_ID) - 64, 2)),
    # The largest lookup answer: the rows gathered into the message, gRPC's copy to send.
    ("Lookup", _lookup(WORK // (8 + 16 + 2 * 4 * DIM) - 64)),
])
def test_calls_within_the_limits_cost_the_server_under_twice_the_limit(
        tmp_path, method, request_) -> None:
    assert len(request_) < LIMIT // 64  # lz4: a few KB on the wire
    server = _start(tmp_path)  # a fresh one: memory earlier calls left counts for nothing
    try:
        rise = _peak_above_idle(server, request_, method)
    finally:
        _stop(server)
    assert rise < 2 * LIMIT / 2**20, f"the server's memory rose by {rise:.0f} MiB"


@processes
def test_an_update_that_would_take_too_much_memory_is_refused_before_decoding(server) -> None:
    """Decoded to the message limit, an update of one id repeated throughout: it would
    take about 2.7 times the limit to apply (1.7 times in the tables alone)."""
    pid = server.proc.process.pid
    request = _update((LIMIT - 4096) // (8 + 4 * DIM), 2)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = _memory_mib(pid, "VmRSS")
    with pytest.raises(grpc.RpcError) as info:
        server.channel.unary_unary(SERVICE + "Update")(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert re.search(r"an update of \d+ ids would take \d+ bytes of memory to serve, over 1.5 "
                     r"x common_config.max_message_bytes \(16777216\); send fewer ids per call",
                     info.value.details()), info.value.details()
    rise = _memory_mib(pid, "VmHWM") - before
    assert rise < LIMIT / 4 / 2**20, f"{rise:.0f} MiB: its arrays were decoded"


@processes
def test_an_answer_of_the_limit_is_refused_before_it_is_built(server) -> None:
    lookup = server.channel.unary_unary(SERVICE + "Lookup")
    pid = server.proc.process.pid
    exactly = LIMIT // (4 * DIM)  # rows of exactly the limit, before their framing
    for num_ids in (exactly, exactly + 1):
        request = _lookup(num_ids)
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        before = _memory_mib(pid, "VmRSS")
        with pytest.raises(grpc.RpcError) as info:
            lookup(request, timeout=60)
        # INVALID_ARGUMENT from the server's own check, not gRPC's RESOURCE_EXHAUSTED on
        # sending an answer it built.
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert re.search(r"answer would carry \d+ bytes, over max_message_bytes 16777216 "
                         r"\(common_config; framing included\)", info.value.details())
        # The ids decoded (half the limit), not the answer's rows (the limit).
        rise = _memory_mib(pid, "VmHWM") - before
        assert rise < LIMIT / 2**20, f"{rise:.0f} MiB: the answer was built"


def _ps(window_ids: int = MAX_UPDATE_WORKERS) -> ParameterServer:
    ps = ParameterServer(GlobalConfig(), embedding_config_from_dict(
        {"slots_config": {"user": {"dim": DIM, "capacity": 1000}}}))
    ps.configure(optimizer={"type": "sgd", "lr": LR})
    ps.lookup([("user", KNOWN_IDS)], training=True)
    return ps


def _grads(value: float = 1.0) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return [("user", KNOWN_IDS[:2], np.full((2, DIM), value, np.float32))]


def test_fresh_worker_ids_never_push_out_a_live_window() -> None:
    ps = _ps()
    assert ps.update(_grads(), worker_id="victim", sequence=7) == (2, False)
    rows = ps.lookup([("user", KNOWN_IDS[:2])], training=False)[0]
    for i in range(MAX_UPDATE_WORKERS - 1):
        assert not ps.update(_grads(0.0), worker_id=f"fresh-{i}", sequence=7)[1]
    with pytest.raises(WindowFull, match=r"'fresh-new'.*remembers the updates of 128 worker "
                                         r"ids, each of which updated within the last 3600 s"):
        ps.update(_grads(0.0), worker_id="fresh-new", sequence=7)
    # The victim's retry is still known: acknowledged, not applied a second time.
    assert ps.update(_grads(), worker_id="victim", sequence=7) == (0, True)
    np.testing.assert_array_equal(ps.lookup([("user", KNOWN_IDS[:2])], training=False)[0], rows)
    assert isinstance(WindowFull("x"), FailedPrecondition)  # FAILED_PRECONDITION on the wire


def test_a_new_worker_id_takes_the_place_of_the_window_idle_longest() -> None:
    now = [0.0]
    window = UpdateWindow(max_workers=2, idle_sec=100.0, clock=lambda: now[0])
    assert not window.seen_before("a", 1)
    now[0] = 50.0
    assert not window.seen_before("b", 1)
    with pytest.raises(WindowFull):
        window.seen_before("c", 1)
    now[0] = 101.0  # "a" idle for 101 s, "b" for 51 s
    assert not window.seen_before("c", 1)
    assert list(window.export()) == ["b", "c"]
    assert window.seen_before("b", 1)  # "b" kept its window
    # A replayed update log takes the place of the least recent even if it is live.
    assert not window.seen_before("d", 1, replayed=True)
    assert list(window.export()) == ["b", "d"]


def test_windows_loaded_from_a_checkpoint_count_as_live() -> None:
    ps = _ps()
    for i in range(MAX_UPDATE_WORKERS):
        ps.update(_grads(0.0), worker_id=f"w{i}", sequence=1)
    restored = _ps()
    restored.load_state_dict(ps.state_dict())
    with pytest.raises(WindowFull):
        restored.update(_grads(0.0), worker_id="fresh", sequence=1)
    assert restored.update(_grads(0.0), worker_id="w0", sequence=1) == (0, True)


def test_a_loader_stream_is_128_random_bits() -> None:
    streams = {new_stream(3) for _ in range(8)}
    assert len(streams) == 8
    for stream in streams:
        assert re.fullmatch(r"loader3-[0-9a-f]{32}", stream), stream


@processes
def test_a_pre_marked_batch_identity_is_an_error_not_a_batch_left_untrained(server) -> None:
    """A caller who knew a batch's (stream, batch id) sends an update under it first: the
    real update is answered duplicate on its first sending. That is an error on every
    attempt, naming the batch; before, the worker counted it as applied (lost gradients)."""
    emb = embedding_config_from_dict({"slots_config": {"user": {"dim": DIM}}})
    worker = EmbeddingWorker(GlobalConfig(common_config=server.common), emb,
                             [PSClient(server.address, server.common)])
    stream, batch_id = new_stream(0), 12345
    ids = KNOWN_IDS[10:13]
    try:
        forged = PSClient(server.address, server.common)
        forged.update([("user", ids[:1], np.zeros((1, DIM), np.float32))],
                      worker_id=f"data-{stream}", sequence=batch_id)
        forged.close()
        ref = worker.put_batch([SlotIds("user", ids, np.ones(3, np.int32))], 3, True,
                               identity=(stream, batch_id))
        (slot,) = worker.lookup(ref)
        for _attempt in range(2):
            with pytest.raises(UpdateNotApplied, match=rf"batch {batch_id} of data loader "
                                                       rf"stream {stream[:12]}.*not applied"):
                worker.update_gradients(ref, {"user": np.ones((3, DIM), np.float32)})
        after = worker.lookup_direct([SlotIds("user", ids, np.ones(3, np.int32))], 3)[0].rows
        np.testing.assert_array_equal(after, slot.rows)  # nothing applied, nothing claimed
    finally:
        worker.close()
