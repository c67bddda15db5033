"""PERSIA's slot features: hash stacking, feature groups sharing one table, id prefixes.

The embedding worker talks to in-process parameter servers (no gRPC), so these run in
well under a second; the wire field that carries hash stacking is checked separately.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia_py.config import CommonConfig, ConfigError, GlobalConfig, embedding_config_from_dict
from persia_py.ids.routing import hash_stack
from persia_py.proto import embedding_worker_pb2
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.service import configure_args
from persia_py.wire import codec
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.embedding_worker_service import _decode_rows, _encode_rows
from persia_py.workers.pooling import pool_slot
from persia_py.workers.ps_client import configure_request

LR = 0.5
ROUNDS, SIZE = 3, 8


class _DirectClient:
    """A PSClient look-alike that calls a ParameterServer in this process."""

    def __init__(self, ps: ParameterServer) -> None:
        self.ps = ps

    def configure(self, request) -> None:
        self.ps.configure(**configure_args(request))

    def lookup(self, slots, *, training: bool, as_float32: bool = True):
        return self.ps.lookup(slots, training=training)

    def update(self, slots, *, worker_id: str, sequence: int, resend: bool = False) -> int:
        return self.ps.update(slots, worker_id=worker_id, sequence=sequence)[0]

    def close(self) -> None:
        pass


def _cluster(config: dict, num_replicas: int = 2) -> tuple[EmbeddingWorker, list[ParameterServer]]:
    emb = embedding_config_from_dict(config)
    servers = [ParameterServer(GlobalConfig(), emb, replica_index=i, replica_size=num_replicas)
               for i in range(num_replicas)]
    worker = EmbeddingWorker(GlobalConfig(), emb, [_DirectClient(ps) for ps in servers])
    worker.configure(configure_request({"type": "sgd", "lr": LR}, init_lower=-0.1,
                                       init_upper=0.1, weight_bound=None, seed=3))
    return worker, servers


def _entries(servers: list[ParameterServer], table: str) -> int:
    return sum(ps.stats()[table]["entries"] for ps in servers)


def _feature(slot: str, ids, lengths=None) -> SlotIds:
    ids = np.asarray(ids, np.uint64)
    lengths = np.ones(ids.size, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    return SlotIds(slot, ids, lengths)


def _stored_rows(worker: EmbeddingWorker, slot: str, raw_ids) -> np.ndarray:
    """The rows a slot's raw ids map to, read from the servers without inserting."""
    stack = worker.embedding_config.slots_config[slot].hash_stack_config
    ids = np.asarray(raw_ids, np.uint64)
    if stack.hash_stack_rounds:
        ids = hash_stack(ids, stack.hash_stack_rounds, stack.embedding_size)
    table = worker.embedding_config.table_of(slot)
    return worker._lookup_tables({table: worker._prefixed(slot, ids)}, training=False)[table]


def _pooled(worker: EmbeddingWorker, features: list[SlotIds],
            batch_size: int) -> tuple[int, dict]:
    """Put and look up a training batch: its ref and, per slot, (SlotRows, pooled tensor)."""
    ref = worker.put_batch(features, batch_size, True)
    slots = worker.lookup(ref)
    return ref, {s.slot: (s, pool_slot(torch.from_numpy(s.rows), s).numpy()) for s in slots}


STACKED = {"slots_config": {
    "stacked": {"dim": 4, "hash_stack_config": {"hash_stack_rounds": ROUNDS,
                                                "embedding_size": SIZE}},
    "seq": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3,
            "hash_stack_config": {"hash_stack_rounds": ROUNDS, "embedding_size": SIZE}},
    "mean": {"dim": 4, "pooling": "mean", "sqrt_scaling": True,
             "hash_stack_config": {"hash_stack_rounds": ROUNDS, "embedding_size": SIZE}},
}}


# -- hash stacking ----------------------------------------------------------------------

