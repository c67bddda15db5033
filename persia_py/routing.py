"""Where an id lives: the one place that hashes ids for routing.

A stable 64-bit mix (splitmix64's finalizer) of the id picks the parameter-server
replica; the same mix with a different salt picks the internal shard inside that
replica. Both are pure functions of the id, so the same id always lands in the same
place for a given replica count, whatever process computes it.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_REPLICA_SALT = np.uint64(0x243F6A8885A308D3)
_SHARD_SALT = np.uint64(0x13198A2E03707344)
_HASH_STACK_SALT = np.uint64(0xA4093822299F31D0)

RESERVED_ID = np.uint64(0xFFFFFFFFFFFFFFFF)
"""The one id value a table cannot store (it marks empty slots of the hash index)."""


def mix64(values: np.ndarray, salt: np.uint64 | int = 0) -> np.ndarray:
    """splitmix64 finalizer of ``values ^ salt``, vectorized; returns uint64."""
    with np.errstate(over="ignore"):
        z = (np.asarray(values, dtype=np.uint64) ^ np.uint64(salt)) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def replica_of(ids: np.ndarray, num_replicas: int) -> np.ndarray:
    """Index of the parameter-server replica that owns each id (int64 array)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return (mix64(ids, _REPLICA_SALT) % np.uint64(num_replicas)).astype(np.int64)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Index of the internal hash-map shard (inside one replica) for each id."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return (mix64(ids, _SHARD_SALT) % np.uint64(num_shards)).astype(np.int64)


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
        hashed = mix64(hashed, _HASH_STACK_SALT)
        out[:, r] = hashed % size + np.uint64(r) * size
    return out.reshape(-1)


def split_by(owner: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    """Group positions by owner without a Python loop over ids.

    Returns ``(order, bounds)``: ``order`` lists positions sorted by owner (stable),
    and positions of owner ``k`` are ``order[bounds[k]:bounds[k + 1]]``.
    """
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=num_owners)
    bounds = np.zeros(num_owners + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return order, bounds
