"""EmbeddingTable storage semantics, plus its hash index and initializer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from persia_py.ids.hashing import HASH_STACK_SALT, inverse_mix64, mix64
from persia_py.ids.routing import RESERVED_ID
from persia_py.servers import memory
from persia_py.servers.hash_index import HashIndex
from persia_py.servers.initializer import initial_rows
from persia_py.servers.optimizers import AdagradConfig, SGDConfig
from persia_py.servers.storage import EmbeddingTable

DIM = 8
PROBE_BOUND = 128
"""Far above the longest run of occupied slots random ids make at load 1/2 (~40)."""


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def _table(**kwargs) -> EmbeddingTable:
    kwargs.setdefault("dim", DIM)
    kwargs.setdefault("optimizer", SGDConfig(lr=0.1))
    return EmbeddingTable(**kwargs)


def _present(table: EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    """Which ids are stored, without touching the table's LRU clock or counters."""
    present = np.zeros(ids.shape[0], dtype=np.bool_)
    for shard in table._shards:
        present |= shard.index.find(ids) >= 0
    return present


# --- hash index and initializer -------------------------------------------------


def test_hash_index_insert_find_grow_rebuild() -> None:
    index = HashIndex(initial_slots=4)
    ids = np.random.default_rng(0).permutation(np.arange(1, 20001, dtype=np.uint64) * 7919)
    rows, is_new = index.find_or_insert(ids[:5000], next_row=10)
    np.testing.assert_array_equal(rows, np.arange(10, 5010))
    assert is_new.all() and len(index) == 5000
    # Mixed batch: old ids keep their rows, new ids get consecutive rows in order.
    mixed = np.concatenate([ids[4000:5000], ids[5000:20000]])
    rows, is_new = index.find_or_insert(mixed, next_row=5010)
    np.testing.assert_array_equal(rows[:1000], np.arange(4010, 5010))
    np.testing.assert_array_equal(rows[1000:], np.arange(5010, 20010))
    np.testing.assert_array_equal(is_new, np.arange(16000) >= 1000)
    assert len(index) == 20000 and index.slots >= 20000 * 5 // 3  # load <= 3/5
    np.testing.assert_array_equal(index.find(ids), np.arange(10, 20010))
    assert (index.find(_ids(1, 2, 3)) == -1).all()
    index.rebuild(ids[::2].copy(), np.arange(10000))
    assert len(index) == 10000
    np.testing.assert_array_equal(index.find(ids[::2].copy()), np.arange(10000))
    assert (index.find(ids[1::2].copy()) == -1).all()
    with pytest.raises(ValueError, match="unique"):
        index.rebuild(_ids(5, 6, 5), np.arange(3))
    with pytest.raises(ValueError, match="reserved"):
        index.find(np.array([1, RESERVED_ID], dtype=np.uint64))
    with pytest.raises(ValueError, match="uint64"):
        index.find(np.array([1, 2], dtype=np.int64))
    assert index.nbytes == index.slots * 4


def _old_hash_collisions(count: int, salt: int) -> np.ndarray:
    """Ids whose public ``mix64(id, salt)`` all share their low 20 bits: with the index as it
    was (salt ``HASH_STACK_SALT``), one home slot for all of them."""
    return inverse_mix64(np.arange(1, count + 1, dtype=np.uint64) << np.uint64(20), salt)


def test_hash_index_keeps_probes_short_for_ids_colliding_under_the_old_hash() -> None:
    ids = _old_hash_collisions(40_000, HASH_STACK_SALT)
    index = HashIndex()
    rows, is_new = index.find_or_insert(ids, next_row=0)
    assert is_new.all() and rows.tolist() == list(range(ids.size))
    # The old public hash made this one run of 40,000 slots; random ids give tens.
    assert index.probe_bound() <= PROBE_BOUND
    np.testing.assert_array_equal(index.find(ids[::-1].copy()), rows[::-1])
    assert (index.find(_old_hash_collisions(50_000, HASH_STACK_SALT)[40_000:]) == -1).all()
    index.rebuild(ids[::3].copy(), np.arange(ids[::3].size))  # a rebuild redraws the key
    assert index.probe_bound() <= PROBE_BOUND
    np.testing.assert_array_equal(index.find(ids[::3].copy()), np.arange(ids[::3].size))
    assert (index.find(ids[1::3].copy()) == -1).all()