def test_hash_stack_is_deterministic_and_rounds_use_disjoint_buckets() -> None:
    ids = np.arange(10_000, dtype=np.uint64) * np.uint64(0x9E3779B1)
    stacked = hash_stack(ids, ROUNDS, SIZE).reshape(-1, ROUNDS)
    np.testing.assert_array_equal(stacked.reshape(-1), hash_stack(ids, ROUNDS, SIZE))
    for r in range(ROUNDS):
        assert stacked[:, r].min() == r * SIZE and stacked[:, r].max() == (r + 1) * SIZE - 1
    # Rounds hash differently: ids colliding in round 0 mostly part in round 1.
    same0 = stacked[:, 0] == stacked[0, 0]
    assert len(np.unique(stacked[same0, 1])) > 1


def test_stacked_table_never_exceeds_rounds_times_embedding_size() -> None:
    worker, servers = _cluster(STACKED)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = rng.integers(0, 2**63, size=2000, dtype=np.uint64)
        features = [_feature("stacked", ids), _feature("seq", ids), _feature("mean", ids)]
        ref, slots = _pooled(worker, features, ids.size)
        worker.update_gradients(ref, {s: np.ones_like(v[0].rows) for s, v in slots.items()})
    for table in ("stacked", "seq", "mean"):
        assert _entries(servers, table) == ROUNDS * SIZE  # 10,000 distinct ids, 24 rows


def test_pooled_embedding_of_an_id_is_the_sum_of_its_stacked_rows() -> None:
    worker, _ = _cluster(STACKED)
    a, b = 123456789, 987654321
    features = [_feature("stacked", [a, a, b], [1, 2]), _feature("seq", [a, b, a], [3, 0]),
                _feature("mean", [a, b], [2, 0])]
    _, slots = _pooled(worker, features, 2)
    emb_a = _stored_rows(worker, "stacked", [a]).reshape(ROUNDS, 4).sum(0)
    emb_b = _stored_rows(worker, "stacked", [b]).reshape(ROUNDS, 4).sum(0)
    slot, pooled = slots["stacked"]
    assert slot.hash_stack_rounds == ROUNDS and slot.rows.shape[0] <= 2 * ROUNDS
    np.testing.assert_allclose(pooled, [emb_a, emb_a + emb_b], rtol=1e-6)

    # Raw sequences: one vector per id, the sum of its rounds.
    seq_a = _stored_rows(worker, "seq", [a]).reshape(ROUNDS, 4).sum(0)
    seq_b = _stored_rows(worker, "seq", [b]).reshape(ROUNDS, 4).sum(0)
    _, seq = slots["seq"]
    assert seq.shape == (2, 3, 4)
    np.testing.assert_allclose(seq[0], [seq_a, seq_b, seq_a], rtol=1e-6)
    np.testing.assert_array_equal(seq[1], 0)

    # Mean and sqrt_scaling count ids, not stacked rows: (a + b) / 2 / sqrt(2).
    m_a = _stored_rows(worker, "mean", [a]).reshape(ROUNDS, 4).sum(0)
    m_b = _stored_rows(worker, "mean", [b]).reshape(ROUNDS, 4).sum(0)
    np.testing.assert_allclose(slots["mean"][1], [(m_a + m_b) / 2 / np.sqrt(2), np.zeros(4)],
                               rtol=1e-5)


def test_stacked_rows_are_trained_and_shared_by_colliding_ids() -> None:
    worker, _ = _cluster(STACKED)
    a = 42
    features = [_feature("stacked", [a]), _feature("seq", [a]), _feature("mean", [a])]
    ref, slots = _pooled(worker, features, 1)
    before = _stored_rows(worker, "stacked", [a])
    rows = torch.from_numpy(slots["stacked"][0].rows.copy()).requires_grad_(True)
    pool_slot(rows, slots["stacked"][0]).sum().backward()
    grads = {s: np.zeros_like(v[0].rows) for s, v in slots.items()}
    grads["stacked"] = rows.grad.numpy()
    worker.update_gradients(ref, grads)
    # Each of the id's rounds got the pooled gradient (1), so each row moved by -LR.
    np.testing.assert_allclose(_stored_rows(worker, "stacked", [a]), before - LR, rtol=1e-6)


