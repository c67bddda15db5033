"""Real server processes over real gRPC channels: the sparse path end to end, and bad
requests answered with a status code that names the problem while the server keeps serving."""

from __future__ import annotations

import os
import textwrap

import grpc
import lz4.block
import numpy as np
import pytest
from child_processes import RoleProcess, launcher_command, start_server
from grpc_calls import token_channel

from persia_py.config import CommonConfig
from persia_py.ids.routing import replica_of
from persia_py.proto import (
    common_pb2,
    data_loader_pb2,
    data_loader_pb2_grpc,
    embedding_worker_pb2,
    embedding_worker_pb2_grpc,
    parameter_server_pb2,
    parameter_server_pb2_grpc,
)
from persia_py.servers.initializer import initial_rows
from persia_py.wire import codec
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient, configure_request

pytestmark = pytest.mark.processes

EMBEDDING_CONFIG = """
slots_config:
  user:
    dim: 4
  tags:
    dim: 4
    embedding_summation: false
    sample_fixed_size: 3
"""
LR = 0.5
COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two parameter servers and one embedding worker, configured with SGD."""
    root = tmp_path_factory.mktemp("cluster")
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    procs, ps_addrs = [], []
    try:
        for i in range(2):
            proc, port = start_server("embedding-parameter-server", *config,
                                      "--replica-index", str(i), "--replica-size", "2")
            procs.append(proc)
            ps_addrs.append(f"127.0.0.1:{port}")
        ew_proc, ew_port = start_server("embedding-worker", *config,
                                        "--ps-addrs", ",".join(ps_addrs))
        procs.append(ew_proc)
        ew = EmbeddingWorkerClient(f"127.0.0.1:{ew_port}", COMMON)
        ew.configure(configure_request({"type": "sgd", "lr": LR}, init_lower=-0.1,
                                       init_upper=0.1, weight_bound=None, seed=7))
        yield ps_addrs, ew, root, ew_proc
        ew.close()
    finally:
        for proc in procs:
            proc.stop()


def _ps_rows(ps_addrs: list[str], slot: str, ids: np.ndarray) -> np.ndarray:
    """Rows read straight from the owning replicas, without inserting."""
    rows = np.zeros((ids.size, 4), np.float32)
    owner = replica_of(ids, len(ps_addrs))
    for r, address in enumerate(ps_addrs):
        client = PSClient(address, COMMON)
        sel = owner == r
        if sel.any():
            rows[sel] = client.lookup([(slot, ids[sel])], training=False)[0]
        client.close()
    return rows


def test_lookup_dedups_routes_and_updates_sum_gradients_per_id(cluster) -> None:
    ps_addrs, ew, _, _ = cluster
    user = np.array([11, 12, 11, 13], np.uint64)  # id 11 twice
    tags = np.array([21, 22, 21, 23, 24], np.uint64)
    tag_lengths = np.array([2, 0, 3, 0], np.int32)
    features = [("user", user, np.ones(4, np.int32)), ("tags", tags, tag_lengths)]
    ref = ew.put_batch(features, 4, True)
    slots = {s.slot: s for s in ew.lookup(ref)}
    # A retried lookup (its first answer lost on the way, a link that dropped) is answered
    # again, with the same rows: the batch is still trained once (below).
    again = {s.slot: s for s in ew.lookup(ref)}
    for slot, rows in slots.items():
        np.testing.assert_array_equal(again[slot].rows, rows.rows)

    user_slot = slots["user"]
    assert user_slot.pooling == "sum" and user_slot.rows.shape == (3, 4)  # 3 distinct ids
    unique_user = np.array([11, 12, 13], np.uint64)
    # New rows come from the deterministic initializer, whichever replica holds them.
    np.testing.assert_allclose(user_slot.rows[user_slot.index],
                               initial_rows(user, 4, -0.1, 0.1, 7), rtol=1e-6)
    np.testing.assert_allclose(_ps_rows(ps_addrs, "user", unique_user), user_slot.rows)
    assert slots["tags"].pooling == "raw" and slots["tags"].rows.shape == (4, 4)

    grads = [("user", np.ones((3, 4), np.float32)), ("tags", np.full((4, 4), 2.0, np.float32))]
    assert ew.update_gradients(ref, grads) == 7
    np.testing.assert_allclose(_ps_rows(ps_addrs, "user", unique_user),
                               user_slot.rows - LR * 1.0, rtol=1e-6)
    np.testing.assert_allclose(_ps_rows(ps_addrs, "tags", np.unique(tags)),
                               slots["tags"].rows - LR * 2.0, rtol=1e-6)
    # A repeat (a retry whose first answer was lost) is acknowledged, not applied again.
    assert ew.update_gradients(ref, grads) == 7
    np.testing.assert_allclose(_ps_rows(ps_addrs, "user", unique_user),
                               user_slot.rows - LR * 1.0, rtol=1e-6)
    with pytest.raises(grpc.RpcError) as info:  # the batch was released
        ew.lookup(ref)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_inference_lookup_inserts_nothing(cluster) -> None:
    ps_addrs, ew, _, _ = cluster
    fresh = np.array([900001, 900002], np.uint64)
    slots = ew.lookup_direct([("user", fresh, np.ones(2, np.int32)),
                              ("tags", fresh, np.array([1, 1], np.int32))], 2)
    assert not slots[0].rows.any()
    before = sum(t.entries for a in ps_addrs for t in PSClient(a, COMMON).stats().tables)
    ew.lookup_direct([("user", fresh, np.ones(2, np.int32)),
                      ("tags", fresh, np.array([1, 1], np.int32))], 2)
    after = sum(t.entries for a in ps_addrs for t in PSClient(a, COMMON).stats().tables)
    assert before == after


def _expect_error(fn, code: grpc.StatusCode, *needles: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details(), info.value.details()


def test_parameter_server_rejects_bad_requests_and_keeps_serving(cluster) -> None:
    ps_addrs, _, _, _ = cluster
    channel = token_channel(ps_addrs[0])
    stub = parameter_server_pb2_grpc.ParameterServerStub(channel)
    ids = np.array([5], np.uint64)
    ids = ids if replica_of(ids, 2)[0] == 0 else np.array([6], np.uint64)
    bad_dtype = parameter_server_pb2.LookupRequest(tables=[parameter_server_pb2.TableIds(
        table="user", ids=codec.encode(ids.astype(np.int32)))], training=True)
    _expect_error(lambda: stub.Lookup(bad_dtype, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "tables[0].ids", "int32")
    unknown = parameter_server_pb2.LookupRequest(tables=[parameter_server_pb2.TableIds(
        table="nope", ids=codec.encode(ids))], training=True)
    _expect_error(lambda: stub.Lookup(unknown, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "unknown table 'nope'")
    nan = parameter_server_pb2.UpdateRequest(tables=[parameter_server_pb2.TableGradients(
        table="user", ids=codec.encode(ids),
        grads=codec.encode(np.full((1, 4), np.nan, np.float32)))])
    _expect_error(lambda: stub.Update(nan, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "NaN")
    wrong_dim = parameter_server_pb2.UpdateRequest(tables=[parameter_server_pb2.TableGradients(
        table="user", ids=codec.encode(ids), grads=codec.encode(np.ones((1, 3), np.float32)))])
    _expect_error(lambda: stub.Update(wrong_dim, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "do not match")
    # Still serving, and the rejected updates changed nothing.
    client = PSClient(ps_addrs[0], COMMON)
    row = client.lookup([("user", ids)], training=True)[0]
    np.testing.assert_array_equal(client.lookup([("user", ids)], training=True)[0], row)
    channel.close()


def test_embedding_worker_rejects_bad_requests_and_keeps_serving(cluster) -> None:
    _, ew, _, _ = cluster
    stub = embedding_worker_pb2_grpc.EmbeddingWorkerStub(ew.channel)
    one = np.ones(1, np.int32)
    ids = np.array([1], np.uint64)
    unknown = embedding_worker_pb2.PutBatchRequest(
        features=[codec.encode_id_feature("nope", ids, one)], batch_size=1, requires_grad=True)
    _expect_error(lambda: stub.PutBatch(unknown, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "unknown slot 'nope'")
    too_long = embedding_worker_pb2.PutBatchRequest(
        features=[codec.encode_id_feature("user", ids, one),
                  codec.encode_id_feature("tags", np.arange(4, dtype=np.uint64),
                                          np.array([4], np.int32))],
        batch_size=1, requires_grad=True)
    _expect_error(lambda: stub.PutBatch(too_long, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "sample_fixed_size 3")
    bad_lengths = embedding_worker_pb2.PutBatchRequest(
        features=[codec.encode_id_feature("user", ids, np.array([2], np.int32)),
                  codec.encode_id_feature("tags", ids, one)], batch_size=1, requires_grad=True)
    _expect_error(lambda: stub.PutBatch(bad_lengths, timeout=10),
                  grpc.StatusCode.INVALID_ARGUMENT, "do not add up")
    _expect_error(lambda: stub.Lookup(embedding_worker_pb2.LookupBatchRequest(ref=10**9),
                                      timeout=10), grpc.StatusCode.NOT_FOUND, "no batch")
    ref = ew.put_batch([("user", ids, one), ("tags", ids, one)], 1, True)
    slots = ew.lookup(ref)
    _expect_error(lambda: ew.update_gradients(ref, [("user", np.ones((1, 5), np.float32)),
                                                    ("tags", np.ones((1, 4), np.float32))]),
                  grpc.StatusCode.INVALID_ARGUMENT, "expected (1, 4)")
    # The batch is still there and takes a correct update.
    assert ew.update_gradients(ref, [(s.slot, np.zeros_like(s.rows)) for s in slots]) == 2
    # Ids whose lz4 payload claims more than max_message_bytes are refused undecoded.
    claim = COMMON.max_message_bytes // 8 + 1
    bomb = common_pb2.Tensor(dtype="uint64", shape=[claim], lz4=True,
                             data=lz4.block.compress(bytes(8 * 4096), store_size=False))
    lz4_bomb = embedding_worker_pb2.PutBatchRequest(
        features=[common_pb2.IdFeature(slot="user", ids=bomb, lengths=codec.encode(one))],
        batch_size=1, requires_grad=True)
    _expect_error(lambda: stub.PutBatch(lz4_bomb, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
                  "features[0].ids: lz4 payload claims", "max_message_bytes")


DATA_LOADER_SCRIPT = textwrap.dedent("""
    import numpy as np
    from persia_py.ctx import DataCtx
    from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, PersiaBatch
    with DataCtx() as ctx:
        ids = np.array([1, 2], np.uint64)
        ctx.send_data(PersiaBatch([IDTypeFeatureWithSingleID("user", ids),
                                   IDTypeFeatureWithSingleID("tags", ids)],
                                  labels=[Label(np.ones((2, 1), np.float32))]))
