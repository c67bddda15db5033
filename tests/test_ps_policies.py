"""Per-slot table policies (admission, minimum occurrences, expiry, per-slot optimizer),
the numba kernels against their numpy references, and the pre-serialized Lookup answer."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.config import embedding_config_from_dict, global_config_from_dict
from persia_py.ids.routing import mix64
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.servers.initializer import initial_rows
from persia_py.servers.optimizers import (
    AdagradConfig,
    AdamConfig,
    SGDConfig,
    apply_update,
    initial_state,
)
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.storage import STAT_KEYS, EmbeddingTable
from persia_py.wire import codec

DIM = 8


def _table(**kwargs) -> EmbeddingTable:
    kwargs.setdefault("dim", DIM)
    kwargs.setdefault("optimizer", SGDConfig(lr=0.1))
    return EmbeddingTable(**kwargs)


def _stored(table: EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    present = np.zeros(ids.shape[0], dtype=np.bool_)
    for shard in table._shards:
        present |= shard.index.find(ids) >= 0
    return present


# --- kernels against numpy ------------------------------------------------------------


def _numpy_initial_rows(ids, dim, lower, upper, seed):
    """The original all-numpy initializer: the numba kernel must match it bit for bit."""
    lo, hi = np.float32(lower), np.float32(upper)
    key = mix64(ids, seed)
    columns = mix64(np.arange(dim, dtype=np.uint64), np.uint64(0x452821E638D01377))
    bits = mix64(key[:, None] ^ columns[None, :])
    unit = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    out = lo + (hi - lo) * unit
    np.minimum(out, np.nextafter(hi, lo), out=out)
    return out


@pytest.mark.parametrize(("lower", "upper", "seed", "dim"),
                         [(-0.01, 0.01, 0, 32), (-1.0, 1.0, 2**63 + 5, 7), (0.0, 1e-30, 3, 1),
                          (1.0, 1.0000001, 9, 5)])
def test_initial_rows_bit_identical_to_numpy(lower, upper, seed, dim) -> None:
    ids = np.random.default_rng(seed % 1000).integers(0, 2**64 - 1, 5000, dtype=np.uint64)
    got = initial_rows(ids, dim, lower, upper, seed)
    want = _numpy_initial_rows(ids, dim, lower, upper, seed)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(
    "cfg",
    [SGDConfig(lr=0.3, weight_decay=0.1),
     AdagradConfig(lr=0.2, weight_decay=0.05, initial_accumulator_value=0.1),
     AdagradConfig(lr=0.2, vectorwise_shared=True, g_square_momentum=0.9),
     AdamConfig(lr=0.05, betas=(0.7, 0.9), weight_decay=0.1, eps=1e-6)],
    ids=repr)
@pytest.mark.parametrize("num_shards", [1, 3])
def test_fused_kernels_match_apply_update_with_clamp(cfg, num_shards) -> None:
    """Several steps with repeats and an unknown id, clamped: the numpy path, row by row."""
    bound = 0.05
    table = _table(optimizer=cfg, num_shards=num_shards, init_lower=-0.04, init_upper=0.04,
                   weight_bound=bound)
    ids = np.arange(1, 41, dtype=np.uint64)
    weights = table.lookup(ids, True).copy()
    state = initial_state(cfg, ids.shape[0], DIM)
    rng = np.random.default_rng(4)
    try:
        for _ in range(5):
            batch = np.concatenate([rng.choice(ids, 30), np.array([999], dtype=np.uint64)])
            grads = rng.normal(size=(batch.shape[0], DIM)).astype(np.float32)
            assert table.update(batch, grads) == np.unique(batch[:-1]).shape[0]
            summed = np.zeros_like(weights)
            np.add.at(summed, (batch[:-1] - 1).astype(np.int64), grads[:-1])
            touched = np.unique(batch[:-1] - 1).astype(np.int64)
            new_w, new_s = apply_update(cfg, weights[touched], state[touched], summed[touched])
            weights[touched] = np.clip(new_w, -bound, bound)
            state[touched] = new_s
            np.testing.assert_allclose(table.lookup(ids, False), weights, rtol=1e-5, atol=1e-6)
        assert np.abs(weights).max() == pytest.approx(bound)
        assert not _stored(table, np.array([999], dtype=np.uint64)).any()
    finally:
        table.close()


# --- admission --------------------------------------------------------------------------


def test_admit_probability_fraction_zeros_and_dropped_updates() -> None:
    table = _table(admit_probability=0.25, seed=3, init_lower=-1.0, init_upper=1.0)
    ids = np.arange(1, 20001, dtype=np.uint64)
    out = table.lookup(ids, True)
    stored = _stored(table, ids)
    assert 0.22 < stored.mean() < 0.28
    np.testing.assert_array_equal(out[~stored], 0.0)
    np.testing.assert_array_equal(out[stored], initial_rows(ids[stored], DIM, -1.0, 1.0, 3))
    stats = table.stats()
    assert stats["admitted"] == stats["inserted"] == stored.sum() == stats["entries"]
    assert stats["rejected"] == ids.shape[0] - stored.sum()
    # Gradients of ids not stored are dropped: nothing is created, stored rows move.
    assert table.update(ids, np.ones((ids.shape[0], DIM), np.float32)) == stored.sum()
    assert table.num_entries == stored.sum()
    # Same calls, same seed: the same choice (reproducible); another seed differs.
    twin = _table(admit_probability=0.25, seed=3)
    twin.lookup(ids, True)
    np.testing.assert_array_equal(_stored(twin, ids), stored)
    other = _table(admit_probability=0.25, seed=4)
    other.lookup(ids, True)
    assert not np.array_equal(_stored(other, ids), stored)


def test_admit_probability_lets_frequent_ids_in() -> None:
    table = _table(admit_probability=0.5)
    ids = np.arange(1, 2001, dtype=np.uint64)
    for _ in range(10):  # each lookup is a new draw: 1 - 0.5**10 get in
        table.lookup(ids, True)
    assert _stored(table, ids).mean() > 0.99


@pytest.mark.parametrize("num_shards", [1, 2])
def test_min_occurrences(num_shards) -> None:
    table = _table(min_occurrences=3, num_shards=num_shards, init_lower=-1.0, init_upper=1.0)
    a, b = np.arange(1, 101, dtype=np.uint64), np.arange(1001, 1101, dtype=np.uint64)
    try:
        for _ in range(2):
            np.testing.assert_array_equal(table.lookup(a, True), 0.0)
        assert table.num_entries == 0 and table.update(a, np.ones((100, DIM), np.float32)) == 0
        table.lookup(b, True)  # b seen once
        third = table.lookup(np.concatenate([a, a[:5]]), True)  # repeats count once
        np.testing.assert_array_equal(third[:100], initial_rows(a, DIM, -1.0, 1.0, 0))
        assert _stored(table, a).all() and not _stored(table, b).any()
        stats = table.stats()
        assert (stats["admitted"], stats["rejected"], stats["entries"]) == (100, 300, 100)
        assert stats["bytes"] > table._shards[0].admission.sketch.nbytes
    finally:
        table.close()


# --- expiry -----------------------------------------------------------------------------


def test_expire_after_steps() -> None:
    table = _table(expire_after_steps=2)
    x, y = np.array([1], dtype=np.uint64), np.array([2], dtype=np.uint64)
    table.lookup(x, True)            # step 1: x
    table.lookup(y, True)            # step 2
    table.update(x, np.ones((1, DIM), np.float32))  # an update touches x (at step 2)
    table.lookup(y, True)            # step 3
    table.lookup(y, True)            # step 4: x unseen during steps 3, 4 ...
    assert _stored(table, x).all()
    table.lookup(y, True)            # step 5: ... and now 3 steps: gone
    assert not _stored(table, x).any() and _stored(table, y).all()
    assert table.stats()["expired"] == 1 and table.stats()["evicted"] == 0
    # Expired means forgotten: it comes back fresh.
    np.testing.assert_array_equal(table.lookup(x, True), initial_rows(x, DIM, -0.01, 0.01, 0))


def test_expire_after_seconds_with_injected_clock() -> None:
    now = [100.0]
    table = _table(expire_after_seconds=10.0, num_shards=2, clock=lambda: now[0])
    old, new = np.arange(1, 50, dtype=np.uint64), np.arange(100, 150, dtype=np.uint64)
    try:
        table.lookup(old, True)
        now[0] = 105.0
        table.lookup(new, True)
        now[0] = 110.5
        table.lookup(new[:1], False)
        assert not _stored(table, old).any() and _stored(table, new).all()
        now[0] = 116.0
        table.lookup(new[:1], False)   # new[0] was read at 110.5; the rest at 105
        assert _stored(table, new[:1]).all() and not _stored(table, new[1:]).any()
        assert table.stats()["expired"] == old.shape[0] + new.shape[0] - 1
    finally:
        table.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"admit_probability": 0.0}, "admit_probability"),
     ({"admit_probability": 1.5}, "admit_probability"),
     ({"min_occurrences": 0}, "min_occurrences"),
     ({"min_occurrences": 256}, "min_occurrences"),
     ({"expire_after_steps": 0}, "expire_after_steps"),
     ({"expire_after_seconds": -1.0}, "expire_after_seconds")])
def test_bad_policies_rejected(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        _table(**kwargs)


# --- parameter server: per-slot policies and stats -----------------------------------


def test_configure_applies_slot_policies_and_optimizer() -> None:
    embedding = embedding_config_from_dict({"slots_config": {
        "plain": {"dim": 4},
        "tuned": {"dim": 4, "admit_probability": 0.5, "min_occurrences": 2,
                  "expire_after_steps": 100, "expire_after_seconds": 60.0,
                  "optimizer": {"type": "adam", "lr": 0.001, "betas": [0.8, 0.99]}},
    }})
    ps = ParameterServer(global_config_from_dict({}), embedding)
    try:
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1})
        plain, tuned = ps._tables["plain"], ps._tables["tuned"]
        assert plain.optimizer == AdagradConfig(lr=0.1) and plain.admit_probability == 1.0
        assert tuned.optimizer == AdamConfig(lr=0.001, betas=(0.8, 0.99))
        assert (tuned.admit_probability, tuned.min_occurrences, tuned.expire_after_steps,
                tuned.expire_after_seconds) == (0.5, 2, 100, 60.0)
        stats = ps.stats()
        assert set(stats["tuned"]) == set(STAT_KEYS)
        message = pb.TableStats(table="tuned", **stats["tuned"])  # every key has a field
        assert message.admitted == 0 and message.expired == 0
    finally:
        ps.close()


def test_a_checkpoint_of_the_old_adagrad_default_is_refused_with_the_way_on() -> None:
    """Adagrad's initial accumulator defaulted to 0.01 before it became torch's 0: tables
    configured so (a checkpoint written then) refuse the new default, saying what to pass."""
    embedding = embedding_config_from_dict({"slots_config": {"a": {"dim": 4}}})
    ps = ParameterServer(global_config_from_dict({}), embedding)
    try:
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1, "initial_accumulator_value": 0.01})
        with pytest.raises(RuntimeError, match=r"differ only in Adagrad's initial_accumulator_"
                                               r"value.*initial_accumulator_value=0\.01\)"):
            ps.configure(optimizer={"type": "adagrad", "lr": 0.1})
        with pytest.raises(RuntimeError, match="different settings") as refused:
            ps.configure(optimizer={"type": "adagrad", "lr": 0.2})  # another difference too
        assert "differ only" not in str(refused.value)
    finally:
        ps.close()


# --- wire -------------------------------------------------------------------------------


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("lz4", [False, True])
def test_lookup_answer_same_as_encoded_message(fp16, lz4) -> None:
    """Lookup's pre-serialized answer decodes exactly like the plain message path."""
    from persia_py.servers.service import ParameterServerServicer

    embedding = embedding_config_from_dict({"slots_config": {"a": {"dim": 5}, "b": {"dim": 3}}})
    ps = ParameterServer(global_config_from_dict({}), embedding)
    ps.configure(optimizer={"type": "sgd", "lr": 0.1}, init_lower=-1.0, init_upper=1.0)
    ids = np.arange(1, 50, dtype=np.uint64)
    request = pb.LookupRequest(tables=[pb.TableIds(table="a", ids=codec.encode(ids)),
                                      pb.TableIds(table="b", ids=codec.encode(ids[:0]))],
                               training=True, fp16=fp16, lz4=lz4)
    try:
        answer = ParameterServerServicer(ps).Lookup(request, None)
        data = answer if isinstance(answer, bytes) else answer.SerializeToString()
        got = [codec.decode(t) for t in pb.LookupResponse.FromString(data).embeddings]
        want = ps.lookup([("a", ids), ("b", ids[:0])], training=False)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == (np.float16 if fp16 else np.float32)
            np.testing.assert_array_equal(g, w.astype(g.dtype))
    finally:
        ps.close()
