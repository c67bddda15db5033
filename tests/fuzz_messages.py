"""The fuzzer's messages (tests/test_fuzz.py): valid requests of every service mutated,
each one that could change the tables carrying at least one *breaker*, a defect that must
make the server refuse the whole request, and what each service may answer. Seeds are
fixed by the test, so a failure repeats.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import lz4.block
import numpy as np

from persia_py.config import CommonConfig
from persia_py.ids.routing import RESERVED_ID
from persia_py.proto import checkpoint_pb2 as ckpt_pb
from persia_py.proto import common_pb2, data_loader_pb2
from persia_py.proto import embedding_worker_pb2 as ew_pb
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.wire import codec
from persia_py.workers.ps_client import configure_request

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


def escaping_checkpoint(folder) -> None:
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
