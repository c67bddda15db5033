"""Bring your own data: categorical values to the ``uint64`` ids a slot takes.

* :func:`hash_values` turns strings (``str`` or ``bytes``) or integers into stable ids,
  over the whole array at once (a compiled numba pass over its memory for strings, numpy
  for integers: no Python loop per value). The hash is named and
  fixed forever, so the same value gets the same id in every process, on every machine
  and under every Python version (unlike Python's ``hash()``, which is randomized per
  process for strings):

  - a string: **FNV-1a 64** of its UTF-8 bytes, then splitmix64's finalizer
    (:func:`persia_py.ids.hashing.mix64`) of that with the salt;
  - an integer: splitmix64's finalizer of its 64-bit two's-complement value with the salt;
  - the salt: FNV-1a 64 of the salt string's UTF-8 bytes (``""`` gives 0: no salt).

  The one id a table cannot store (``RESERVED_ID``, all ones) is mapped to the id below it.

* :func:`as_ids` checks and converts ids that are already integers (numpy arrays of any
  integer dtype, torch tensors, lists) to a 1-D ``uint64`` array, refusing negative values
  and ``RESERVED_ID`` with a message naming the feature. ``IDTypeFeature`` and its kin
  call it, so every public entry of ids takes int64 as well as uint64, numpy or torch.

Salts. Equal values of two slots get equal ids unless their salts differ. With
``feature_index_prefix_bit`` set, every feature group has its own id prefix and no salt is
needed; without it, salt each slot with its name (``hash_values(v, salt="C1")``), and give
slots that share a table (``feature_groups``) the same salt.

    ids = hash_values(np.array(["68fd1e64", "80e26c9b", ""]), salt="C1")  # uint64 [3]

The package's modules hold what every role needs of ids: the keyed in-memory hashes
(:mod:`.hashing`), dedup in order of first position (:mod:`.dedup`), which replica owns
an id (:mod:`.routing`), and batch ids with the data positions checkpoints record
(:mod:`.positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

if TYPE_CHECKING:  # only for the annotation: hashing ids does not import torch
    import torch

__all__ = ["FNV_OFFSET", "FNV_PRIME", "as_ids", "fnv1a64", "hash_values", "salt_of"]

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
"""FNV-1a 64's offset basis."""
FNV_PRIME = np.uint64(0x100000001B3)
"""FNV-1a 64's prime."""
RESERVED_ID = np.uint64(0xFFFFFFFFFFFFFFFF)
"""The one id value a table cannot store (it marks empty slots of the hash index)."""

# numba (and the modules whose kernels it compiles) is imported on the first string hashed,
# not here: every process imports this package (the launcher's through persia_py.env),
# and most of them, the launcher's own and a data loader's, never compile a kernel.


