"""Every 64-bit hash of the project: the public stable mix and the secret keyed one.

Two kinds of hash, for two kinds of use:

* **Stable and public** (:func:`mix64`, :func:`mix64_one`): splitmix64's finalizer of
  ``value ^ salt``. Whatever must agree between processes and over time uses it: the
  replica that owns an id (checkpoints depend on it), hash stacking, initial embedding
  values, admission draws. The salts below are fixed forever; changing one moves rows.
* **Keyed and secret** (:class:`HashKey`, :func:`keyed_hash_one`, :func:`keyed_buckets`):
  every in-memory structure whose cost an input could steer (the parameter server's hash
  index and internal shard choice, the dedup hash sets). The key comes from
  :mod:`secrets` when the structure is made, never from the wire, and is never printed.

Why two rounds with two keys. ``mix64`` is a bijection with public constants: with a
public salt anyone can invert it and compute, offline, ids that all share one slot (a
hash flood: docs/benchmarks.md). A secret salt alone, ``mix(id ^ k)``, is not enough in
principle: the xor difference of two ids passes through ``^ k`` unchanged, so any
difference that the fixed mix maps to equal low bits with some probability does so under
every key (the seed-independent multicollisions of "Hash-flooding DoS reloaded",
Aumasson, Bernstein and Boßlet, 2012, against keyed MurmurHash and CityHash). Hashing
``mix(mix(id ^ k0) ^ k1)`` makes the difference entering the second finalizer the output
difference of the first one on a value the attacker does not know; a usable differential
would have to hold through two full avalanching finalizers at once. This is not a
cryptographic PRF (SipHash would be, at several times the hashing cost on a path whose
cost is memory reads); the hash index also redraws its key every time it grows or is
rebuilt, so no key lives long enough to be learned by timing, and the benchmark
``benchmarks.hash_flood`` tries the structured inputs (old-hash collisions, high-bit-only
differences, sequences, collisions under a guessed key).

Keys never become numba globals: a ``cache=True`` kernel would freeze a global into its
on-disk cache and every later process would share it. Kernels take ``key.words``.
"""

from __future__ import annotations

import secrets
from typing import NoReturn

import numpy as np
from numba import njit

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""splitmix64's increment, added before the finalizer."""
MIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_M2 = np.uint64(0x94D049BB133111EB)
"""splitmix64's two multipliers (odd, so each multiplication is invertible mod 2**64)."""
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)  # the finalizer's shifts

# Public salts of the stable hashes, pairwise distinct so that no two uses see correlated
# hashes of one id (tests/test_hashing.py checks it). The hash index used
# HASH_STACK_SALT too before it was keyed (the old comment said otherwise); since
# ``hash_stack`` hashes bucket ids, not the ids the index sees, that shared nothing.
REPLICA_SALT = np.uint64(0x243F6A8885A308D3)
"""Picks the parameter-server replica of an id (:func:`persia_py.ids.routing.replica_of`)."""
HASH_STACK_SALT = np.uint64(0xA4093822299F31D0)
"""Each round of PERSIA's hash stacking (:func:`persia_py.ids.routing.hash_stack`)."""
INIT_COLUMN_SALT = np.uint64(0x452821E638D01377)
"""The per-column stream of initial embedding values (``servers/initializer.py``)."""
ADMIT_SALT = np.uint64(0x082EFA98EC4E6C89)
"""The admission draw of a new id, with the table seed (``servers/storage.py``)."""
ROUNDING_SALT = np.uint64(0x452821E638D01377 ^ 0x13198A2E03707344)
"""Stochastic rounding's key, with the table seed (``servers/row_types.py``)."""


def mix64(values: np.ndarray, salt: np.uint64 | int = 0) -> np.ndarray:
    """splitmix64 finalizer of ``values ^ salt``, vectorized; returns uint64. Stable."""
    with np.errstate(over="ignore"):
        z = (np.asarray(values, dtype=np.uint64) ^ np.uint64(salt)) + GOLDEN
        z = (z ^ (z >> _S30)) * MIX_M1
        z = (z ^ (z >> _S27)) * MIX_M2
        return z ^ (z >> _S31)