def test_table_answers_right_after_a_flood_of_crafted_ids() -> None:
    flood = _old_hash_collisions(20_000, HASH_STACK_SALT)
    honest = np.random.default_rng(3).integers(0, 2**63, 1000, dtype=np.uint64)
    for num_shards in (1, 4):
        with _table(num_shards=num_shards, capacity=50_000, seed=5) as table:
            np.testing.assert_array_equal(table.lookup(flood, insert=True),
                                          initial_rows(flood, DIM, -0.01, 0.01, 5))
            np.testing.assert_array_equal(table.lookup(honest, insert=True),
                                          initial_rows(honest, DIM, -0.01, 0.01, 5))
            grads = np.ones((flood.size, DIM), np.float32)
            assert table.update(flood, grads) == flood.size
            np.testing.assert_allclose(table.lookup(flood, insert=False),
                                       initial_rows(flood, DIM, -0.01, 0.01, 5) - 0.1, atol=1e-6)
            assert table.num_entries == flood.size + honest.size
            assert max(shard.index.probe_bound() for shard in table._shards) <= PROBE_BOUND


def test_internal_shard_choice_cannot_be_steered() -> None:
    # Ids that all shared internal shard 0 of 4 under the old public shard hash: there
    # they overflowed that shard's quarter of the capacity; keyed, they spread.
    old_shard_salt = 0x13198A2E03707344
    candidates = _old_hash_collisions(40_000, 0) ^ np.uint64(old_shard_salt)
    ids = candidates[mix64(candidates, old_shard_salt) % np.uint64(4) == 0][:6000]
    assert ids.size == 6000
    with _table(num_shards=4, capacity=10_000) as table:
        table.lookup(ids, insert=True)
        assert table.stats()["evicted"] == 0 and _present(table, ids).all()
        sizes = [shard.size for shard in table._shards]
        assert min(sizes) > 0.8 * ids.size / 4, sizes


def test_initial_rows_range_and_determinism() -> None:
    ids = np.arange(1000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = initial_rows(ids, 16, -0.5, 0.25, seed=3)
    assert rows.dtype == np.float32 and rows.shape == (1000, 16)
    assert rows.min() >= -0.5 and rows.max() < 0.25
    assert abs(float(rows.mean()) - (-0.125)) < 0.01  # roughly uniform
    np.testing.assert_array_equal(initial_rows(ids[::-1], 16, -0.5, 0.25, 3), rows[::-1])
    assert not np.array_equal(initial_rows(ids, 16, -0.5, 0.25, 4), rows)
    assert len(np.unique(rows[:, 0])) > 900  # columns and ids are not correlated
    np.testing.assert_array_equal(initial_rows(ids[:3], 2, 0.0, 0.0, 0), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="lower"):
        initial_rows(ids, 4, 1.0, 0.0, 0)


# --- lookup -------------------------------------------------------------------------


def test_lookup_without_insert_returns_zeros_and_stores_nothing() -> None:
    table = _table()
    out = table.lookup(_ids(1, 2, 3), False)
    np.testing.assert_array_equal(out, np.zeros((3, DIM), dtype=np.float32))
    assert table.num_entries == 0
    assert table.stats()["misses"] == 3 and table.stats()["inserted"] == 0


def test_lookup_with_insert_creates_initial_rows_then_reads_them() -> None:
    table = _table(init_lower=-1.0, init_upper=1.0, seed=11)
    ids = _ids(5, 10**12, 2**63 + 9)
    first = table.lookup(ids, True)
    np.testing.assert_array_equal(first, initial_rows(ids, DIM, -1.0, 1.0, 11))
    assert table.num_entries == 3
    again = table.lookup(_ids(10**12, 77, 5), False)
    np.testing.assert_array_equal(again[0], first[1])
    np.testing.assert_array_equal(again[1], np.zeros(DIM))
    np.testing.assert_array_equal(again[2], first[0])
    stats = table.stats()
    assert (stats["entries"], stats["hits"], stats["misses"], stats["inserted"]) == (3, 2, 4, 3)
    assert stats["bytes"] > 0 and stats["evicted"] == 0


def test_lookup_duplicates() -> None:
    table = _table()
    out = table.lookup(_ids(5, 5, 7, 5, 7), True)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[3])
    np.testing.assert_array_equal(out[2], out[4])
    assert not np.array_equal(out[0], out[2])
    assert table.num_entries == 2 and table.stats()["inserted"] == 2
    assert table.lookup(np.empty(0, dtype=np.uint64), True).shape == (0, DIM)


