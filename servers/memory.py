"""Big row arrays backed by transparent huge pages where they pay.

A parameter server reads rows at random over gigabytes, so nearly every row costs a
TLB miss, and under a hypervisor each miss is a two-level page walk. Backing the
arrays with 2 MiB pages instead of 4 KiB ones cuts those walks ~500-fold. numpy
advises huge pages for its own big allocations too, but only over the part of a
``malloc`` block that happens to be 2 MiB aligned, and only when the kernel's policy is
not "never"; here every big array is its own aligned anonymous mapping, advised
explicitly, unless ``PERSIA_HUGE_PAGES`` (by default: the machine) says otherwise.
Pages are still allocated on first touch, so reserved but unused capacity
costs address space, not memory.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

from persia_py.ops import huge_pages

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE
"""Below this an array is a plain ``numpy.empty`` (huge pages would mostly be waste)."""
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
"""Python < 3.12 lacks the constant; 0x4000 on every Linux architecture."""


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized C-contiguous array, on huge pages when it is big enough."""
    array = _mapped(shape, dtype)
    return array if array is not None else np.empty(shape, dtype)


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zero-filled C-contiguous array, on huge pages when it is big enough (fresh
    mappings are zero already: nothing is written until the caller writes)."""
    array = _mapped(shape, dtype)
    return array if array is not None else np.zeros(shape, dtype)


def reserve(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray | None:
    """A zero-filled array whose memory is claimed page by page as it is first written.

    It costs address space, not memory, so a table can take its whole capacity at once
    and never copy rows to grow. None where the OS refuses to promise more than it has
    (``vm.overcommit_memory = 2``, or not Linux); callers then grow arrays as they fill.
    """
    if not _MAP_NORESERVE:
        return None
    try:
        array = _mapped(shape, dtype, _MAP_NORESERVE)
    except (OSError, ValueError, OverflowError):
        return None
    return array if array is not None else np.zeros(shape, dtype)


def _mapped(shape: int | tuple[int, ...], dtype: np.dtype | type, flags: int = 0
            ) -> np.ndarray | None:
    """The array as its own mapping (zero-filled), advised for huge pages where they pay
    (:func:`persia_py.ops.huge_pages.enabled`); None when it is too small."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # Anonymous private memory (shared anonymous memory would be shmem, which follows a
    # different huge-page policy), over-sized by one huge page to start on a boundary.
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    base = np.frombuffer(buffer, dtype=np.uint8)
    offset = -base.ctypes.data % HUGE_PAGE
    try:
        if huge_pages.enabled():
            buffer.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)  # mmap memory is page aligned
    except OSError:  # a kernel without THP: plain pages, same semantics
        pass
    return base[offset:offset + nbytes].view(dtype).reshape(shape)
