"""Routing: the same id always reaches the same replica, in any process, forever."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from persia_py.ids.routing import hash_stack, replica_of, split_by


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


@pytest.mark.processes
def test_routing_is_stable_across_processes() -> None:
    ids = np.arange(1000, dtype=np.uint64) * np.uint64(2654435761)
    code = ("import numpy as np, sys; from persia_py.ids.routing import replica_of;"
            "ids = np.arange(1000, dtype=np.uint64) * np.uint64(2654435761);"
            "sys.stdout.write(','.join(map(str, replica_of(ids, 5))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert [int(x) for x in out.split(",")] == replica_of(ids, 5).tolist()


def test_routing_keeps_the_values_existing_checkpoints_were_written_with() -> None:
    # Computed once with the original routing code: a change here moves stored rows.
    ids = np.array([0, 1, 2, 12345, 2**40 + 7, 2**63, 2**64 - 2], np.uint64)
    assert replica_of(ids, 5).tolist() == [4, 1, 3, 2, 3, 4, 1]
    assert replica_of(ids, 2).tolist() == [1, 0, 0, 0, 1, 1, 1]
    assert replica_of(ids, 7).tolist() == [4, 1, 4, 4, 5, 4, 5]
    assert hash_stack(ids[:3], 2, 1000).tolist() == [243, 1666, 989, 1846, 154, 1731]


def test_sequential_ids_spread_evenly() -> None:
    ids = np.arange(100_000, dtype=np.uint64)
    counts = np.bincount(replica_of(ids, 4), minlength=4)
    assert counts.min() > 0.95 * ids.size / 4


def test_split_by_groups_positions_by_owner() -> None:
    owner = np.array([2, 0, 1, 2, 0, 0])
    order, bounds = split_by(owner, 4)
    groups = [order[bounds[k]:bounds[k + 1]].tolist() for k in range(4)]
    assert groups == [[1, 4, 5], [2], [0, 3], []]
    order, bounds = split_by(np.zeros(0, np.int64), 3)
    assert order.size == 0 and bounds.tolist() == [0, 0, 0, 0]
    for bad in ([0, 4], [-1]):
        with pytest.raises(ValueError, match="owner"):
            split_by(np.array(bad), 4)


def test_bad_counts_rejected() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        replica_of(np.zeros(1, np.uint64), 0)
