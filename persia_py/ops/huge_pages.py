"""Whether this machine's big memory should be on transparent huge pages.

Huge pages spare a parameter server's random row reads most TLB misses
(:mod:`persia_py.servers.memory`) and fault a fresh buffer once per 2 MiB instead of
512 times (:mod:`persia_py.ops.allocator`), so where the memory is the machine's own they
are worth their first touch. A virtual machine whose balloon reports free pages to its
host (virtio-balloon free page reporting) gives every free 2 MiB block back: a huge page
faulted later is one the host must back again, page by page, and that costs many times
a 4 KiB page's first touch, on the batch's path while a table grows; in a long run's
steady state 4 KiB pages were as fast there (docs/benchmarks.md, "Huge pages"). Where the
host backs a guest's memory with 4 KiB pages, a guest's huge page also saves it few TLB
misses.

``PERSIA_HUGE_PAGES`` chooses, for every role a launcher starts and for the tables of a
process that imports persia_py: ``auto`` (the default: off where the host takes free
pages back, on elsewhere), ``on`` or ``off``.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Mapping

ENV = "PERSIA_HUGE_PAGES"
CHOICES = ("auto", "on", "off")
BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon/virtio*/features"
"""Each virtio device's feature bits in sysfs, a string of 0s and 1s, bit 0 first."""
FREE_PAGE_REPORTING_BIT = 5
"""``VIRTIO_BALLOON_F_REPORTING`` in the virtio specification (1.2, 5.5.3)."""


def choice(environ: Mapping[str, str] = os.environ) -> str:
    """The ``PERSIA_HUGE_PAGES`` setting of ``environ`` (``auto`` when unset)."""
    value = environ.get(ENV, "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    return value


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether big memory goes on huge pages under ``environ``'s setting, on this machine."""
    value = choice(environ)
    return value == "on" or (value == "auto" and not host_takes_free_pages())


@functools.cache
def host_takes_free_pages(pattern: str = BALLOON_DEVICES) -> bool:
    """Whether a virtio balloon of this machine reports free pages to its host."""
    for path in glob.glob(pattern):
        try:
            with open(path, encoding="ascii") as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > FREE_PAGE_REPORTING_BIT and bits[FREE_PAGE_REPORTING_BIT] == "1":
            return True
    return False