""")


def test_data_loader_rejects_bad_requests_and_keeps_serving(cluster) -> None:
    _, ew, root, _ = cluster
    script = root / "one_batch_loader.py"
    script.write_text(DATA_LOADER_SCRIPT)
    env = dict(os.environ, PERSIA_EMBEDDING_WORKER_ADDRS=ew.address,
               PERSIA_NN_WORKER_WORLD_SIZE="1")
    loader = RoleProcess(launcher_command("data-loader", "--port", "0", str(script)), env=env)
    try:
        port = int(loader.wait_for_line(r"on port (\d+) ready", timeout=60).group(1))
        channel = token_channel(f"127.0.0.1:{port}")
        stub = data_loader_pb2_grpc.DataLoaderStub(channel)
        _expect_error(lambda: stub.NextBatch(data_loader_pb2.NextBatchRequest(rank=3), timeout=10),
                      grpc.StatusCode.INVALID_ARGUMENT, "rank 3 not in [0, 1)")
        _expect_error(lambda: stub.NextBatch(data_loader_pb2.NextBatchRequest(
            rank=0, consumer=b"c" * 65), timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
            "consumer: 65 bytes, at most 64")
        seq = 0
        request = data_loader_pb2.NextBatchRequest(rank=0, consumer=b"me", request_seq=seq)
        while not (response := stub.NextBatch(request, timeout=10)).has_batch:
            seq += 1
            request = data_loader_pb2.NextBatchRequest(rank=0, consumer=b"me", request_seq=seq)
        # A retry (its reply lost on the wire) gets the same batch, not the next one.
        assert stub.NextBatch(request, timeout=10) == response
        batch = response.batch
        assert batch.batch_size == 2 and batch.labels[0].name == "label_anonymous"
        # The loader keeps the batch (for a resend to a restarted embedding worker) until
        # its consumer says it is done with it; only then may the loader exit.
        resent = stub.ResendBatch(data_loader_pb2.ResendBatchRequest(batch_id=batch.batch_id),
                                  timeout=10)
        assert (resent.embedding_worker, resent.ref) == (0, batch.ref)  # still pending there
        _expect_error(lambda: stub.ResendBatch(data_loader_pb2.ResendBatchRequest(batch_id=99),
                                               timeout=10),
                      grpc.StatusCode.NOT_FOUND, "batch 99 is not kept by this data loader")
        while not response.end_of_stream:
            response = stub.NextBatch(data_loader_pb2.NextBatchRequest(rank=0), timeout=10)
        assert loader.process.poll() is None  # the stream ended; the batch is still kept
        response = stub.NextBatch(data_loader_pb2.NextBatchRequest(
            rank=0, done=[batch.batch_id]), timeout=10)
        channel.close()
        assert loader.wait(timeout=60) == 0, loader.output()
        # The batch's ids wait on the embedding worker under the ref the loader sent.
        slots = ew.lookup(batch.ref)
        assert [s.slot for s in slots] == ["user", "tags"]
        ew.update_gradients(batch.ref, [(s.slot, np.zeros_like(s.rows)) for s in slots])
    finally:
        loader.stop()


def test_non_finite_gradients_are_skipped_per_slot_and_logged(cluster) -> None:
    ps_addrs, ew, _, ew_proc = cluster
    ids = np.array([31, 32], np.uint64)
    ones = np.ones(2, np.int32)
    ref = ew.put_batch([("user", ids, ones), ("tags", ids, ones)], 2, True)
    slots = {s.slot: s for s in ew.lookup(ref)}
    bad = np.full((2, 4), np.inf, np.float32)
    assert ew.update_gradients(ref, [("user", bad), ("tags", np.ones((2, 4), np.float32))]) == 2
    np.testing.assert_allclose(_ps_rows(ps_addrs, "user", ids), slots["user"].rows)
    np.testing.assert_allclose(_ps_rows(ps_addrs, "tags", ids), slots["tags"].rows - LR,
                               rtol=1e-6)
    ew_proc.wait_for_line(r"slot 'user': non-finite embedding gradients .* skipped \(1 so far\)",
                          timeout=10)


def test_fp16_and_lz4_on_the_wire_keep_values(cluster) -> None:
    _, ew, _, _ = cluster
    compact = EmbeddingWorkerClient(ew.address, CommonConfig(
        rpc_timeout_sec=30, startup_timeout_sec=60, embedding_fp16=True, lz4_compression=True))
    ids = np.array([41, 42, 43], np.uint64)
    features = [("user", ids, np.ones(3, np.int32)), ("tags", ids, np.ones(3, np.int32))]
    inserted = ew.put_batch(features, 3, True)  # a training lookup inserts the rows
    ew.update_gradients(inserted, [(s.slot, np.zeros_like(s.rows)) for s in ew.lookup(inserted)])
    exact = ew.lookup_direct(features, 3)
    assert all(s.rows.any() for s in exact)
    half = compact.lookup_direct(features, 3)
    for a, b in zip(exact, half):
        assert b.rows.dtype == np.float32
        np.testing.assert_allclose(b.rows, a.rows, atol=1e-3)
    ref = compact.put_batch(features, 3, True)
    rows = compact.lookup(ref)
    assert compact.update_gradients(ref, [(s.slot, np.ones_like(s.rows)) for s in rows]) == 6
    compact.close()
