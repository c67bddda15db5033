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
import json
import os
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import lz4.block
import numpy as np
import pytest
from conftest import RoleProcess, launcher_command, start_server, token_channel

from persia_py.config import CommonConfig
from persia_py.ids.routing import RESERVED_ID
from persia_py.proto import checkpoint_pb2 as ckpt_pb
from persia_py.proto import common_pb2, data_loader_pb2
from persia_py.proto import embedding_worker_pb2 as ew_pb
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.wire import codec
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient, configure_request

pytestmark = pytest.mark.processes
SEED = 20240607
MESSAGES_PER_SERVICE = 10_000
NUM_THREADS = 4
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DIMS = {"user": 4, "tags": 8}
SAMPLE_FIXED_SIZE = 3
KNOWN_IDS = np.arange(1, 129, dtype=np.uint64)
FUZZ_ID_BASE = 1 << 40  # fuzz ids live far from the known ones and are never inserted
NUM_DATA_LOADER_RANKS = 3  # ranks 0 and 1 are fuzzed; rank 2 ends the stream afterwards
OPTIMIZER = {"type": "adagrad", "lr": 0.1}
CONFIGURE = configure_request(OPTIMIZER, init_lower=-0.1, init_upper=0.1, weight_bound=None,
                              seed=5)
COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60,
                      max_message_bytes=MAX_MESSAGE_BYTES)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}

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


# -- mutations -------------------------------------------------------------------------------