def fnv1a64(strings: np.ndarray) -> np.ndarray:
    """FNV-1a 64 of each element of a numpy ``S`` (bytes) or ``U`` (str, hashed as its
    UTF-8 encoding) array, as uint64, in one compiled pass over the array's memory
    (numba). An element is hashed up to its own length, so its hash does not depend on
    the other values of the array. (NumPy's fixed-width strings drop trailing NULs, so
    ``b"a\\0"`` hashes as ``b"a"``.)"""
    strings = np.ascontiguousarray(strings)
    if strings.dtype.kind not in "SU":
        raise TypeError(f"fnv1a64 takes a numpy bytes or str array (dtype S or U), got "
                        f"{strings.dtype}")
    flat = strings.reshape(-1)
    if strings.dtype.itemsize == 0 or flat.shape[0] == 0:
        return np.full(strings.shape, FNV_OFFSET, dtype=np.uint64)
    from persia_py.ids.fnv import fnv1a64_rows, fnv1a64_utf8_rows

    if strings.dtype.kind == "S":
        data = flat.view(np.uint8).reshape(flat.shape[0], strings.dtype.itemsize)
        return fnv1a64_rows(data).reshape(strings.shape)
    code_points = flat.view(np.uint32).reshape(flat.shape[0], strings.dtype.itemsize // 4)
    return fnv1a64_utf8_rows(code_points).reshape(strings.shape)


def salt_of(salt: str | int) -> np.uint64:
    """The 64-bit salt of ``salt``: FNV-1a 64 of a string's UTF-8 bytes (``""``: 0), or
    an integer in [0, 2**64) as it is."""
    if isinstance(salt, str):
        if not salt:
            return np.uint64(0)
        return np.uint64(fnv1a64(np.array([salt.encode("utf-8")]))[0])
    if isinstance(salt, (int, np.integer)) and not isinstance(salt, bool) and 0 <= salt < 2**64:
        return np.uint64(salt)
    raise TypeError(f"salt must be a str or an int in [0, 2**64), got {salt!r}")


def hash_values(values: np.ndarray | Sequence | object, *, salt: str | int = "") -> np.ndarray:
    """Stable ``uint64`` ids of categorical ``values`` (strings or integers; any shape),
    with ``salt`` (see the module's docstring for the hash, fixed forever).

    ``values`` may be a numpy array of ``str`` (``U``), ``bytes`` (``S``) or integers, a
    list of those, or a torch integer tensor. Anything else (floats, ``None`` among
    strings, mixed types) is a ``TypeError`` saying what to pass; map missing values to a
    string such as ``""`` first."""
    from persia_py.ids.hashing import mix64

    if _is_tensor(values):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    salt64 = salt_of(salt)
    if array.dtype.kind in "US":
        hashed = mix64(fnv1a64(array), salt64)
    elif array.dtype.kind in "iu":
        hashed = mix64(array.astype(np.int64, copy=False).view(np.uint64)
                       if array.dtype.kind == "i" else array.astype(np.uint64, copy=False),
                       salt64)
    else:
        raise TypeError(
            f"hash_values takes str, bytes or integer values (salt {salt!r}); got an array "
            f"of dtype {array.dtype}" + (" (missing values such as None? map them to a "
                                         "string such as '' first)"
                                         if array.dtype == object else ""))
    hashed = np.asarray(hashed, dtype=np.uint64)
    hashed[hashed == RESERVED_ID] = RESERVED_ID - np.uint64(1)
    return hashed


def _is_tensor(values: object) -> TypeGuard[torch.Tensor]:
    return type(values).__module__.startswith("torch") and hasattr(values, "detach")


def as_ids(values: np.ndarray | Sequence[int] | object, *, feature: str) -> np.ndarray:
    """``values`` as a 1-D ``uint64`` array of ids of ``feature``: a numpy array or torch
    tensor of any integer dtype (int64 included), or a list of ints. Negative values and
    ``RESERVED_ID`` are refused (``ValueError`` naming the feature and the first bad
    position); floats and other types are a ``TypeError``. A uint64 numpy array is taken
    as it is, without a copy."""
    if _is_tensor(values):
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        array = values
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"feature {feature!r}: ids must be a 1-D integer array, got "
                            f"{type(values).__name__} ({exc})") from None
        if array.size == 0:
            array = array.astype(np.uint64)
    if array.ndim != 1:
        raise ValueError(f"feature {feature!r}: ids must be 1-D, got shape {array.shape}")
    if array.dtype == np.uint64:
        ids = array
    elif array.dtype.kind == "u":
        return array.astype(np.uint64)
    elif array.dtype.kind == "i":
        negative = np.flatnonzero(array < 0)
        if negative.size:
            i = int(negative[0])
            raise ValueError(
                f"feature {feature!r}: ids must be >= 0, got {int(array[i])} at position {i} "
                f"({negative.size} negative in all); hash signed categorical values with "
                f"persia_py.ids.hash_values")
        return array.astype(np.uint64)
    else:
        raise TypeError(
            f"feature {feature!r}: ids must be integers (numpy int64/uint64 or a torch "
            f"integer tensor), got dtype {array.dtype}; turn strings into ids with "
            f"persia_py.ids.hash_values")
    reserved = np.flatnonzero(ids == RESERVED_ID)
    if reserved.size:
        raise ValueError(f"feature {feature!r}: id {int(RESERVED_ID)} (all ones) is reserved, "
                         f"found at position {int(reserved[0])}")
    return ids
