"""How much memory a parameter server's tables can take, against what it can get.

A table's arrays are reserved for its whole ``capacity`` as address space (see
:mod:`persia_py.servers.memory`), so a capacity larger than memory is not refused at
start: it is found out when the rows fill and the process is killed. This module says so
before: :func:`capacity_warning` compares the bytes the configured capacities take when
full with the memory this process can get, and the parameter server logs it at start and
again when the optimizer is known (the tables are built).

Bytes of one row (:func:`row_bytes`), from the arrays of ``servers/shard.py`` and
``servers/hash_index.py``: the weights (4 bytes each, 2 in float16 or bfloat16 rows),
the optimizer's state (float32: ``state_width`` values), the id (8 bytes) and the
last-access stamp (2, :mod:`persia_py.servers.access_clock`), and the hash index of 4-byte
row numbers, kept between 0.48 and 3/5 full: 6.7 to 8.3 bytes a row, 7.3 on average
(:func:`index_bytes` has the exact figure for a number of rows). docs/sizing.md has the
table by dim and optimizer and the measured figure it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from persia_py.config import EmbeddingTablesConfig, GlobalConfig
from persia_py.servers.hash_index import index_bytes
from persia_py.servers.memory import HUGE_PAGE
from persia_py.servers.optimizers import optimizer_from_dict, state_width
from persia_py.servers.row_types import bytes_per_weight
from persia_py.servers.shard import row_dtypes

FLOAT_BYTES = 4
ID_AND_STAMP_BYTES = row_dtypes()["ids"].itemsize + row_dtypes()["last_access"].itemsize
"""``ids`` (uint64) and ``last_access`` (uint16 stamps) per row."""
INDEX_BYTES_PER_ROW = 8
"""Hash-index slots (4-byte row numbers) per row, rounded up from the 7.3 average of a
growth step (6.7 to 8.3)."""
_UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this means no limit (the kernel writes ~2**63)."""


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


def huge_page_slack(num_shards: int) -> int:
    """Resident bytes past the rows in ``num_shards`` shards' reserved arrays: each of
    the four is backed by 2 MiB huge pages, and its last one is half full on average."""
    return num_shards * 4 * HUGE_PAGE // 2


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process can get, and where that figure comes from."""

    bytes: int
    source: str


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """The least of this process's cgroup memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) and the machine's ``MemAvailable``; None where neither
    can be read (not Linux). ``root`` prefixes the paths (for tests)."""
    base = Path(root)
    found = []
    cgroup = _cgroup_limit(base)
    if cgroup is not None:
        found.append(cgroup)
    available = _mem_available(base)
    if available is not None:
        found.append(available)
    return min(found, key=lambda m: m.bytes) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_limit(base: Path) -> MemoryLimit | None:
    lines = (_read(base / "proc/self/cgroup") or "").splitlines()
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            candidates = [base / "sys/fs/cgroup" / rel / "memory.max",
                          base / "sys/fs/cgroup/memory.max"]
            name = "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            candidates = [base / "sys/fs/cgroup/memory" / rel / "memory.limit_in_bytes",
                          base / "sys/fs/cgroup/memory/memory.limit_in_bytes"]
            name = "memory.limit_in_bytes"
        else:
            continue
        for candidate in candidates:
            text = _read(candidate)
            if text is None or text == "max":
                continue
            if text.isdigit() and int(text) < _UNLIMITED:
                return MemoryLimit(int(text), f"the cgroup limit ({name})")
    return None


def _mem_available(base: Path) -> MemoryLimit | None:
    for line in (_read(base / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return MemoryLimit(int(fields[1]) * 1024, "MemAvailable in /proc/meminfo")
    return None


@dataclass(frozen=True)
class TableSize:
    """One table of this replica: its name, rows at most, and bytes of a row."""

    name: str
    capacity: int
    row_bytes: int

    @property
    def bytes(self) -> int:
        return self.capacity * self.row_bytes


def capacity_warning(tables: list[TableSize], limit: MemoryLimit | None, *,
                     what: str) -> str | None:
    """A message when the tables, full, take more than ``limit``; None when they fit
    (or nothing is known of the memory). ``what`` says which optimizer state is
    counted."""
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
            f"get ({limit.source}); largest: {detail}. The process will be killed when the "
            f"rows fill; lower embedding_parameter_server_config.capacity (or "
            f"slots_config.<slot>.capacity; about {fit:,} rows for the largest table, "
            f"scaled alike for the others), or add parameter servers (see docs/sizing.md)")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def table_sizes(embedding_config: EmbeddingTablesConfig, global_config: GlobalConfig,
                optimizer: dict | None) -> list[TableSize]:
    """Each table's capacity on one replica and bytes of a full row, with the optimizer
    ``optimizer`` (a slot's own wins; None: none, as before configure)."""
    default_capacity = global_config.embedding_parameter_server_config.capacity
    sizes = []
    for name, slots in embedding_config.tables.items():
        slot = embedding_config.slots_config[slots[0]]
        chosen = slot.optimizer or optimizer
        width = 0 if chosen is None else state_width(optimizer_from_dict(chosen), slot.dim)
        weight_bytes = bytes_per_weight(embedding_config.row_dtype_of(name))
        sizes.append(TableSize(name, slot.capacity or default_capacity,
                               row_bytes(slot.dim, width, weight_bytes)))
    return sizes