def _unshift_xor(z: np.ndarray, shift: int) -> np.ndarray:
    """Inverse of ``z ^ (z >> shift)``: each pass fixes ``shift`` more high bits."""
    s = np.uint64(shift)
    x = z.copy()
    for _ in range(64 // shift):
        x = z ^ (x >> s)
    return x


def inverse_mix64(hashed: np.ndarray, salt: np.uint64 | int = 0) -> np.ndarray:
    """The value ``v`` with ``mix64(v, salt) == hashed`` (mix64 is a bijection).

    For tests and benchmarks that craft ids with chosen public hashes (what an attacker
    could do to any unkeyed hash); nothing in production inverts a hash.
    """
    inv_m1 = np.uint64(pow(int(MIX_M1), -1, 1 << 64))
    inv_m2 = np.uint64(pow(int(MIX_M2), -1, 1 << 64))
    with np.errstate(over="ignore"):
        z = _unshift_xor(np.asarray(hashed, dtype=np.uint64), 31) * inv_m2
        z = _unshift_xor(z, 27) * inv_m1
        return (_unshift_xor(z, 30) - GOLDEN) ^ np.uint64(salt)


@njit(cache=True, nogil=True, inline="always")
def mix64_one(value: np.uint64) -> np.uint64:
    """:func:`mix64` of one value with salt 0, for numba kernels (xor a salt in first)."""
    z = value + GOLDEN
    z = (z ^ (z >> _S30)) * MIX_M1
    z = (z ^ (z >> _S27)) * MIX_M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True, inline="always")
def keyed_hash_one(value: np.uint64, words: np.ndarray) -> np.uint64:
    """The keyed hash of one value: ``mix(mix(value ^ k0) ^ k1)``, ``words = [k0, k1]``."""
    return mix64_one(mix64_one(value ^ words[0]) ^ words[1])


@njit(cache=True, nogil=True)
def _keyed_buckets(values: np.ndarray, words: np.ndarray, num_buckets: int) -> np.ndarray:
    out = np.empty(values.shape[0], np.int64)
    n = np.uint64(num_buckets)
    for i in range(values.shape[0]):
        out[i] = np.int64(keyed_hash_one(values[i], words) % n)
    return out


class HashKey:
    """A secret key for the keyed hash: ``words``, read-only uint64 (``[k0, k1]``).

    Made by :meth:`random` from :mod:`secrets`; its ``repr`` never shows the words, so
    logging an object that holds one does not leak it.
    """

    __slots__ = ("words",)

    def __init__(self, words: np.ndarray) -> None:
        words = np.array(words, dtype=np.uint64).reshape(-1)
        if words.shape[0] < 2:
            raise ValueError(f"a hash key needs at least 2 words, got {words.shape[0]}")
        words.flags.writeable = False
        self.words = words

    @classmethod
    def random(cls, num_words: int = 2) -> HashKey:
        """A fresh key of ``num_words`` 64-bit words from the OS's secure random source."""
        return cls(np.array([secrets.randbits(64) for _ in range(num_words)], np.uint64))

    def __repr__(self) -> str:
        return f"HashKey(<{self.words.shape[0]} secret words>)"

    def __reduce__(self) -> NoReturn:
        # A key copied to another process would be a key shared between processes.
        raise TypeError("a HashKey is secret to its process and cannot be pickled")


def keyed_buckets(values: np.ndarray, key: HashKey, num_buckets: int) -> np.ndarray:
    """``keyed_hash(values) % num_buckets`` as int64, for uint64 ``values`` (1-D)."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    values = np.ascontiguousarray(values, dtype=np.uint64)
    return _keyed_buckets(values, key.words, num_buckets)
