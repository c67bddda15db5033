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

from persia_py.servers.access_clock import STAMP_DTYPE
from persia_py.servers.hash_index import _find_kernel
from persia_py.servers.hash_probe import homes_and_tags
from persia_py.servers.kernels import SGD, _rows_repeat, adaptive_step, sgd_step

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
                ids: tuple, grads: tuple, weights: tuple, state: tuple, stamps: tuple,
                ticks: np.ndarray, offsets: np.ndarray, kinds: np.ndarray,
                sr_keys: np.ndarray, stochastic: np.ndarray, floats: np.ndarray,
                betas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One optimizer step on the stored rows of every table's ids; returns the rows of
    the ids (-1: absent) and how many rows each table stepped, -1 for a table whose ids
    meet one row twice: its rows are not stepped (its caller sums their gradients first:
    ``Shard.step_rows``). ``floats[t]``: lr, weight decay, bound, eps, momentum;
    ``betas[t]``: Adam's two (``optimizers.KernelStep``)."""
    no_weights = np.zeros((0, 1), np.float32)
    no_stamps = np.zeros(0, STAMP_DTYPE)
    rows = np.empty(offsets[count], np.int64)
    stepped = np.empty(count, np.int64)
    for t in range(count):
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
    return rows, stepped
