"""Bring your own data: categorical values become stable uint64 ids (FNV-1a 64 + splitmix64,
fixed forever), and every public entry of ids takes int64/uint64, numpy or torch, and
refuses negative ids naming the feature."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from persia_py.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID
from persia_py.ids import as_ids, fnv1a64, hash_values, salt_of
from persia_py.ids.hashing import mix64
from persia_py.ids.routing import RESERVED_ID


def _fnv1a64_reference(data: bytes) -> int:
    """FNV-1a 64 as its authors define it, one byte at a time."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def test_fnv1a64_matches_the_published_vectors_and_the_bytewise_definition() -> None:
    # Test vectors of the FNV reference (draft-eastlake-fnv): "", "a", "foobar".
    assert fnv1a64(np.array([b"", b"a", b"foobar"])).tolist() == [
        0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    rng = np.random.default_rng(0)
    words = [bytes(rng.integers(1, 256, rng.integers(0, 40)).astype(np.uint8))
             for _ in range(500)]
    assert fnv1a64(np.array(words)).tolist() == [_fnv1a64_reference(w) for w in words]


def test_str_hashes_as_its_utf8_bytes_in_every_encoding_length() -> None:
    rng = np.random.default_rng(1)
    # Code points of 1, 2, 3 and 4 UTF-8 bytes (no surrogates; no trailing NUL).
    pools = [np.arange(1, 0x80), np.arange(0x80, 0x800), np.arange(0x800, 0xD800),
             np.arange(0x10000, 0x110000)]
    words = ["".join(chr(int(rng.choice(pools[int(k)]))) for k in rng.integers(0, 4, size))
             for size in rng.integers(0, 12, 400)]
    np.testing.assert_array_equal(
        fnv1a64(np.array(words)),
        np.array([_fnv1a64_reference(w.encode()) for w in words], dtype=np.uint64))
    np.testing.assert_array_equal(hash_values(words, salt="s"),
                                  hash_values(np.array([w.encode() for w in words]), salt="s"))


def test_a_value_hashes_the_same_whatever_the_rest_of_the_array() -> None:
    # Masked per length: a short value in an array of long ones keeps its own hash.
    alone = hash_values(np.array(["68fd1e64"]), salt="C1")
    among = hash_values(np.array(["x", "68fd1e64", "a much longer category value"]), salt="C1")
    assert alone[0] == among[1]
    assert hash_values(["é", "ü"]).tolist() == hash_values(
        np.array(["é".encode(), "ü".encode()])).tolist()  # str is hashed as its UTF-8


def test_hash_is_the_documented_composition_and_salts_separate_features() -> None:
    values = np.array(["68fd1e64", "80e26c9b", ""])
    expected = mix64(fnv1a64(values.astype(np.bytes_)), salt_of("C1"))
    np.testing.assert_array_equal(hash_values(values, salt="C1"), expected)
    assert salt_of("") == 0 and salt_of("C1") == fnv1a64(np.array([b"C1"]))[0]
    assert not np.intersect1d(hash_values(values, salt="C1"), hash_values(values, salt="C2")).size
    ints = np.array([-1, 0, 7, 2**62], np.int64)
    np.testing.assert_array_equal(hash_values(ints, salt=5), mix64(ints.view(np.uint64), 5))
    np.testing.assert_array_equal(hash_values(torch.tensor(ints), salt=5),
                                  hash_values(ints, salt=5))
    # Spread: 100k distinct strings, no collision.
    many = np.char.add("v", np.arange(100_000).astype(np.str_))
    assert np.unique(hash_values(many, salt="C1")).size == 100_000


@pytest.mark.processes
def test_ids_are_stable_across_processes() -> None:
    """Not Python's hash(): a fresh interpreter (another PYTHONHASHSEED) gives the same ids."""
    code = ("import numpy as np; from persia_py.ids import hash_values; "
            "print(','.join(map(str, hash_values(np.array(['68fd1e64', 'b', '']), salt='C7'))))")
    mine = ",".join(map(str, hash_values(np.array(["68fd1e64", "b", ""]), salt="C7")))
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}, timeout=120, check=True)
        assert out.stdout.strip() == mine
    # Fixed forever: a checkpoint's rows are keyed by these values.
    assert mine == "9366576567099120830,7747769495626039525,6475226140027536202"


def test_hash_values_refuses_what_it_cannot_hash() -> None:
    with pytest.raises(TypeError, match="map them to a string such as '' first"):
        hash_values(["a", None])
    with pytest.raises(TypeError, match="dtype float64"):
        hash_values(np.array([1.5]))
    with pytest.raises(TypeError, match="salt must be"):
        hash_values(["a"], salt=-1)


def test_reserved_id_is_never_produced() -> None:
    # The one value whose hash is RESERVED_ID: the inverse of mix64 of all ones.
    from persia_py.ids.hashing import inverse_mix64
    value = inverse_mix64(np.array([RESERVED_ID]), 0)
    assert hash_values(value)[0] == RESERVED_ID - np.uint64(1)


@pytest.mark.parametrize("ids", [
    np.array([3, 0, 9], np.int64), np.array([3, 0, 9], np.uint64), np.array([3, 0, 9], np.int32),
    torch.tensor([3, 0, 9]), torch.tensor([3, 0, 9], dtype=torch.int32), [3, 0, 9]])
def test_ids_enter_as_int64_or_uint64_numpy_or_torch(ids) -> None:
    np.testing.assert_array_equal(as_ids(ids, feature="f"), np.array([3, 0, 9], np.uint64))
    single = IDTypeFeatureWithSingleID("f", ids)
    assert single.ids.dtype == np.uint64 and single.ids.tolist() == [3, 0, 9]
    csr = IDTypeFeature.from_csr("f", ids, np.array([2, 1]))
    assert csr.ids.tolist() == [3, 0, 9] and csr.lengths.tolist() == [2, 1]


def test_lil_samples_may_mix_int64_and_uint64_and_torch() -> None:
    feature = IDTypeFeature("tags", [np.array([1, 2], np.int64), np.array([], np.uint64),
                                     torch.tensor([2**62]), np.array([5], np.uint64)])
    assert feature.ids.dtype == np.uint64
    assert feature.ids.tolist() == [1, 2, 2**62, 5] and feature.lengths.tolist() == [2, 0, 1, 1]


def test_negative_and_non_integer_ids_are_refused_naming_the_feature() -> None:
    with pytest.raises(ValueError, match=r"feature 'C3': ids must be >= 0, got -2 at position 1"):
        IDTypeFeatureWithSingleID("C3", np.array([1, -2, -5], np.int64))
    with pytest.raises(ValueError, match=r"feature 'tags': ids must be >= 0"):
        IDTypeFeature("tags", [np.array([1]), torch.tensor([-1])])
    with pytest.raises(ValueError, match=r"feature 'C4': ids must be >= 0"):
        IDTypeFeature.from_csr("C4", torch.tensor([-3]), np.array([1]))
    with pytest.raises(TypeError, match=r"feature 'C5': ids must be integers .*hash_values"):
        IDTypeFeatureWithSingleID("C5", np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"feature 'C6': id 18446744073709551615 .* reserved"):
        IDTypeFeatureWithSingleID("C6", np.array([RESERVED_ID]))
    with pytest.raises(ValueError, match=r"feature 'C7': ids must be 1-D"):
        as_ids(np.zeros((2, 2), np.int64), feature="C7")
