"""Fuzz every service with mutated and malformed messages: each call gets a status code (never
INTERNAL, never a hang), every server keeps serving, and the parameter server's rows do not
change.

Messages are built by mutating valid requests and sent as raw bytes, so even undecodable
protobufs reach the servers. Every message to a method that could change the tables (a
training lookup, an update, a batch put) carries at least one *breaker*, a defect that
must make the server refuse the whole request; other mutations (random ids, NaN, flipped
flags, random refs) ride along. Methods that change nothing (inference lookups, Stats,
Health, NextBatch) also get unbroken mutations. The checkpoint service gets Dump and Load
calls naming hostile folders (``..``, absolute, NUL, over-long, links' targets, a checkpoint
whose files lie outside it). Seeds are fixed, so a failure repeats.
"""

from __future__ import annotations

import collections
import hashlib
import os
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from child_processes import RoleProcess, launcher_command, start_server
from fuzz_messages import (
    ALLOWED,
    COMMON,
    CONFIGURE,
    DIMS,
    KNOWN_IDS,
    MAX_MESSAGE_BYTES,
    MESSAGES_PER_SERVICE,
    NUM_DATA_LOADER_RANKS,
    NUM_THREADS,
    SAMPLE_FIXED_SIZE,
    SEED,
    Mutator,
    dl_harmless,
    dl_message,
    escaping_checkpoint,
    ew_harmless,
    ew_message,
    ps_harmless,
    ps_message,
)
from grpc_calls import token_channel

from persia_py.ids.routing import RESERVED_ID
from persia_py.proto import checkpoint_pb2 as ckpt_pb
from persia_py.proto import common_pb2, data_loader_pb2
from persia_py.proto import embedding_worker_pb2 as ew_pb
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.wire import codec
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient

pytestmark = pytest.mark.processes
EMBEDDING_CONFIG = f"""
slots_config:
  user:
    dim: {DIMS["user"]}
  tags:
    dim: {DIMS["tags"]}
    embedding_summation: false
    sample_fixed_size: {SAMPLE_FIXED_SIZE}
"""
GLOBAL_CONFIG = f"common_config:\n  max_message_bytes: {MAX_MESSAGE_BYTES}\n"
DATA_LOADER_SCRIPT = textwrap.dedent("""
    import numpy as np
    from persia_py.ctx import DataCtx
    from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, PersiaBatch
    with DataCtx() as ctx:
        ids = np.array([1, 2], np.uint64)
        ctx.send_data(PersiaBatch([IDTypeFeatureWithSingleID("user", ids),
                                   IDTypeFeatureWithSingleID("tags", ids)],
                                  labels=[Label(np.ones((2, 1), np.float32))],
                                  requires_grad=False))
""")


# -- the cluster and the checksum ------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    (root / "global_config.yml").write_text(GLOBAL_CONFIG)
    config = ["--embedding-config", str(root / "embedding_config.yml"),
              "--global-config", str(root / "global_config.yml")]
    checkpoints = root / "checkpoints"
    (checkpoints / "ckpt").mkdir(parents=True)
    escaping_checkpoint(checkpoints / "escaping")
    procs = []
    try:
        ps, ps_port = start_server("embedding-parameter-server", *config,
                                   "--checkpoint-root", str(checkpoints))
        procs.append(ps)
        ew_proc, ew_port = start_server("embedding-worker", *config,
                                        "--ps-addrs", f"127.0.0.1:{ps_port}")
        procs.append(ew_proc)
        ew = EmbeddingWorkerClient(f"127.0.0.1:{ew_port}", COMMON)
        ew.configure(CONFIGURE)
        # Train the known ids once, so their rows are not just initial values.
        lengths = np.ones(KNOWN_IDS.size, np.int32)
        batch = [("user", KNOWN_IDS, lengths), ("tags", KNOWN_IDS, lengths)]
        ref = ew.put_batch(batch, KNOWN_IDS.size, True)
        ew.update_gradients(ref, [(s.slot, np.ones_like(s.rows)) for s in ew.lookup(ref)])
        # Hold a looked-up batch whose gradients the fuzz sends, broken, all along.
        held = ew.put_batch(batch, KNOWN_IDS.size, True)
        unique = {s.slot: s.rows.shape[0] for s in ew.lookup(held)}
        script = root / "loader.py"
        script.write_text(DATA_LOADER_SCRIPT)
        env = dict(os.environ, PERSIA_EMBEDDING_WORKER_ADDRS=ew.address,
                   PERSIA_NN_WORKER_WORLD_SIZE=str(NUM_DATA_LOADER_RANKS),
                   PERSIA_GLOBAL_CONFIG=str(root / "global_config.yml"))
        loader = RoleProcess(launcher_command("data-loader", "--port", "0", str(script)), env=env)
        procs.append(loader)
        dl_port = int(loader.wait_for_line(r"on port (\d+) ready", timeout=60).group(1))
        yield {"ps": f"127.0.0.1:{ps_port}", "ew": ew, "dl": f"127.0.0.1:{dl_port}",
               "loader": loader, "ref": held, "unique": unique, "procs": procs}
        ew.close()
    finally:
        for proc in procs:
            proc.stop()


