"""Kernels that serve one request over many tables in one call: a lookup's probes and
gathers, an update's probes and optimizer steps.

Each loops over the tables and runs, per table, the kernels a single table's call runs
(:mod:`persia_py.servers.hash_index`'s probe pipeline, :mod:`persia_py.servers.kernels`'
steps), so the results are those of one call per table, bit for bit; what goes is the
interpreter's work between the calls (a dispatch per kernel, per table, and the
bookkeeping around it: issue 43, docs/benchmarks.md "Parameter server's cost").

The per-table arrays come as tuples of :data:`TABLES_PER_CALL` arrays of one type each
(a numba ``UniTuple``, indexed at run time), padded with empty arrays past ``count``: a
kernel is compiled once per element types, not once per number of tables. Per-table
scalars come as arrays indexed by table; ``offsets[t]:offsets[t + 1]`` is table ``t``'s
part of the returned rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import keyed_hash_one
from persia_py.servers.access_clock import STAMP_DTYPE
from persia_py.servers.hash_index import _find_kernel
from persia_py.servers.hash_probe import home_and_tag, homes_and_tags, probe
from persia_py.servers.kernels import (
    PREFETCH_AHEAD,
    SGD,
    _rows_repeat,
    adaptive_step,
    prefetch_item,
    sgd_step,
)

TABLES_PER_CALL = 32
"""Tables of one kernel call (more: several calls)."""


@njit(cache=True, nogil=True)
def _find(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64, words: np.ndarray,
          tag_mask: np.uint64, row_bits: int, ids: np.ndarray, weights: np.ndarray,
          out: np.ndarray, stamps: np.ndarray, tick: int) -> np.ndarray:
    """``HashIndex.find_gather`` of one table (``out`` with no rows: find only)."""
    home, tags = homes_and_tags(ids, 0, slots.shape[0], words, tag_mask, row_bits)
    return _find_kernel(slots, row_ids, row_mask, ids, home, tags, weights, out,
                        np.empty(0, np.int64), stamps, tick)


@njit(cache=True, nogil=True)
def _find_hinted(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                 words: np.ndarray, tag_mask: np.uint64, row_bits: int, ids: np.ndarray,
                 hint: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """What :func:`_find` returns (no gather) where ``hint`` guesses each id's row
    (:mod:`persia_py.servers.row_hints`): a guess is taken where it is below ``size``
    and holds the id, other ids are probed. Also returns how many guesses held."""
    n = ids.shape[0]
    num_slots = slots.shape[0]
    rows = np.empty(n, np.int64)
    held = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            ahead = hint[i + PREFETCH_AHEAD]
            if 0 <= ahead < size:
                prefetch_item(row_ids, ahead)
        r = np.int64(hint[i])
        if 0 <= r < size and row_ids[r] == ids[i]:
            held += 1
        else:
            home, tag = home_and_tag(keyed_hash_one(ids[i], words), num_slots, tag_mask,
                                     row_bits)
            r = probe(slots, row_ids, ids[i], tag, row_mask, int(home))[1]
        rows[i] = r
    return rows, held


@njit(cache=True, nogil=True)
def find_gather_tables(count: int, slots: tuple, row_ids: tuple, row_masks: np.ndarray,
                       words: tuple, tag_masks: np.ndarray, row_bits: np.ndarray, ids: tuple,
                       weights: tuple, outs: tuple, stamps: tuple, ticks: np.ndarray,
                       offsets: np.ndarray) -> np.ndarray:
    """Rows of every table's ids (-1: absent), each found row copied to its ``outs`` row
    and stamped ``ticks[t]``."""
    rows = np.empty(offsets[count], np.int64)
    for t in range(count):
        rows[offsets[t]:offsets[t + 1]] = _find(
            slots[t], row_ids[t], row_masks[t], words[t], tag_masks[t], row_bits[t], ids[t],
            weights[t], outs[t], stamps[t], ticks[t])
    return rows


@njit(cache=True, nogil=True)
def step_tables(count: int, slots: tuple, row_ids: tuple, row_masks: np.ndarray,
                words: tuple, tag_masks: np.ndarray, row_bits: np.ndarray, sizes: np.ndarray,
                ids: tuple, hints: tuple, grads: tuple, weights: tuple, state: tuple,
                stamps: tuple, ticks: np.ndarray, offsets: np.ndarray, kinds: np.ndarray,
                sr_keys: np.ndarray, stochastic: np.ndarray, floats: np.ndarray,
                betas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One optimizer step on the stored rows of every table's ids; returns the rows of
    the ids (-1: absent), how many rows each table stepped, -1 for a table whose ids
    meet one row twice: its rows are not stepped (its caller sums their gradients first:
    ``Shard.step_rows``), and how many of each table's ``hints`` held (a table's hints:
    int32 guesses of its ids' rows, one per id, or none: :func:`_find_hinted`).
    ``floats[t]``: lr, weight decay, bound, eps, momentum; ``betas[t]``: Adam's two
    (``optimizers.KernelStep``)."""
    no_weights = np.zeros((0, 1), np.float32)
    no_stamps = np.zeros(0, STAMP_DTYPE)
    rows = np.empty(offsets[count], np.int64)
    stepped = np.empty(count, np.int64)
    held = np.zeros(count, np.int64)
    for t in range(count):
        if hints[t].shape[0] == ids[t].shape[0] and ids[t].shape[0]:
            found, held[t] = _find_hinted(slots[t], row_ids[t], row_masks[t], words[t],
                                          tag_masks[t], row_bits[t], ids[t], hints[t],
                                          sizes[t])
        else:
            found = _find(slots[t], row_ids[t], row_masks[t], words[t], tag_masks[t],
                          row_bits[t], ids[t], no_weights, no_weights, no_stamps, 0)
        rows[offsets[t]:offsets[t + 1]] = found
        if _rows_repeat(found, sizes[t]):
            stepped[t] = -1
            continue
        lr, decay, bound, eps, momentum = (floats[t, 0], floats[t, 1], floats[t, 2],
                                           floats[t, 3], floats[t, 4])
        if kinds[t] == SGD:
            stepped[t] = sgd_step(weights[t], found, grads[t], stamps[t], ticks[t], ids[t],
                                  sr_keys[t], stochastic[t], lr, decay, bound)
        else:
            stepped[t] = adaptive_step(kinds[t], weights[t], state[t], found, grads[t],
                                       stamps[t], ticks[t], ids[t], sr_keys[t],
                                       stochastic[t], lr, decay, bound, eps, momentum,
                                       betas[t, 0], betas[t, 1])
    return rows, stepped, held
