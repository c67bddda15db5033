"""How much memory a parameter server's tables can take, against what it can have.

A table's arrays are reserved for its whole ``capacity`` as address space (see
:mod:`persia_py.servers.memory`), so a capacity larger than memory is not refused at
start: it is found out when the rows fill and the process is killed. This module
measures the memory a parameter server can have (:func:`memory_limit`: its cgroup's
limit, else the machine's), bounds the tables whose capacity is unset by it
(:func:`derived_capacity`), and says when the capacities that are set, full, cannot fit
(:func:`capacity_warning`).

Bytes of one row (:func:`row_bytes`), from the arrays of ``servers/shard.py`` and
``servers/hash_index.py``: the weights (4 bytes each, 2 in float16 or bfloat16 rows),
the optimizer's state (float32: ``state_width`` values), the id (8 bytes) and the
last-access stamp (2, :mod:`persia_py.servers.access_clock`), and the hash index of 4-byte
row numbers, kept between 0.48 and 3/5 full: 6.7 to 8.3 bytes a row, 7.3 on average
(:func:`index_bytes` has the exact figure for a number of rows). docs/sizing.md has the
table by dim and optimizer and the measured figure it is checked against.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from persia_py.config import EmbeddingTablesConfig, GlobalConfig
from persia_py.config.table_policy import MAX_CAPACITY
from persia_py.ops import huge_pages
from persia_py.servers.admission import frequency_sketch_bytes
from persia_py.servers.disk_tier import file_geometry, record_layout
from persia_py.servers.hash_index import index_bytes
from persia_py.servers.memory import HUGE_PAGE
from persia_py.servers.optimizers import optimizer_from_dict, state_width
from persia_py.servers.row_types import bytes_per_weight
from persia_py.servers.shard_arrays import row_dtypes

FLOAT_BYTES = 4
ID_AND_STAMP_BYTES = row_dtypes()["ids"].itemsize + row_dtypes()["last_access"].itemsize
"""``ids`` (uint64) and ``last_access`` (uint16 stamps) per row."""
INDEX_BYTES_PER_ROW = 8
"""Hash-index slots (4-byte row numbers) per row, rounded up from the 7.3 average of a
growth step (6.7 to 8.3)."""
_UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this means no limit (the kernel writes ~2**63)."""
TABLE_MEMORY_SHARE = 0.5
"""Share of :func:`memory_limit` that the tables whose capacity is unset may fill,
together with the full tables whose capacity is set. The rest is the process's own
(Python, numba, gRPC: about 175 MiB; messages in flight; a checkpoint or export being
written) and, without a cgroup limit, the machine's other processes."""
MIN_DERIVED_ROWS = 100_000
"""The least capacity an unset table gets, even where the set ones leave less room
(those warn)."""
UNKNOWN_MEMORY_CAPACITY = 1_000_000_000
"""An unset table's capacity where the memory cannot be read (not Linux)."""


def row_bytes(dim: int, state_width: int, weight_bytes: int = FLOAT_BYTES) -> int:
    """Resident bytes of one full row of width ``dim`` with ``state_width`` optimizer
    state columns (SGD 0, Adagrad ``dim`` or 1, Adam ``2 * dim + 1``), each weight taking
    ``weight_bytes`` (4 for float32 rows, 2 for float16 and bfloat16; state is float32)."""
    return (weight_bytes * dim + FLOAT_BYTES * state_width + ID_AND_STAMP_BYTES
            + INDEX_BYTES_PER_ROW)


@dataclass(frozen=True)
class TableBytes:
    """Resident bytes of one table's arrays on one replica, by part."""

    weights: int
    state: int
    ids_and_stamps: int
    index: int

    @property
    def total(self) -> int:
        return self.weights + self.state + self.ids_and_stamps + self.index