def test_same_id_same_vector_across_shard_counts_and_orders() -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 2**64 - 1, size=3000, dtype=np.uint64)
    one = _table(num_shards=1, seed=5)
    four = _table(num_shards=4, seed=5)
    try:
        a = one.lookup(ids, True)
        perm = rng.permutation(ids.shape[0])
        # Arrive in a different order, split over several calls.
        b = np.empty_like(a)
        for chunk in np.array_split(perm, 7):
            b[chunk] = four.lookup(ids[chunk], True)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(four.lookup(ids, False), a)
    finally:
        four.close()


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "growing"])
def test_growth_past_initial_arrays_keeps_values(reserved, monkeypatch) -> None:
    if not reserved:  # as where the OS refuses to reserve address space
        monkeypatch.setattr(memory, "reserve", lambda shape, dtype: None)
    table = _table(optimizer=AdagradConfig(lr=0.1), capacity=100_000)
    assert table._shards[0].reserved == reserved
    first = np.arange(1, 901, dtype=np.uint64)
    table.lookup(first, True)
    table.update(first, np.full((900, DIM), 0.5, dtype=np.float32))
    before = table.lookup(first, False)
    for start in range(1000, 9000, 1500):
        ids = np.arange(start, start + 1500, dtype=np.uint64)
        inserted = table.lookup(ids, True)  # the new rows, answered from the grown arrays
        np.testing.assert_array_equal(inserted, table.lookup(ids, False))
    assert table.num_entries == 900 + 6 * 1500
    # Reserved arrays hold the whole share from the start; the others really did grow.
    rows = table._shards[0].weights.shape[0]
    assert rows == 100_000 if reserved else 1024 < rows < 100_000
    assert table.stats()["bytes"] < 100_000 * DIM * 4  # counts rows in use, not reserved
    np.testing.assert_array_equal(table.lookup(first, False), before)
    # Optimizer state survived the move too: a second step matches a table that never grew.
    twin = _table(optimizer=AdagradConfig(lr=0.1))
    twin.lookup(first, True)
    twin.update(first, np.full((900, DIM), 0.5, dtype=np.float32))
    for t in (table, twin):
        t.update(first, np.full((900, DIM), 0.25, dtype=np.float32))
    np.testing.assert_array_equal(table.lookup(first, False), twin.lookup(first, False))


def test_reserved_memory_is_zeroed_writable_and_only_address_space() -> None:
    big = memory.reserve((1 << 28, 16), np.float32)  # 16 GiB: more than this machine has
    if big is None:
        pytest.skip("this OS does not reserve address space (strict overcommit)")
    assert big.shape == (1 << 28, 16) and big.flags.c_contiguous and big.flags.writeable
    assert big[12345].sum() == 0 and big[-1].sum() == 0
    big[(1 << 28) - 1] = 3.0
    assert big[-1, 0] == 3.0
    small = memory.empty(10, np.int64)
    assert small.shape == (10,) and small.dtype == np.int64
    large = memory.empty((1 << 20, 8), np.float32)
    assert large.ctypes.data % memory.HUGE_PAGE == 0  # its own aligned mapping


# --- capacity and LRU --------------------------------------------------------------


def test_lru_eviction_keeps_recent_rows() -> None:
    table = _table(capacity=64, init_lower=-1.0, init_upper=1.0)
    for i in range(64):  # one call per id: a strictly increasing access clock
        table.lookup(_ids(i), True)
    recent = np.arange(10, dtype=np.uint64)
    table.update(recent, np.ones((10, DIM), dtype=np.float32))  # touches ids 0..9
    trained = table.lookup(recent, False)
    table.lookup(np.arange(100, 110, dtype=np.uint64), True)  # needs 10 rows
    assert table.num_entries == 64 and table.stats()["evicted"] == 10
    all_ids = np.concatenate([np.arange(64), np.arange(100, 110)]).astype(np.uint64)
    present = _present(table, all_ids)
    # The ten stalest rows (ids 10..19) went; everything else stayed.
    np.testing.assert_array_equal(present, ~np.isin(all_ids, np.arange(10, 20)))
    np.testing.assert_array_equal(table.lookup(recent, False), trained)
    survivors = np.arange(20, 64, dtype=np.uint64)
    np.testing.assert_array_equal(
        table.lookup(survivors, False), initial_rows(survivors, DIM, -1.0, 1.0, 0))
    # An evicted id comes back with its initial vector and fresh state.
    back = table.lookup(_ids(12), True)
    np.testing.assert_array_equal(back, initial_rows(_ids(12), DIM, -1.0, 1.0, 0))
    assert table.update(_ids(15, 16, 12), np.ones((3, DIM), dtype=np.float32)) == 1