def test_hash_stacking_is_deterministic_across_clusters() -> None:
    ids = np.array([7, 8, 9, 7], np.uint64)
    outs = []
    for n in (1, 3):
        worker, _ = _cluster(STACKED, num_replicas=n)
        _, slots = _pooled(worker, [_feature("stacked", ids), _feature("seq", ids),
                                    _feature("mean", ids)], ids.size)
        outs.append(slots["stacked"][1])
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0][0], outs[0][3])
    assert outs[0].any()


def test_hash_stack_rounds_travel_on_the_wire() -> None:
    worker, _ = _cluster(STACKED)
    answer = worker.lookup_direct([_feature(s, [1, 2]) for s in STACKED["slots_config"]], 2)
    rows = next(r for r in answer if r.slot == "seq")
    answer = _encode_rows([rows], embedding_worker_pb2.WireOptions())
    (back,) = _decode_rows(codec.parse(embedding_worker_pb2.LookupBatchResponse, answer))
    assert back.hash_stack_rounds == ROUNDS
    np.testing.assert_array_equal(back.index, rows.index)


# -- feature groups and prefixes ----------------------------------------------------------

GROUPED = {
    "slots_config": {"a": {"dim": 4}, "b": {"dim": 4, "embedding_summation": False},
                     "c": {"dim": 4}},
    "feature_groups": {"g": ["a", "b"]},
    "feature_index_prefix_bit": 4,
}


def test_slots_of_a_group_share_one_table_and_rows_for_equal_ids() -> None:
    worker, servers = _cluster(GROUPED)
    assert set(servers[0].stats()) == {"g", "c"}
    features = [_feature("a", [5, 6]), _feature("b", [5, 7]), _feature("c", [5, 6])]
    ref, slots = _pooled(worker, features, 2)
    a, b, c = (slots[s][1] for s in "abc")
    np.testing.assert_array_equal(a[0], b[0, 0])  # id 5 in a and in b: one row
    assert not np.array_equal(a[0], c[0])  # c is another group (prefix), another row
    assert _entries(servers, "g") == 3 and _entries(servers, "c") == 2

    g_before = _stored_rows(worker, "a", [5])
    c_before = _stored_rows(worker, "c", [5])
    grads = {s: np.ones_like(v[0].rows) for s, v in slots.items()}
    grads["b"] = 2 * grads["b"]
    worker.update_gradients(ref, grads)
    # Row 5 of g got a's gradient (1) and b's (2), applied as one summed update.
    np.testing.assert_allclose(_stored_rows(worker, "a", [5]), g_before - LR * 3.0, rtol=1e-6)
    np.testing.assert_allclose(_stored_rows(worker, "c", [5]), c_before - LR, rtol=1e-6)


def test_prefix_is_the_feature_group_index() -> None:
    worker, _ = _cluster(GROUPED)
    emb = worker.embedding_config
    assert [emb.slot_prefix(s) for s in "abc"] == [1, 1, 2]
    assert emb.table_of("b") == "g" and emb.table_of("c") == "c"
    raw = np.array([5, (1 << 63) | 5], np.uint64)  # top bits of a raw id are replaced
    checked = worker.validate_features([_feature(s, raw) for s in "abc"], 2)
    ids = {f.slot: f.ids for f in checked}
    np.testing.assert_array_equal(ids["a"], [(1 << 60) | 5] * 2)
    np.testing.assert_array_equal(ids["b"], ids["a"])
    np.testing.assert_array_equal(ids["c"], [(2 << 60) | 5] * 2)


def test_without_groups_the_prefix_is_the_slot_index() -> None:
    emb = embedding_config_from_dict({"slots_config": {"x": {"dim": 2}, "y": {"dim": 2}},
                                      "feature_index_prefix_bit": 2})
    assert [emb.slot_prefix("x"), emb.slot_prefix("y")] == [1, 2]
    assert emb.tables == {"x": ["x"], "y": ["y"]}


def test_a_group_saves_prefix_bits() -> None:
    slots = {s: {"dim": 2} for s in "pqr"}
    with pytest.raises(ConfigError, match="1 bits cannot number 3 feature groups"):
        embedding_config_from_dict({"slots_config": slots, "feature_index_prefix_bit": 1})
    emb = embedding_config_from_dict({"slots_config": slots, "feature_index_prefix_bit": 1,
                                      "feature_groups": {"all": ["p", "q", "r"]}})
    assert {emb.slot_prefix(s) for s in "pqr"} == {1}