class Mutator:
    """Random valid requests and the defects applied to them, from one seeded generator."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def choice(self, items):
        return items[int(self.rng.integers(len(items)))]

    def fuzz_ids(self, n: int) -> np.ndarray:
        return (FUZZ_ID_BASE + self.rng.integers(0, 1 << 30, n)).astype(np.uint64)

    def floats(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float32)

    def unknown_slot(self) -> str:
        return self.choice(["", "nope", "user ", "USER", "tags\x00", "ü" * 3, "x" * 300])

    # Tensor defects. Each returns False when it cannot break this tensor (caller retries).
    def break_tensor(self, t: common_pb2.Tensor, *, float_payload: bool) -> None:
        n_bytes = len(t.data)
        kinds = ["dtype", "shape", "extend", "lz4_garbage", "lz4_lie", "ndim"]
        if n_bytes:
            kinds += ["truncate", "truncate"]
        if float_payload and n_bytes:
            kinds += ["nan", "inf"]
        kind = self.choice(kinds)
        if kind == "dtype":
            wrong = ["float64", "int32", "int8", "bool", "", "object", "U8", "<u8", "uint64 ",
                     "float32" if t.dtype != "float32" else "uint64"]
            t.dtype = self.choice([d for d in wrong if d != t.dtype])
            if t.dtype in codec.WIRE_DTYPES and n_bytes % np.dtype(t.dtype).itemsize == 0 and (
                np.dtype(t.dtype).itemsize * int(np.prod(t.shape)) == n_bytes
            ):
                t.shape.append(2)  # same byte count: also break the shape
        elif kind == "shape":
            shape = list(t.shape)
            new = self.choice([[len(shape) and shape[0] + 1 or 1], [-1], [2**40], [2**62, 2**62],
                               [3, -3], [int(self.rng.integers(1, 2**31))], [2**31, 4]])
            t.ClearField("shape")
            t.shape.extend(new if new != shape else [*shape, 7])
        elif kind == "ndim":
            t.shape.append(1)
            t.shape.append(1)
        elif kind == "extend":
            t.data += self.rng.bytes(int(self.rng.integers(1, 33)))
        elif kind == "truncate":
            t.data = t.data[: int(self.rng.integers(0, n_bytes))]
        elif kind == "lz4_garbage":
            t.lz4 = True
            t.data = self.rng.bytes(int(self.rng.integers(1, 64)))
        elif kind == "lz4_lie":
            t.lz4 = True
            t.data = lz4.block.compress(t.data or b"\0", store_size=False)
            t.ClearField("shape")
            t.shape.append(1 << int(self.rng.integers(24, 31)))
        elif kind in ("nan", "inf"):
            values = np.frombuffer(t.data, np.float32).copy() if t.dtype == "float32" else None
            if values is None or not values.size:
                t.data = t.data[:-1]
                return
            values[int(self.rng.integers(values.size))] = np.nan if kind == "nan" else -np.inf
            t.data = values.tobytes()

    def noise_tensor(self, t: common_pb2.Tensor) -> None:
        """A mutation that may leave the tensor valid: random payload of the same size."""
        t.data = self.rng.bytes(len(t.data))

    def raw(self, message: bytes) -> bytes:
        """Byte-level damage to a serialized message."""
        kind = self.choice(["truncate", "flip", "append", "garbage", "empty"])
        if kind == "truncate" and message:
            return message[: int(self.rng.integers(0, len(message)))]
        if kind == "flip" and message:
            data = bytearray(message)
            for pos in self.rng.integers(0, len(data), int(self.rng.integers(1, 9))):
                data[pos] = int(self.rng.integers(256))
            return bytes(data)
        if kind == "append":
            return message + self.rng.bytes(int(self.rng.integers(1, 64)))
        if kind == "empty":
            return b""
        return self.rng.bytes(int(self.rng.integers(0, 512)))


# -- per-service message builders ------------------------------------------------------------

def _slot_ids_pairs(m: Mutator, ids_source: Callable[[int], np.ndarray]):
    slots = list(DIMS) if m.chance(0.6) else [m.choice(list(DIMS))]
    return [(slot, ids_source(int(m.rng.integers(1, 40)))) for slot in slots]


def ps_message(m: Mutator, state: dict, raw: bool) -> tuple[str, bytes]:
    method = m.choice(["Lookup"] * 5 + ["Update"] * 5
                      + ["Configure", "Stats", "Health", "Dump", "Load"])
    if method in ("Dump", "Load"):
        return checkpoint_message(m, method)
    if method == "Lookup":
        request = ps_pb.LookupRequest(
            tables=[ps_pb.TableIds(table=s, ids=codec.encode(ids))
                   for s, ids in _slot_ids_pairs(m, m.fuzz_ids)],
            training=not raw and m.chance(0.7), fp16=m.chance(0.3))
        if m.chance(0.01):  # an answer bigger than max_message_bytes
            request.tables[0].ids.CopyFrom(codec.encode(m.fuzz_ids(MAX_MESSAGE_BYTES // 16)))
            request.tables[0].table = "tags"
            request.fp16 = False
        elif request.training or m.chance(0.7):
            if m.chance(0.2):  # before the breaker, which it could otherwise undo
                m.noise_tensor(m.choice(request.tables).ids)
            entry = m.choice(request.tables)
            breaker = m.choice(["slot", "ids", "ids", "reserved"])
            if breaker == "slot":
                entry.table = m.unknown_slot()
            elif breaker == "reserved":
                ids = codec.decode(entry.ids)
                ids[int(m.rng.integers(ids.size))] = RESERVED_ID
                entry.ids.CopyFrom(codec.encode(ids))
            else:
                m.break_tensor(entry.ids, float_payload=False)
    elif method == "Update":
        # Known ids: an update that got through would change the checksum.
        # Known ids: an update that got through would change the checksum. Bytes to be
        # damaged carry fuzz ids: damage can drop or repair a breaker.
        pairs = _slot_ids_pairs(m, m.fuzz_ids if raw else lambda n: m.rng.choice(KNOWN_IDS, n))
        request = ps_pb.UpdateRequest(
            tables=[ps_pb.TableGradients(table=s, ids=codec.encode(ids),
                                       grads=codec.encode(m.floats((ids.size, DIMS[s])),
                                                          fp16=m.chance(0.3)))
                   for s, ids in pairs],
            worker_id=m.choice(["", "fuzz", m.rng.bytes(8).hex()]),
            sequence=int(m.rng.integers(0, 2**63)))
        entry = m.choice(request.tables)
        breaker = m.choice(["slot", "ids", "grads", "grads", "dim", "rows", "reserved"])
        if breaker == "slot":
            entry.table = m.unknown_slot()
        elif breaker == "ids":
            m.break_tensor(entry.ids, float_payload=False)
        elif breaker == "grads":
            m.break_tensor(entry.grads, float_payload=True)
        elif breaker == "reserved":
            ids = codec.decode(entry.ids)
            ids[0] = RESERVED_ID
            entry.ids.CopyFrom(codec.encode(ids))
        else:
            n = len(codec.decode(entry.ids))
            shape = (n, DIMS[entry.table] + 1) if breaker == "dim" else (n + 1, DIMS[entry.table])
            entry.grads.CopyFrom(codec.encode(m.floats(shape)))
    elif method == "Configure":
        request = common_pb2.ConfigureRequest()
        request.CopyFrom(CONFIGURE)
        kind = m.choice(["same", "lr", "json", "nested", "bounds", "seed", "bound"])
        if kind == "lr":
            request.optimizer_json = json.dumps({"type": "adagrad", "lr": float(m.rng.random())})
        elif kind == "json":
            request.optimizer_json = m.choice(["", "{", "[]", "null", '{"type": "nope"}',
                                               '{"type": "sgd", "lr": -1}', "\x00" * 9])
        elif kind == "nested":
            request.optimizer_json = "[" * 100_000 + "]" * 100_000
        elif kind == "bounds":
            request.init_lower, request.init_upper = m.choice([(np.nan, 1), (1, -1), (-np.inf, 0)])
        elif kind == "seed":
            request.seed = int(m.rng.integers(0, 2**63)) * 2 + 1
        elif kind == "bound":
            request.weight_bound = m.choice([-1.0, np.nan, np.inf, 1e-30])
    elif method == "Stats":
        request = ps_pb.StatsRequest()
    else:
        request = common_pb2.HealthRequest()
    return f"/persia_py.ParameterServer/{method}", request.SerializeToString()


CHECKPOINT_NAMES = ["", ".", "..", "../..", "/etc", "/tmp/x", "a/b", "x\x00y", "ckpt",
                    "escaping", "missing", "LATEST", "x" * 129, "y" * 5000, "caf\u00e9", "-x",
                    ".hidden", "ckpt/..", "\\", "%2e%2e"]
"""Dump and Load names: ``ckpt`` (an empty folder) and ``escaping`` (a manifest whose
files lie outside) exist in the fuzzed server's checkpoint root; no complete checkpoint
does, so no Load can change the rows."""


def checkpoint_message(m: Mutator, method: str) -> tuple[str, bytes]:
    request = (ckpt_pb.DumpRequest if method == "Dump" else ckpt_pb.LoadRequest)(
        folder=m.choice(CHECKPOINT_NAMES) if m.chance(0.3) else "",
        checkpoint=m.choice(CHECKPOINT_NAMES + [m.rng.bytes(6).hex()]))
    return f"/persia_py.ParameterServerCheckpoint/{method}", request.SerializeToString()


def _escaping_checkpoint(folder) -> None:
    """A complete-looking checkpoint whose description names files outside its folder."""
    folder.mkdir()
    files = {k: f"../../{k}.npy" for k in ("ids", "weights", "state", "last_access")}
    (folder / "ps-0.json").write_text(json.dumps({
        "replica_index": 0, "replica_size": 1, "settings": None, "seen": [],
        "tables": {"user": {"dim": DIMS["user"], "state_width": DIMS["user"], "num_rows": 1,
                            "clock": 1, "files": files}}}))
    (folder / "manifest.json").write_text(json.dumps(
        {"format": "persia_py-checkpoint", "version": 1, "step": 1, "num_ps_replicas": 1}))


def _batch_features(m: Mutator, batch_size: int) -> list[common_pb2.IdFeature]:
    features = []
    for slot in DIMS:
        high = SAMPLE_FIXED_SIZE + 1 if slot == "tags" else 3
        lengths = m.rng.integers(0, high, batch_size).astype(np.int32)
        features.append(codec.encode_id_feature(slot, m.fuzz_ids(int(lengths.sum())), lengths))
    return features


def _break_features(m: Mutator, features, request) -> None:
    """A defect that makes the embedding worker refuse a batch."""
    breaker = m.choice(["slot", "missing", "twice", "ids", "lengths", "sum", "negative",
                        "batch_size", "too_long", "reserved"])
    entry = m.choice(features)
    _, ids, lengths = codec.decode_id_feature(entry, "f")
    if breaker == "slot":
        entry.slot = m.unknown_slot()
    elif breaker == "missing":
        del features[int(m.rng.integers(len(features)))]
    elif breaker == "twice":
        features.append(entry)
    elif breaker == "ids":
        m.break_tensor(entry.ids, float_payload=False)
    elif breaker == "lengths":
        m.break_tensor(entry.lengths, float_payload=False)
    elif breaker in ("sum", "negative", "too_long") and lengths.size:
        if breaker == "sum":
            lengths[0] += 1
        elif breaker == "negative":
            lengths[0] = -1 - lengths[0]
            lengths[-1] += 1 + 2 * int(lengths[0] == lengths[-1]) if lengths.size > 1 else 0
        else:
            entry.slot = "tags"
            lengths[0] = SAMPLE_FIXED_SIZE + 1
            ids = m.fuzz_ids(int(lengths.clip(0).sum()))
        entry.CopyFrom(codec.encode_id_feature(entry.slot, ids, lengths))
    elif breaker == "reserved" and ids.size:
        ids[int(m.rng.integers(ids.size))] = RESERVED_ID
        entry.ids.CopyFrom(codec.encode(ids))
    else:
        request.batch_size = m.choice([request.batch_size + 1, request.batch_size - 1, 0, -5,
                                       2**31 - 1])


def ew_message(m: Mutator, state: dict, raw: bool) -> tuple[str, bytes]:
    method = m.choice(["PutBatch"] * 4 + ["LookupDirect"] * 3 + ["UpdateGradients"] * 4
                      + ["Lookup"] * 2 + ["Configure", "Health"])
    if method in ("PutBatch", "LookupDirect"):
        batch_size = int(m.rng.integers(1, 9))
        cls = ew_pb.PutBatchRequest if method == "PutBatch" else ew_pb.LookupDirectRequest
        request = cls(batch_size=batch_size)
        features = _batch_features(m, batch_size)
        if m.chance(0.005):  # a batch whose answer could not be sent
            n = MAX_MESSAGE_BYTES // 20
            features = [codec.encode_id_feature(s, m.fuzz_ids(n), np.array([n], np.int32))
                        for s in ("user",)] + [codec.encode_id_feature(
                            "tags", m.fuzz_ids(1), np.array([1], np.int32))]
            request.batch_size = 1
        elif method == "PutBatch" or m.chance(0.8):
            _break_features(m, features, request)
        if method == "PutBatch":
            request.requires_grad = m.chance(0.7)
        request.features.extend(features)
    elif method == "UpdateGradients":
        # The held batch: gradients that got through would update the known ids.
        ref = state["ref"] if not raw else state["ref"] + 10**7
        slots = [ew_pb.SlotRowGradients(slot=s, grads=codec.encode(m.floats((n, DIMS[s]))))
                 for s, n in state["unique"].items()]
        request = ew_pb.UpdateGradientsRequest(ref=ref, slots=slots)
        slots = request.slots  # the request holds copies: mutate those
        if m.chance(0.2):  # NaN rides along; the embedding worker skips such a slot
            m.break_tensor(m.choice(slots).grads, float_payload=True)
        breaker = m.choice(["slot", "missing", "twice", "grads", "grads", "dim", "rows", "ref"])
        entry = m.choice(slots)
        if breaker == "slot":
            entry.slot = m.unknown_slot()
        elif breaker == "missing":
            del request.slots[int(m.rng.integers(len(request.slots)))]
        elif breaker == "twice":
            request.slots.append(entry)
        elif breaker == "grads":
            m.break_tensor(entry.grads, float_payload=False)
        elif breaker in ("dim", "rows"):
            n = state["unique"][entry.slot]
            dim = DIMS[entry.slot]
            entry.grads.CopyFrom(codec.encode(m.floats((n, dim + 1) if breaker == "dim"
                                                       else (n + 1, dim))))
        else:
            request.ref = m.choice([0, 2**64 - 1, ref + 1000 + int(m.rng.integers(1, 10**6)),
                                    int(m.rng.integers(2**63, 2**64 - 1, dtype=np.uint64))])
    elif method == "Lookup":
        request = ew_pb.LookupBatchRequest(ref=m.choice([
            state["ref"], 0, 2**64 - 1, state["ref"] + 1000 + int(m.rng.integers(1, 10**6)),
            int(m.rng.integers(2**63, 2**64 - 1, dtype=np.uint64))]))
    elif method == "Configure":
        request = common_pb2.ConfigureRequest()
        request.CopyFrom(CONFIGURE)
        if m.chance(0.7):
            request.optimizer_json = m.choice(['{"type": "sgd", "lr": 1}', "{", "[" * 50_000])
    else:
        request = common_pb2.HealthRequest()
    return f"/persia_py.EmbeddingWorker/{method}", request.SerializeToString()


def dl_message(m: Mutator, state: dict, raw: bool) -> tuple[str, bytes]:
    if m.chance(0.1):
        return "/persia_py.DataLoader/Health", common_pb2.HealthRequest().SerializeToString()
    rank = m.choice([0, 1, -1, NUM_DATA_LOADER_RANKS, 2**31 - 1, -(2**31),
                     int(m.rng.integers(-(2**31), 2**31))])
    if rank == NUM_DATA_LOADER_RANKS - 1:
        rank = 0
    return ("/persia_py.DataLoader/NextBatch",
            data_loader_pb2.NextBatchRequest(rank=rank).SerializeToString())


def _parse(cls, message: bytes):
    try:
        return cls.FromString(message)
    except Exception:  # noqa: BLE001 - undecodable is fine: the server refuses it
        return None


def ps_harmless(method: str, message: bytes, state: dict) -> bool:
    """False when damaged bytes parse as a training lookup or an update of known ids."""
    if method.endswith("/Lookup"):
        request = _parse(ps_pb.LookupRequest, message)
        return request is None or not request.training
    if method.endswith("/Update"):
        request = _parse(ps_pb.UpdateRequest, message)
        for entry in request.tables if request is not None else ():
            ids = np.frombuffer(entry.ids.data[: len(entry.ids.data) // 8 * 8], np.uint64)
            if np.isin(ids, KNOWN_IDS).any():
                return False
    return True


def ew_harmless(method: str, message: bytes, state: dict) -> bool:
    """False when damaged bytes parse as gradients for the held batch."""
    if method.endswith("/UpdateGradients"):
        request = _parse(ew_pb.UpdateGradientsRequest, message)
        return request is None or request.ref != state["ref"]
    return True


def dl_harmless(method: str, message: bytes, state: dict) -> bool:
    """False when damaged bytes parse as a call for the last rank, kept to end the stream."""
    request = _parse(data_loader_pb2.NextBatchRequest, message)
    return request is None or request.rank != NUM_DATA_LOADER_RANKS - 1


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
    _escaping_checkpoint(checkpoints / "escaping")
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
                                              np.array([300_000], np.int32)) for s in DIMS],
            batch_size=1).SerializeToString(), invalid, "over max_message_bytes"),
    ]
    entries = _checksum(c["ps"])[0]
    for address, method, message, code, needle in cases:
        got, details = _refusal(address, method, message)
        assert got == code and needle in details, (method, got, details)
    assert _checksum(c["ps"])[0] == entries
