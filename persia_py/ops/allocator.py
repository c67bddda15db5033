"""malloc settings for processes that move big messages (glibc only).

Every role builds and parses messages of tens of MB per step. With glibc's defaults
such a buffer often lands in memory just handed back to the kernel, so each use starts
with a page fault per 4 KiB, thousands per answer (docs/benchmarks.md). Four
settings stop that:

* ``glibc.malloc.hugetlb=1``: malloc'd memory is advised for transparent huge pages,
  so a fresh buffer faults once per 2 MiB (only where huge pages pay,
  :mod:`persia_py.ops.huge_pages`; where they do not, numpy is told not to advise them
  either: ``NUMPY_MADVISE_HUGEPAGE=0``);
* ``glibc.malloc.mmap_threshold`` 32 MiB: buffers below it come from the heap (and are
  reused) instead of a fresh mapping each time;
* ``glibc.malloc.trim_threshold`` 4 GiB: freed heap memory is kept for the next
  message instead of being returned and faulted in again;
* ``glibc.malloc.arena_max`` 2: the gRPC threads share two arenas instead of one each
  (up to 8 per core), so a message's buffer is more often one another thread just freed
  than fresh memory to fault in and zero.

The cost is memory: a process keeps its peak message working set. glibc reads
``GLIBC_TUNABLES`` once, at start, so launchers put it in the environment of the
processes they start (:func:`with_tunables`); a process started some other way gets
the two thresholds at run time (:func:`tune_this_process`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from persia_py.ops import huge_pages

MMAP_THRESHOLD = 32 << 20
"""The most glibc accepts (half its 64 MiB heap size on 64-bit hosts)."""
TRIM_THRESHOLD = 4 << 30
ARENA_MAX = 2
BASE_TUNABLES = (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}"
                 f":glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
                 f":glibc.malloc.arena_max={ARENA_MAX}")
"""The ``GLIBC_TUNABLES`` value for persia_py processes where huge pages do not pay, and
for those started where that is not known yet (Kubernetes pods: the node is chosen later)."""
TUNABLES = f"glibc.malloc.hugetlb=1:{BASE_TUNABLES}"
"""The ``GLIBC_TUNABLES`` value for persia_py processes where huge pages pay."""
NUMPY_HUGE_PAGES = "NUMPY_MADVISE_HUGEPAGE"

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def with_tunables(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`TUNABLES` added (:data:`BASE_TUNABLES` where huge pages do not
    pay under ``env``'s ``PERSIA_HUGE_PAGES``, with numpy's own advice off too), unless it
    sets them already (a user's choice wins) or this is not Linux. Raises ValueError for a
    ``PERSIA_HUGE_PAGES`` that is none of its choices."""
    if sys.platform != "linux":
        return env
    huge = huge_pages.enabled(env)
    added = {"GLIBC_TUNABLES": TUNABLES if huge else BASE_TUNABLES}
    if not huge:
        added[NUMPY_HUGE_PAGES] = "0"
    return {**added, **env}


def tune_this_process() -> bool:
    """Set the two thresholds in this running process (huge pages for malloc can only be
    chosen at start), and numpy's advice of huge pages where they do not pay (unless
    ``NUMPY_MADVISE_HUGEPAGE`` chose); returns False, the thresholds untouched, where the
    C library is not glibc, or when ``GLIBC_TUNABLES`` was set for this process already."""
    if sys.platform != "linux":
        return False
    if NUMPY_HUGE_PAGES not in os.environ and not huge_pages.enabled():
        _numpy_advice(False)
    if "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, min(TRIM_THRESHOLD, 2**31 - 1)))


def _numpy_advice(on: bool) -> None:
    """numpy's advice of huge pages for its big arrays, as ``NUMPY_MADVISE_HUGEPAGE``
    sets it at import (numpy has no public call for it: a numpy without this one keeps
    its own choice)."""
    try:
        from numpy._core import multiarray
    except ImportError:
        return
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(on)