@pytest.mark.parametrize("extra, message", [
    ({"feature_groups": {"g": ["a", "bb"]}},
     "feature_groups.g: unknown slot 'bb' (slots: ['a', 'b', 'c', 'wide']); did you mean 'b'?"),
    ({"feature_groups": {"g": ["a", "b"], "h": ["b", "c"]}},
     "feature_groups.h: slot 'b' is also in group 'g'"),
    ({"feature_groups": {"g": ["a", "a"]}}, "slot 'a' is twice in this group"),
    ({"feature_groups": {"g": ["a", "wide"]}},
     "feature_groups.g: slots ['a', 'wide'] share one table, so their dim must be equal; "
     "got {'a': 4, 'wide': 8}"),
    ({"feature_groups": {"c": ["a", "b"]}}, "feature_groups.c: the group is named like slot 'c'"),
    ({"feature_groups": {"g": []}}, "feature_groups.g: a group needs at least one slot"),
    ({"feature_groups": {"g": "a"}}, "feature_groups.g: expected a list"),
])
def test_feature_group_errors(extra: dict, message: str) -> None:
    config = {"slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 4},
                               "wide": {"dim": 8}}, **extra}
    with pytest.raises(ConfigError) as info:
        embedding_config_from_dict(config)
    assert message in str(info.value)


@pytest.mark.parametrize("stack, message", [
    ({"hash_stack_rounds": 2}, "slots_config.s.hash_stack_config.embedding_size: required"),
    ({"embedding_size": 8}, "hash_stack_config.hash_stack_rounds: 0 (off), but embedding_size"),
    ({"rounds": 2, "embedding_size": 8},
     "slots_config.s.hash_stack_config.rounds: unknown key"),
    ({"hash_stack_rounds": 65, "embedding_size": 8}, "hash_stack_rounds: 65 is out of range"),
])
def test_hash_stack_config_errors(stack: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        embedding_config_from_dict({"slots_config": {"s": {"dim": 4, "hash_stack_config": stack}}})
    assert message in str(info.value)


def test_capacity_of_a_group_must_agree() -> None:
    with pytest.raises(ConfigError, match="their capacity must be equal"):
        embedding_config_from_dict({
            "slots_config": {"a": {"dim": 4, "capacity": 10}, "b": {"dim": 4}},
            "feature_groups": {"g": ["a", "b"]},
        })


def test_a_lookup_answer_is_sized_by_its_distinct_rows_and_refused_whole() -> None:
    """A batch of many repeated ids fits a message its ids would not, counted as distinct
    rows; one whose distinct rows do not fit is refused before anything is kept."""
    limit, batch, per_sample = 4 << 20, 8192, 32
    emb = embedding_config_from_dict({"slots_config": {"user": {"dim": 64}}})
    config = GlobalConfig(common_config=CommonConfig(max_message_bytes=limit))
    ps = ParameterServer(config, emb, replica_index=0, replica_size=1)
    worker = EmbeddingWorker(config, emb, [_DirectClient(ps)])
    worker.configure(configure_request({"type": "sgd", "lr": LR}, init_lower=-0.1,
                                       init_upper=0.1, weight_bound=None, seed=3))
    lengths = np.full(batch, per_sample, np.int32)
    repeated = np.arange(batch * per_sample, dtype=np.uint64) % 100 + 1
    assert repeated.size * (4 * 64 + 8) > limit  # every id a row of its own would not fit
    (rows,) = worker.lookup(worker.put_batch([_feature("user", repeated, lengths)], batch, True))
    assert rows.rows.shape == (100, 64) and rows.index.size == repeated.size
    distinct = np.arange(1, batch * per_sample + 1, dtype=np.uint64) + 1000
    for attempt in (lambda f: worker.put_batch(f, batch, True),
                    lambda f: worker.lookup_direct(f, batch)):
        with pytest.raises(ValueError, match=r"lookup answer would take \d+ bytes, over "
                                             rf"max_message_bytes {limit}"):
            attempt([_feature("user", distinct, lengths)])
    assert worker.num_pending == 1 and _entries([ps], "user") == 100
