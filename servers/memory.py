"""Big row arrays backed by transparent huge pages.

A parameter server reads rows at random over gigabytes, so nearly every row costs a
TLB miss, and under a hypervisor each miss is a two-level page walk. Backing the
arrays with 2 MiB pages instead of 4 KiB ones cuts those walks ~500-fold. numpy
advises huge pages for its own big allocations too, but only over the part of a
``malloc`` block that happens to be 2 MiB aligned, and only when the kernel's policy is
not "never"; here every big array is its own aligned anonymous mapping, advised
explicitly. Pages are still allocated on first touch, so reserved but unused capacity
costs address space, not memory.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE
"""Below this an array is a plain ``numpy.empty`` (huge pages would mostly be waste)."""


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized C-contiguous array, on huge pages when it is big enough."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    # Anonymous private memory (shared anonymous memory would be shmem, which follows a
    # different huge-page policy), over-sized by one huge page to start on a boundary.
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(buffer, dtype=np.uint8)
    offset = -base.ctypes.data % HUGE_PAGE
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)  # mmap memory is page aligned
    except OSError:  # a kernel without THP: plain pages, same semantics
        pass
    return base[offset:offset + nbytes].view(dtype).reshape(shape)
