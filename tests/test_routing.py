"""Routing: the same id always reaches the same replica and shard, in any process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from persia_py.routing import replica_of, shard_of, split_by


def test_routing_is_a_pure_function_of_the_id() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**63, 10_000, dtype=np.uint64)
    for n in (1, 2, 3, 7):
        first = replica_of(ids, n)
        np.testing.assert_array_equal(first, replica_of(ids.copy(), n))
        # Order and batching do not matter: each id's owner is its own.
        perm = rng.permutation(ids.size)
        np.testing.assert_array_equal(replica_of(ids[perm], n), first[perm])
        np.testing.assert_array_equal(
            np.concatenate([replica_of(ids[:10], n), replica_of(ids[10:], n)]), first)
        assert first.min() >= 0 and first.max() < n


def test_routing_is_stable_across_processes() -> None:
    ids = np.arange(1000, dtype=np.uint64) * np.uint64(2654435761)
    code = ("import numpy as np, sys; from persia_py.routing import replica_of, shard_of;"
            "ids = np.arange(1000, dtype=np.uint64) * np.uint64(2654435761);"
            "sys.stdout.write(','.join(map(str, replica_of(ids, 5))) + ';' +"
            "','.join(map(str, shard_of(ids, 8))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    replicas, shards = out.split(";")
    assert [int(x) for x in replicas.split(",")] == replica_of(ids, 5).tolist()
    assert [int(x) for x in shards.split(",")] == shard_of(ids, 8).tolist()


def test_sequential_ids_spread_evenly_and_shard_hash_differs_from_replica_hash() -> None:
    ids = np.arange(100_000, dtype=np.uint64)
    counts = np.bincount(replica_of(ids, 4), minlength=4)
    assert counts.min() > 0.95 * ids.size / 4
    # Within one replica the internal shards must still spread (independent hashes).
    mine = ids[replica_of(ids, 4) == 0]
    shard_counts = np.bincount(shard_of(mine, 4), minlength=4)
    assert shard_counts.min() > 0.9 * mine.size / 4


def test_split_by_groups_positions_by_owner() -> None:
    owner = np.array([2, 0, 1, 2, 0, 0])
    order, bounds = split_by(owner, 4)
    groups = [order[bounds[k]:bounds[k + 1]].tolist() for k in range(4)]
    assert groups == [[1, 4, 5], [2], [0, 3], []]


def test_bad_counts_rejected() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        replica_of(np.zeros(1, np.uint64), 0)
