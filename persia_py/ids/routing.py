"""Where an id lives: the stable, public placement of ids on parameter-server replicas.

:func:`replica_of` hashes an id with :func:`persia_py.ids.hashing.mix64` and the public
``REPLICA_SALT``: a pure function of the id, so the same id lands on the same replica for
a given replica count in every process, forever (checkpoints depend on it). The internal
shard inside a replica is chosen by a keyed hash instead (``servers/storage.py``): it is
local to one process, and an attacker who could predict it could pile ids on one shard.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids import RESERVED_ID
from persia_py.ids.hashing import HASH_STACK_SALT, REPLICA_SALT, mix64, mix64_one

__all__ = ["RESERVED_ID", "hash_stack", "mix64", "replica_of", "split_by"]

def replica_of(ids: np.ndarray, num_replicas: int) -> np.ndarray:
    """Index of the parameter-server replica that owns each id (int64 array):
    ``mix64(ids, REPLICA_SALT) % num_replicas``, in one pass (every embedding worker's
    batch and every parameter server's request goes through it)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    ids = np.asarray(ids, dtype=np.uint64)
    flat = np.ascontiguousarray(ids).reshape(-1)
    return _replicas(flat, REPLICA_SALT, np.uint64(num_replicas)).reshape(ids.shape)


@njit(cache=True, nogil=True)
def _replicas(ids: np.ndarray, salt: np.uint64, num_replicas: np.uint64) -> np.ndarray:
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = np.int64(mix64_one(ids[i] ^ salt) % num_replicas)
    return out


def hash_stack(ids: np.ndarray, rounds: int, embedding_size: int) -> np.ndarray:
    """PERSIA's hash stacking: each id becomes ``rounds`` bucket ids, ``[num_ids * rounds]``.

    Round ``r`` hashes the previous round's hash (the id for round 0) and takes it modulo
    ``embedding_size``, offset by ``r * embedding_size`` so rounds never share a bucket.
    An id's buckets are consecutive in the output (id-major), all below
    ``rounds * embedding_size``.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    out = np.empty((ids.size, rounds), dtype=np.uint64)
    size = np.uint64(embedding_size)
    hashed = ids
    for r in range(rounds):  # a few rounds, each vectorized over every id
        hashed = mix64(hashed, HASH_STACK_SALT)
        out[:, r] = hashed % size + np.uint64(r) * size
    return out.reshape(-1)


@njit(cache=True, nogil=True)
def _counting_sort(owner: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    bounds = np.zeros(num_owners + 1, np.int64)
    for i in range(owner.shape[0]):
        k = owner[i]
        if k < 0 or k >= num_owners:
            raise ValueError("owner values must lie in [0, num_owners)")
        bounds[k + 1] += 1
    for k in range(num_owners):
        bounds[k + 1] += bounds[k]
    fill = bounds[:-1].copy()
    order = np.empty(owner.shape[0], np.int64)
    for i in range(owner.shape[0]):
        k = owner[i]
        order[fill[k]] = i
        fill[k] += 1
    return order, bounds


def split_by(owner: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    """Group positions by owner: a counting sort, O(n), no Python loop over ids.

    Returns ``(order, bounds)``: positions of owner ``k`` are ``order[bounds[k]:bounds[k + 1]]``,
    in their original relative order. ``owner`` holds ints in ``[0, num_owners)``
    (ValueError otherwise).
    """
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    owner = np.ascontiguousarray(owner, dtype=np.int64)
    return _counting_sort(owner, num_owners)
