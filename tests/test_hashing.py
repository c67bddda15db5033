"""The one home of every hash: the stable public mix, its inverse, the keyed hash, dedup."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from persia_py.ids import hashing
from persia_py.ids.dedup import repeated_id, rows_in_order, unique_in_order
from persia_py.ids.hashing import HashKey, inverse_mix64, keyed_buckets, mix64
from persia_py.servers.kernels import _rows_repeat, sum_duplicate_rows

KEYED_CODE = """
import sys
import numpy as np
from persia_py.ids.dedup import _KEY
from persia_py.ids.hashing import HashKey, keyed_buckets
ids = np.arange(1, 65, dtype=np.uint64)
fresh = HashKey.random()
sys.stdout.write(",".join(map(str, keyed_buckets(ids, _KEY, 2**62))) + ";"
                 + ",".join(map(str, keyed_buckets(ids, fresh, 2**62))))
"""


def _old_hash_collisions(count: int, salt: int) -> np.ndarray:
    """Ids whose public ``mix64(id, salt)`` all share their low 20 bits (one home slot)."""
    return inverse_mix64(np.arange(1, count + 1, dtype=np.uint64) << np.uint64(20), salt)


def test_mix64_is_splitmix64_and_inverse_mix64_inverts_it() -> None:
    # splitmix64's first output for seed 0, as published with the generator.
    assert int(mix64(np.zeros(1, np.uint64))[0]) == 0xE220A8397B1DCDAF
    values = np.random.default_rng(0).integers(0, 2**64 - 1, 10_000, dtype=np.uint64,
                                               endpoint=True)
    for salt in (0, hashing.REPLICA_SALT, 2**64 - 1):
        np.testing.assert_array_equal(mix64(inverse_mix64(values, salt), salt), values)
        np.testing.assert_array_equal(inverse_mix64(mix64(values, salt), salt), values)


def test_public_salts_are_distinct() -> None:
    salts = [hashing.REPLICA_SALT, hashing.HASH_STACK_SALT, hashing.INIT_COLUMN_SALT,
             hashing.ADMIT_SALT]
    assert len({int(s) for s in salts}) == len(salts)


@pytest.mark.processes
def test_keyed_hash_differs_between_processes_and_is_stable_within_one() -> None:
    outputs = [subprocess.run([sys.executable, "-c", KEYED_CODE], capture_output=True,
                              text=True, check=True, timeout=120).stdout
               for _ in range(2)]
    dedup_keys = [o.split(";")[0] for o in outputs]
    fresh_keys = [o.split(";")[1] for o in outputs]
    assert dedup_keys[0] != dedup_keys[1]
    assert fresh_keys[0] != fresh_keys[1] and fresh_keys[0] != dedup_keys[0]
    key = HashKey.random()
    ids = np.arange(1, 1000, dtype=np.uint64)
    np.testing.assert_array_equal(keyed_buckets(ids, key, 7), keyed_buckets(ids.copy(), key, 7))
    assert 0 <= keyed_buckets(ids, key, 7).min() and keyed_buckets(ids, key, 7).max() < 7


def test_hash_key_is_never_shown_or_copied_out() -> None:
    key = HashKey.random()
    for word in key.words:
        assert str(int(word)) not in repr(key) and f"{int(word):x}" not in repr(key)
    with pytest.raises(TypeError, match="secret"):
        pickle.dumps(key)
    with pytest.raises(ValueError):
        key.words[0] = 1  # read-only
    with pytest.raises(ValueError, match="num_buckets"):
        keyed_buckets(np.zeros(1, np.uint64), key, 0)


def test_keyed_buckets_spread_ids_crafted_against_public_hashes() -> None:
    key = HashKey.random()
    for salt in (0, hashing.HASH_STACK_SALT, hashing.REPLICA_SALT):
        ids = _old_hash_collisions(40_000, salt)
        assert np.unique(mix64(ids, salt) & np.uint64(2**20 - 1)).size == 1  # crafted right
        counts = np.bincount(keyed_buckets(ids, key, 64), minlength=64)
        assert counts.min() > 0.7 * ids.size / 64


def test_unique_in_order_on_random_and_crafted_ids() -> None:
    rng = np.random.default_rng(1)
    for ids in (rng.integers(0, 50, 1000).astype(np.uint64),
                np.array([2**64 - 1, 0, 2**64 - 1], np.uint64),
                np.zeros(0, np.uint64),
                np.repeat(_old_hash_collisions(20_000, 0), 2)):  # old dedup hash: mix64(id)
        unique, inverse = unique_in_order(ids)
        np.testing.assert_array_equal(unique[inverse], ids)
        _, first = np.unique(ids, return_index=True)
        np.testing.assert_array_equal(unique, ids[np.sort(first)])
        assert unique.dtype == np.uint64 and inverse.dtype == np.int64
    with pytest.raises(ValueError, match="expected a 1-D array"):
        unique_in_order(np.zeros((2, 2), np.uint64))


def test_repeated_id_finds_a_repeat_wherever_it_is() -> None:
    rng = np.random.default_rng(2)
    distinct = rng.choice(2**62, size=300_000, replace=False).astype(np.uint64) * np.uint64(3)
    assert repeated_id(distinct) is None
    for at in (0, 1, 77_777, 299_999):  # a repeat of the first, the last, one in between
        ids = distinct.copy()
        ids[at] = distinct[(at + 150_001) % 300_000]
        assert repeated_id(ids) == int(ids[at])
    assert repeated_id(np.zeros(0, np.uint64)) is None
    assert repeated_id(np.array([7], np.uint64)) is None
    assert repeated_id(np.array([0, 0], np.uint64)) == 0  # hash 0 and value 0 are values
    assert repeated_id(np.array([2**64 - 1, 3, 2**64 - 1], np.uint64)) == 2**64 - 1
    assert repeated_id(np.arange(100_000, dtype=np.uint64)) is None
    assert repeated_id(np.full(5_000, 9, np.uint64)) == 9  # one bucket holds them all
    crafted = _old_hash_collisions(20_000, 0)  # buckets come from the keyed hash
    assert repeated_id(crafted) is None and repeated_id(np.repeat(crafted, 2)) is not None
    with pytest.raises(ValueError, match="expected a 1-D array"):
        repeated_id(np.zeros((2, 2), np.uint64))


def test_rows_in_order_drops_absent_rows_and_sum_duplicate_rows_sums() -> None:
    rows = np.array([5, -1, 3, 5, -1, 3, 3], np.int64)
    unique, inverse = rows_in_order(rows)
    assert unique.tolist() == [5, 3] and inverse.tolist() == [0, -1, 1, 0, -1, 1, 1]
    grads = np.arange(14, dtype=np.float32).reshape(7, 2)
    out_rows, out_grads, summed = sum_duplicate_rows(rows, grads, 10)
    assert summed and out_rows.tolist() == [5, 3]
    np.testing.assert_array_equal(out_grads, [[0 + 6, 1 + 7], [4 + 10 + 12, 5 + 11 + 13]])
    distinct = np.array([4, -1, 2], np.int64)
    first_grads = grads[:3]
    same_rows, same_grads, summed = sum_duplicate_rows(distinct, first_grads, 10)
    assert not summed and same_rows is distinct and same_grads is first_grads


@pytest.mark.parametrize("num_rows", [1 << 8, 1 << 30])  # by bitmap; by hash set (big shard)
def test_repeated_rows_are_told_apart_from_distinct_ones(num_rows: int) -> None:
    rng = np.random.default_rng(4)
    for n in (1, 2, 17, 100):
        distinct = rng.choice(min(num_rows, 10**6), n, replace=False).astype(np.int64)
        distinct[1::5] = -1  # absent ids' rows may repeat
        assert not _rows_repeat(distinct, num_rows), n
        repeated = np.insert(distinct, rng.integers(0, n + 1), distinct[0])
        assert _rows_repeat(repeated, num_rows), n