def _checksum(ps_addr: str) -> tuple[dict, str]:
    client = PSClient(ps_addr, COMMON)
    try:
        entries = {t.table: t.entries for t in client.stats().tables}
        rows = client.lookup([("user", KNOWN_IDS), ("tags", KNOWN_IDS)], training=False)
        return entries, hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
    finally:
        client.close()


def _next_batch(channel: grpc.Channel, rank: int) -> data_loader_pb2.NextBatchResponse:
    return channel.unary_unary(
        "/persia_py.DataLoader/NextBatch",
        request_serializer=data_loader_pb2.NextBatchRequest.SerializeToString,
        response_deserializer=data_loader_pb2.NextBatchResponse.FromString,
    )(data_loader_pb2.NextBatchRequest(rank=rank), timeout=10)


def _raw_channel(address: str) -> grpc.Channel:
    # Room to send more than the servers accept, so that their limit is what refuses it.
    big = 4 * MAX_MESSAGE_BYTES
    return token_channel(address, options=[("grpc.max_send_message_length", big),
                                           ("grpc.max_receive_message_length", big)])


def _fuzz(address: str, build, harmless, service_index: int, state: dict):
    """Send MESSAGES_PER_SERVICE messages; returns Counter of (method, code) and failures."""
    channel = _raw_channel(address)
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()
    callables: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def send(i: int) -> None:
        m = Mutator(np.random.default_rng([SEED, service_index, i]))
        while True:
            raw = m.chance(0.15)
            method, message = build(m, state, raw)
            if raw:
                message = m.raw(message)
            elif i % 3000 == 0:  # over max_message_bytes
                message += m.rng.bytes(MAX_MESSAGE_BYTES + 1024)
            if not raw or harmless(method, message, state):
                break
        with lock:
            stub = callables.get(method)
            if stub is None:
                stub = callables[method] = channel.unary_unary(method)
        try:
            stub(message, timeout=20)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        with lock:
            counts[method.rsplit("/", 1)[1], code.name] += 1
            if code not in ALLOWED and len(failures) < 20:
                failures.append(f"message {i} to {method}: {code.name}: {details} "
                                f"({len(message)} bytes: {message[:80]!r})")

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        list(pool.map(send, range(MESSAGES_PER_SERVICE)))
    channel.close()
    return counts, failures


def _health(address: str, service: str) -> common_pb2.HealthResponse:
    channel = token_channel(address)
    try:
        return channel.unary_unary(
            f"/persia_py.{service}/Health",
            request_serializer=common_pb2.HealthRequest.SerializeToString,
            response_deserializer=common_pb2.HealthResponse.FromString,
        )(common_pb2.HealthRequest(), timeout=10)
    finally:
        channel.close()