def table_bytes(rows: int, dim: int, state_width: int, *, num_shards: int = 1,
                weight_bytes: int = FLOAT_BYTES) -> TableBytes:
    """Bytes of a table holding ``rows`` rows over ``num_shards`` internal shards (the
    keyed hash spreads rows evenly), from the element types the shards allocate with and
    the slot count their indexes reach: what :mod:`persia_py.launcher.plan` adds up."""
    dtypes = row_dtypes()
    per_shard = -(-rows // num_shards)
    return TableBytes(
        weights=rows * dim * weight_bytes,
        state=rows * state_width * dtypes["state"].itemsize,
        ids_and_stamps=rows * (dtypes["ids"].itemsize + dtypes["last_access"].itemsize),
        index=num_shards * index_bytes(per_shard),
    )


@dataclass(frozen=True)
class TierBytes:
    """Bytes of one table's disk tier on one replica: its files, and the RAM it keeps
    for them (the slot fingerprints, the index of the rows on disk, TTL stamps, the
    sketch of lookups it evicts by)."""

    disk: int
    ram: int


def tier_bytes(capacity_rows: int, disk_rows: int, dim: int, state_width: int, *,
               num_shards: int = 1, weight_bytes: int = FLOAT_BYTES,
               free_fraction: float = 1 / 8, stamped: bool = False,
               ram_rows: int = 0) -> TierBytes:
    """Bytes of a table's tier configured with ``capacity_rows`` (split among
    ``num_shards``, as the table splits it) holding ``disk_rows``: the file geometry of
    :func:`persia_py.servers.disk_tier.file_geometry` (reserved whole at start) and the
    arrays the tier allocates (``stamped``: with a TTL, 4 bytes a slot more), with the
    sketch of lookups its shards of ``ram_rows`` in RAM evict by."""
    weight = np.dtype({4: np.float32, 2: np.float16}[weight_bytes])
    _, block, per_block = record_layout(dim, weight, state_width)
    shard_rows = -(-capacity_rows // num_shards)
    segments, segment_blocks = file_geometry(shard_rows, block, per_block, free_fraction)
    slots = segments * segment_blocks * per_block
    per_slot = 4 + (4 if stamped else 0)  # a fingerprint (tier_index), a stamp (TTL)
    return TierBytes(disk=num_shards * segments * segment_blocks * block,
                     ram=num_shards * (slots * per_slot
                                       + index_bytes(-(-disk_rows // num_shards))
                                       + frequency_sketch_bytes(-(-ram_rows // num_shards))))


def huge_page_slack(num_shards: int) -> int:
    """Resident bytes past the rows in ``num_shards`` shards' reserved arrays: each of
    the four is backed by 2 MiB huge pages (4 KiB pages where they do not pay,
    :mod:`persia_py.ops.huge_pages`), and its last one is half full on average."""
    page = HUGE_PAGE if huge_pages.enabled() else mmap.PAGESIZE
    return num_shards * 4 * page // 2


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process can get, and where that figure comes from."""

    bytes: int
    source: str


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """The memory this process can have: the least of its cgroup's memory limit (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``; the group's own or an ancestor's) and
    the machine's (``MemTotal``). Both are fixed while the process runs, unlike the
    memory free at one moment, so capacities derived from it do not change between two
    starts on the same machine. None where neither can be read (not Linux). ``root``
    prefixes the paths (for tests)."""
    base = Path(root)
    found = [m for m in (_cgroup_limit(base), _mem_total(base)) if m is not None]
    return min(found, key=lambda m: m.bytes) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_limit(base: Path) -> MemoryLimit | None:
    """The least memory limit of this process's cgroup and its ancestors. A group's
    path in ``/proc/self/cgroup`` is relative to the hierarchy's root; in a container
    with its own cgroup namespace, or whose group is mounted as the root, the path may
    not exist under the mount: then the mount's own limit is the group's."""
    found = []
    for line in (_read(base / "proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            mount, name = base / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            mount, name = base / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the group, then each ancestor
            text = _read(mount.joinpath(*parts[:depth], name))
            if text is not None and text.isdigit() and int(text) < _UNLIMITED:
                found.append(MemoryLimit(int(text), f"the cgroup limit ({name})"))
    return min(found, key=lambda m: m.bytes) if found else None


def _mem_total(base: Path) -> MemoryLimit | None:
    for line in (_read(base / "proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return MemoryLimit(int(fields[1]) * 1024,
                                   "the machine's memory, MemTotal in /proc/meminfo")
    return None


@dataclass(frozen=True)
class TableSize:
    """One table of this replica: its name, rows at most, bytes of a row, and whether
    its capacity was configured (else it is derived from the memory)."""

    name: str
    capacity: int
    row_bytes: int
    configured: bool = True

    @property
    def bytes(self) -> int:
        return self.capacity * self.row_bytes


def derived_capacity(unset_row_bytes: list[int], configured_bytes: int,
                     limit: MemoryLimit | None) -> int:
    """Rows each table whose capacity is unset may hold: together, full, with the tables
    whose capacity is set (``configured_bytes``, full), they take at most
    :data:`TABLE_MEMORY_SHARE` of ``limit``. ``unset_row_bytes``: a row's bytes in each
    unset table; all of them get the same rows."""
    if limit is None:
        return UNKNOWN_MEMORY_CAPACITY
    room = int(limit.bytes * TABLE_MEMORY_SHARE) - configured_bytes
    rows = room // max(1, sum(unset_row_bytes))
    return int(min(max(rows, MIN_DERIVED_ROWS), MAX_CAPACITY))


def capacity_warning(tables: list[TableSize], limit: MemoryLimit | None, *,
                     what: str) -> str | None:
    """A message when the tables whose capacity is configured, full, take more than
    ``limit``; None when they fit (or nothing is known of the memory). The others are
    bounded by it already (:func:`derived_capacity`). ``what`` says which optimizer
    state is counted."""
    tables = [t for t in tables if t.configured]
    if limit is None or not tables:
        return None
    total = sum(t.bytes for t in tables)
    if total <= limit.bytes:
        return None
    largest = sorted(tables, key=lambda t: -t.bytes)[:3]
    detail = ", ".join(f"{t.name}: {t.capacity:,} rows x {t.row_bytes} B = {_gib(t.bytes)}"
                       for t in largest)
    fit = max(1, limit.bytes * max(t.capacity for t in tables) // total)
    return (f"the configured capacity of this parameter server's {len(tables)} table(s), "
            f"full, takes {_gib(total)} ({what}), more than the {_gib(limit.bytes)} it can "
            f"have ({limit.source}); largest: {detail}. The process will be killed when the "
            f"rows fill; lower embedding_parameter_server_config.capacity (or "
            f"slots_config.<slot>.capacity; about {fit:,} rows for the largest table, "
            f"scaled alike for the others), leave it unset (bounded by the memory), or add "
            f"parameter servers (see docs/sizing.md)")


def derived_capacity_note(tables: list[TableSize], limit: MemoryLimit | None) -> str | None:
    """What the tables whose capacity is unset were bounded to, and why (None: every
    table has a capacity)."""
    unset = [t for t in tables if not t.configured]
    if not unset:
        return None
    names = ", ".join(t.name for t in unset)
    rows = f"{unset[0].capacity:,} rows"
    if limit is None:
        return (f"capacity unset for table(s) {names}: {rows} each (this process cannot "
                f"read its memory); set capacity to change it")
    return (f"capacity unset for table(s) {names}: {rows} each, so that the tables, "
            f"full, take at most {TABLE_MEMORY_SHARE:.0%} of the {_gib(limit.bytes)} this "
            f"process can have ({limit.source}); past that the least recently used rows "
            f"are evicted. Set capacity to change it (see docs/sizing.md)")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def table_sizes(embedding_config: EmbeddingTablesConfig, global_config: GlobalConfig,
                optimizer: dict | None, limit: MemoryLimit | None = None) -> list[TableSize]:
    """Each table's capacity on one replica and bytes of a full row, with the optimizer
    ``optimizer`` (a slot's own wins; None: none, as before configure). A capacity unset
    (the slot's and the global one) is derived from ``limit`` (:func:`derived_capacity`)."""
    default_capacity = global_config.embedding_parameter_server_config.capacity
    sizes = []
    for name, slots in embedding_config.tables.items():
        slot = embedding_config.slots_config[slots[0]]
        chosen = slot.optimizer or optimizer
        width = 0 if chosen is None else state_width(optimizer_from_dict(chosen), slot.dim)
        weight_bytes = bytes_per_weight(embedding_config.row_dtype_of(name))
        capacity = slot.capacity or default_capacity
        sizes.append(TableSize(name, capacity or 0, row_bytes(slot.dim, width, weight_bytes),
                               configured=capacity is not None))
    configured = sum(t.bytes for t in sizes if t.configured)
    rows = derived_capacity([t.row_bytes for t in sizes if not t.configured], configured,
                            limit)
    return [t if t.configured else TableSize(t.name, rows, t.row_bytes, configured=False)
            for t in sizes]