def test_capacity_never_exceeded_and_values_stay_right() -> None:
    capacity = 100
    table = _table(capacity=capacity, num_shards=4, seed=2)
    rng = np.random.default_rng(3)
    try:
        for _ in range(60):
            ids = rng.integers(0, 400, size=rng.integers(1, 30), dtype=np.uint64)
            out = table.lookup(ids, True)
            # Row remapping after each compaction must keep ids pointing at their rows.
            np.testing.assert_array_equal(out, initial_rows(ids, DIM, -0.01, 0.01, 2))
            assert table.num_entries <= capacity
            assert all(s.size <= -(-capacity // 4) for s in table._shards)
            assert _present(table, ids).all()
        stats = table.stats()
        assert stats["evicted"] > 0
        assert stats["inserted"] - stats["evicted"] == stats["entries"] == table.num_entries
    finally:
        table.close()


def test_batch_larger_than_capacity_rejected() -> None:
    table = _table(capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        table.lookup(np.arange(20, dtype=np.uint64), True)


# --- update -------------------------------------------------------------------------


def test_update_sums_duplicates_and_skips_missing() -> None:
    table = _table(optimizer=SGDConfig(lr=1.0))
    start = table.lookup(_ids(1, 2), True)
    grads = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM)
    assert table.update(_ids(1, 9, 1, 2), grads) == 2
    got = table.lookup(_ids(1, 2), False)
    np.testing.assert_allclose(got[0], start[0] - grads[0] - grads[2], rtol=1e-6)
    np.testing.assert_allclose(got[1], start[1] - grads[3], rtol=1e-6)
    assert table.num_entries == 2  # the unknown id 9 was not created


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_grads_rejected_and_table_unchanged(bad: float, dtype) -> None:
    """float16 gradients (a float16 wire's, read by the kernels as they arrived) are
    checked as float32 ones are: the largest finite and subnormal values pass."""
    table = _table(optimizer=AdagradConfig(), num_shards=2)
    ids = np.arange(50, dtype=np.uint64)
    table.lookup(ids, True)
    finite = np.ones((50, DIM), dtype=dtype)
    finite[1, 0], finite[2, 1] = np.finfo(dtype).max, np.finfo(dtype).smallest_subnormal
    table.update(ids, finite)
    before = table.lookup(ids, False)
    state_before = [s.state[: s.size].copy() for s in table._shards]
    grads = np.ones((50, DIM), dtype=dtype)
    grads[37, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        table.update(ids, grads)
    np.testing.assert_array_equal(table.lookup(ids, False), before)
    for shard, state in zip(table._shards, state_before, strict=True):
        np.testing.assert_array_equal(shard.state[: shard.size], state)
    table.close()


# --- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        np.array([1, 2], dtype=np.int64),
        np.array([[1, 2]], dtype=np.uint64),
        [1, 2],
        np.array([1, RESERVED_ID], dtype=np.uint64),
    ],
)
def test_bad_ids_rejected(ids) -> None:
    table = _table()
    with pytest.raises(ValueError, match="ids"):
        table.lookup(ids, True)
    with pytest.raises(ValueError, match="ids"):
        table.update(ids, np.zeros((2, DIM), dtype=np.float32))
    assert table.num_entries == 0


def test_bad_grads_rejected() -> None:
    table = _table()
    table.lookup(_ids(1, 2), True)
    with pytest.raises(ValueError, match=r"grads.*\(2, 8\)"):
        table.update(_ids(1, 2), np.zeros((2, DIM + 1), dtype=np.float32))
    with pytest.raises(ValueError, match="grads.*floating"):
        table.update(_ids(1, 2), np.zeros((2, DIM), dtype=np.int32))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dim": 0}, "dim"),
        ({"num_shards": 0}, "num_shards"),
        ({"capacity": 0}, "capacity"),
        ({"seed": -1}, "seed"),
        ({"init_lower": 1.0, "init_upper": 0.0}, "init_lower"),
        ({"weight_bound": 0.0}, "weight_bound"),
    ],
)
def test_bad_table_arguments_rejected(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        _table(**kwargs)


# --- threads -----------------------------------------------------------------------


def _workload(table: EmbeddingTable, seed: int, base: int) -> None:
    rng = np.random.default_rng(seed)
    own = np.arange(base, base + 20_000, dtype=np.uint64)
    for _ in range(4):
        ids = rng.choice(own, size=12_000)  # repeats included; big enough to fan out
        table.lookup(ids, True)
        table.update(ids, rng.normal(size=(ids.shape[0], DIM)).astype(np.float32))


def test_concurrent_threads_match_serial_run() -> None:
    cfg = AdagradConfig(lr=0.05)
    serial = _table(optimizer=cfg, num_shards=4)
    threaded = _table(optimizer=cfg, num_shards=4)
    bases = [k * 1_000_000 for k in range(4)]
    try:
        for k, base in enumerate(bases):
            _workload(serial, k, base)
        threads = [threading.Thread(target=_workload, args=(threaded, k, base))
                   for k, base in enumerate(bases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        every = np.concatenate([np.arange(b, b + 20_000, dtype=np.uint64) for b in bases])
        assert threaded.num_entries == serial.num_entries
        np.testing.assert_array_equal(threaded.lookup(every, False), serial.lookup(every, False))
        keys = ("entries", "hits", "misses", "inserted")
        assert {k: threaded.stats()[k] for k in keys} == {k: serial.stats()[k] for k in keys}
    finally:
        serial.close()
        threaded.close()