def test_fuzz_every_service_keeps_serving_and_rows_unchanged(fuzz_cluster) -> None:
    c = fuzz_cluster
    before = _checksum(c["ps"])
    assert before[0] == {"user": KNOWN_IDS.size, "tags": KNOWN_IDS.size}
    dl_channel = token_channel(c["dl"])
    while not _next_batch(dl_channel, 0).end_of_stream:  # take the batch; wait for the end
        pass
    state = {"ref": c["ref"], "unique": c["unique"]}
    results = {}
    with ThreadPoolExecutor(3) as pool:
        jobs = {
            "ParameterServer": pool.submit(_fuzz, c["ps"], ps_message, ps_harmless, 0, state),
            "EmbeddingWorker": pool.submit(_fuzz, c["ew"].address, ew_message, ew_harmless, 1,
                                           state),
            "DataLoader": pool.submit(_fuzz, c["dl"], dl_message, dl_harmless, 2, state),
        }
        results = {name: job.result() for name, job in jobs.items()}
    report = "\n".join(f"{name}: {sorted(counts.items())}" for name, (counts, _) in results.items())
    print(report)
    for name, (counts, failures) in results.items():
        assert sum(counts.values()) == MESSAGES_PER_SERVICE, name
        assert not failures, f"{name}:\n" + "\n".join(failures)
        assert sum(n for (_, code), n in counts.items() if code != "OK") > 0.5 * sum(
            counts.values()), f"{name}: most messages should be refused\n{report}"
    for proc in c["procs"][:2]:
        assert proc.process.poll() is None, proc.output()
    assert _health(c["ps"], "ParameterServer").configured
    assert _health(c["ew"].address, "EmbeddingWorker").configured
    assert _health(c["dl"], "DataLoader").role == "data-loader"
    assert _checksum(c["ps"]) == before
    # The held batch survived every broken update and still takes a correct one.
    ew = c["ew"]
    grads = [(slot, np.zeros((n, DIMS[slot]), np.float32)) for slot, n in c["unique"].items()]
    assert ew.update_gradients(c["ref"], grads) == 2 * KNOWN_IDS.size
    # The last rank ends the stream; the data loader then exits cleanly.
    assert _next_batch(dl_channel, NUM_DATA_LOADER_RANKS - 1).end_of_stream
    dl_channel.close()
    assert c["loader"].wait(timeout=60) == 0, c["loader"].output()


def _refusal(address: str, method: str, message: bytes) -> tuple[grpc.StatusCode, str]:
    channel = _raw_channel(address)
    try:
        channel.unary_unary(method)(message, timeout=20)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    finally:
        channel.close()


def test_refusals_say_what_was_wrong(fuzz_cluster) -> None:
    c = fuzz_cluster
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    too_many = ps_pb.LookupRequest(tables=[ps_pb.TableIds(
        table="tags", ids=codec.encode(np.arange(1, MAX_MESSAGE_BYTES // 16, dtype=np.uint64)))])
    cases = [
        (c["ps"], "/persia_py.ParameterServer/Lookup", too_many.SerializeToString(),
         invalid, "over max_message_bytes"),
        (c["ps"], "/persia_py.ParameterServer/Lookup", b"\n\xff\x01\n\x04user",
         invalid, "request is not a valid message"),
        (c["ps"], "/persia_py.ParameterServer/Lookup", b"\0" * (MAX_MESSAGE_BYTES + 1),
         grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (c["ps"], "/persia_py.ParameterServer/Configure", common_pb2.ConfigureRequest(
            optimizer_json="[" * 100_000).SerializeToString(), invalid, "nested too deeply"),
        (c["ps"], "/persia_py.ParameterServerCheckpoint/Dump", ckpt_pb.DumpRequest(
            checkpoint="../escape").SerializeToString(), invalid, "checkpoint: '../escape' is "
                                                                  "not a plain name"),
        (c["ps"], "/persia_py.ParameterServerCheckpoint/Load", ckpt_pb.LoadRequest(
            folder="x" * 5000, checkpoint="c").SerializeToString(), invalid,
         "folder: a name has at most 128 characters"),
        (c["ps"], "/persia_py.ParameterServerCheckpoint/Load", ckpt_pb.LoadRequest(
            checkpoint="escaping").SerializeToString(), invalid, "is not a plain name"),
        (c["ew"].address, "/persia_py.EmbeddingWorker/PutBatch", ew_pb.PutBatchRequest(
            features=[codec.encode_id_feature(s, np.array([RESERVED_ID], np.uint64),
                                              np.ones(1, np.int32)) for s in DIMS],
            batch_size=1, requires_grad=True).SerializeToString(), invalid, "is reserved"),
        (c["ew"].address, "/persia_py.EmbeddingWorker/LookupDirect", ew_pb.LookupDirectRequest(
            features=[codec.encode_id_feature(s, np.arange(1, 300_001, dtype=np.uint64),
                                              np.ones(300_000, np.int32)) for s in DIMS],
            batch_size=300_000).SerializeToString(), invalid, "over max_message_bytes"),
    ]
    entries = _checksum(c["ps"])[0]
    for address, method, message, code, needle in cases:
        got, details = _refusal(address, method, message)
        assert got == code and needle in details, (method, got, details)
    assert _checksum(c["ps"])[0] == entries
