"""``persia-launcher plan``: how many machines of what size a job needs, before it runs.

From the embedding config (the job's own YAML), the distinct ids expected per slot, the
optimizer, the row storage type and the machines on offer, it computes the parameter
servers and what each one holds (rows, weights, optimizer state, ids and access stamps,
index, process, messages in flight), the embedding workers and data loaders per NN
worker, and the disk for checkpoints and failure logs.

The bytes of the tables come from :func:`persia_py.servers.sizing.table_bytes`, which
reads the element types and index sizing the parameter server allocates with, so the
plan follows the storage code instead of restating it (``tests/test_plan.py`` fills a
real parameter server and checks its resident memory against the plan). The CPU shares
are the measured ones of docs/sizing.md; the rest of the model is stated where it is
used.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from persia_py.config import EmbeddingTablesConfig, GlobalConfig
from persia_py.servers import sizing
from persia_py.servers.hash_index import max_entries_of_narrow_slots
from persia_py.servers.optimizers import optimizer_from_dict, state_width

WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes of one stored weight by row storage type."""
OPTIMIZERS = {
    "sgd": {"type": "sgd", "lr": 0.01},
    "adagrad": {"type": "adagrad", "lr": 0.01},
    "rowwise-adagrad": {"type": "adagrad", "lr": 0.01, "vectorwise_shared": True},
    "adam": {"type": "adam", "lr": 0.001},
}
"""The optimizers a plan can assume for slots without one of their own (only the state
width matters here, not the hyper-parameters)."""
PS_CORES_PER_NN_WORKER = 0.28
EMBEDDING_WORKER_CORES_PER_NN_WORKER = 0.15
"""CPU a parameter server / embedding worker spent per NN worker in the dense-heavy
training benchmark (docs/sizing.md, docs/benchmarks.md#training-throughput);
embedding-heavy jobs need more."""
PROCESS_BYTES = 185 << 20
"""Resident memory of a parameter server besides its tables and messages: Python, numpy,
numba's kernels and gRPC (about 175 MiB idle: ``python -m benchmarks.density`` prints
it) and the work arrays of its calls (docs/benchmarks.md#parameter-server-density)."""
GRPC_WORKERS = 16
"""Calls a parameter server works on at once (``persia_py.wire.rpc.create_server``)."""
ROUTING_SIGMAS = 4
"""Rows per replica planned at this many standard deviations above the mean: ids are
spread by a hash, so a replica's count is binomial around ``ids / replicas``."""
HANDOVER_LOG_BYTES = 10 << 20
"""A data loader's handover log, bounded by its rewrites (docs/sizing.md)."""
MAX_SERVERS = 1 << 24


@dataclass(frozen=True, kw_only=True)
class Machine:
    """One machine on offer for parameter servers."""

    memory_bytes: int
    """Its memory."""
    cores: int
    """Its CPU cores."""
    usable: float = 0.9
    """Share of the memory the parameter server may take (the rest: the OS, page cache)."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.cores <= 0:
            raise ValueError(f"machine memory and cores must be > 0, got {self.memory_bytes} "
                             f"bytes and {self.cores} cores")
        if not 0 < self.usable <= 1:
            raise ValueError(f"usable must lie in (0, 1], got {self.usable}")


@dataclass(frozen=True, kw_only=True)
class TableDemand:
    """One parameter-server table (a slot, or a feature group) and its expected ids."""

    name: str
    dim: int
    distinct_ids: int
    """Distinct ids the whole job will store in this table."""
    capacity: int | None
    """Most rows per replica (beyond it rows are evicted); None: unset, so each server
    derives it from its memory (:func:`persia_py.servers.sizing.derived_capacity`)."""
    state_width: int
    """Optimizer state columns (float32) of a row."""
    ids_per_sample: float = 1.0
    """Ids a sample brings to this table (for the messages in flight)."""
    row_dtype: str = "float32"
    """Storage type of its weights (a key of :data:`WEIGHT_BYTES`)."""

    def __post_init__(self) -> None:
        if self.row_dtype not in WEIGHT_BYTES:
            raise ValueError(f"table {self.name}: row_dtype must be one of "
                             f"{sorted(WEIGHT_BYTES)}, got {self.row_dtype!r}")

    @property
    def weight_bytes(self) -> int:
        """Bytes of one stored weight."""
        return WEIGHT_BYTES[self.row_dtype]

    @property
    def row_bytes(self) -> int:
        """Resident bytes of one full row (:func:`persia_py.servers.sizing.row_bytes`)."""
        return sizing.row_bytes(self.dim, self.state_width, self.weight_bytes)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What the job runs: its NN workers and their batches."""

    num_nn_workers: int = 1
    nn_workers_per_node: int = 1
    batch_size: int = 1024
    """Samples per batch of one NN worker."""
    wire_bytes: int = 4
    """Bytes of one embedding value on the wire (2 with ``embedding_fp16``)."""
    staleness: int = 2
    """Batches per NN worker looked up but not yet updated."""
    num_internal_shards: int = 1
    """``num_hashmap_internal_shards``."""
    update_log_max_bytes: int = 8 << 30
    """``--update-log-max-bytes`` of each parameter server."""

    def __post_init__(self) -> None:
        for name in ("num_nn_workers", "nn_workers_per_node", "batch_size", "wire_bytes",
                     "staleness", "num_internal_shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def tables_from_config(embedding: EmbeddingTablesConfig, global_config: GlobalConfig,
                       distinct_ids: dict[str, int], optimizer: str,
                       ids_per_sample: dict[str, float] | None = None,
                       row_dtype: str | None = None) -> list[TableDemand]:
    """A :class:`TableDemand` per table of ``embedding``; a table's ids are the sum of its
    slots' (``distinct_ids`` by slot name; a slot missing from it is an error). Each
    table's rows are stored as its config says (the slot's ``row_dtype``, else the
    file's), or all as ``row_dtype`` when given."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    unknown = sorted(set(distinct_ids) - set(embedding.slots_config))
    if unknown:
        raise ValueError(f"distinct ids given for slots {unknown} that embedding_config "
                         f"lacks (slots: {sorted(embedding.slots_config)})")
    ids_per_sample = ids_per_sample or {}
    demands = []
    for table, slots in embedding.tables.items():
        missing = [s for s in slots if s not in distinct_ids]
        if missing:
            raise ValueError(f"no distinct-id count for slot(s) {missing}: give --ids "
                             f"SLOT=N, --ids-all N or --sample DATA")
        first = embedding.slot(slots[0])
        cfg = optimizer_from_dict(first.optimizer or OPTIMIZERS[optimizer])
        capacity = first.capacity or global_config.embedding_parameter_server_config.capacity
        demands.append(TableDemand(
            name=table, dim=first.dim, distinct_ids=sum(distinct_ids[s] for s in slots),
            capacity=capacity, state_width=state_width(cfg, first.dim),
            ids_per_sample=sum(ids_per_sample.get(s, 1.0) for s in slots),
            row_dtype=row_dtype or embedding.row_dtype_of(table)))
    return demands


def rows_per_replica(table: TableDemand, num_servers: int) -> int:
    """Rows one replica holds of ``table``: its share of the ids, at the high end of the
    hash's spread, bounded by the capacity (when set)."""
    mean = table.distinct_ids / num_servers
    rows = min(math.ceil(mean + ROUTING_SIGMAS * math.sqrt(mean)), table.distinct_ids)
    return rows if table.capacity is None else min(rows, table.capacity)


def derived_capacity(tables: list[TableDemand], machine: Machine) -> int | None:
    """The capacity a server on ``machine`` gives each table whose capacity is unset
    (the one the parameter server derives: :func:`persia_py.servers.sizing.derived_capacity`);
    None: every table has one."""
    unset = [t.row_bytes for t in tables if t.capacity is None]
    if not unset:
        return None
    configured = sum(t.capacity * t.row_bytes for t in tables if t.capacity is not None)
    return sizing.derived_capacity(unset, configured, sizing.MemoryLimit(
        machine.memory_bytes, "the machine's memory"))


def server_memory(tables: list[TableDemand], num_servers: int,
                  workload: Workload) -> dict[str, int]:
    """Bytes of one parameter server by part, and ``total``."""
    parts = dict.fromkeys(("rows", "weights", "optimizer_state", "ids_and_stamps", "index"), 0)
    shards = workload.num_internal_shards
    for table in tables:
        rows = rows_per_replica(table, num_servers)
        arrays = sizing.table_bytes(rows, table.dim, table.state_width, num_shards=shards,
                                    weight_bytes=table.weight_bytes)
        parts["rows"] += rows
        parts["weights"] += arrays.weights
        parts["optimizer_state"] += arrays.state
        parts["ids_and_stamps"] += arrays.ids_and_stamps
        parts["index"] += arrays.index
    parts["huge_page_slack"] = sizing.huge_page_slack(len(tables) * shards)
    parts["process"] = PROCESS_BYTES
    parts["messages_in_flight"] = _in_flight(tables, num_servers, workload)
    parts["total"] = sum(v for k, v in parts.items() if k != "rows")
    return parts


def _in_flight(tables: list[TableDemand], num_servers: int, workload: Workload) -> int:
    """Lookup answers and gradient updates a replica holds at once: every call it works on
    carries its share of one batch's ids of every table, each id with its vector (an
    upper bound: a batch's repeated ids travel once). They stay resident after the calls:
    the allocator keeps its peak message working set (``persia_py.ops.allocator``)."""
    per_call = sum(workload.batch_size * t.ids_per_sample / num_servers
                   * (8 + t.dim * workload.wire_bytes) for t in tables)
    calls = min(GRPC_WORKERS, workload.num_nn_workers * workload.staleness * 2)
    return math.ceil(per_call * calls)


def _servers_by_memory(tables: list[TableDemand], machine: Machine,
                       workload: Workload) -> int:
    """Fewest servers whose each one's memory fits ``machine`` (bisection: a server's
    bytes only shrink as servers are added)."""
    budget = machine.memory_bytes * machine.usable
    derived = derived_capacity(tables, machine)

    def fits(n: int) -> bool:  # and the unset tables' rows within the derived capacity
        return (server_memory(tables, n, workload)["total"] <= budget
                and (derived is None or all(rows_per_replica(t, n) <= derived
                                            for t in tables if t.capacity is None)))

    if not fits(MAX_SERVERS):
        least = server_memory(tables, MAX_SERVERS, workload)["total"]
        if least <= budget:
            raise ValueError(f"no number of parameter servers holds the ids of the tables "
                             f"whose capacity is unset within the {derived:,} rows a server "
                             f"of {_gib(machine.memory_bytes)} derives for each beside the "
                             f"tables whose capacity is set: lower those capacities")
        raise ValueError(f"no number of parameter servers fits machines of "
                         f"{_gib(machine.memory_bytes)}: the process and messages in flight "
                         f"alone take {_gib(least)}")
    low, high = 1, MAX_SERVERS
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return low


def make_plan(tables: list[TableDemand], *, machine: Machine, workload: Workload) -> dict:
    """The layout: servers, per-server memory by part, workers, disk (JSON-ready)."""
    by_memory = _servers_by_memory(tables, machine, workload)
    by_cpu = math.ceil(workload.num_nn_workers * PS_CORES_PER_NN_WORKER / machine.cores)
    num_servers = max(by_memory, by_cpu)
    memory = server_memory(tables, num_servers, workload)
    evicting = [t.name for t in tables if t.capacity is not None
                and t.capacity < math.ceil(t.distinct_ids / num_servers)]
    checkpoint = sum(rows_per_replica(t, num_servers) * checkpoint_row_bytes(
        t.dim, t.state_width, t.weight_bytes) for t in tables)
    nodes = math.ceil(workload.num_nn_workers / workload.nn_workers_per_node)
    notes = _index_notes(tables, num_servers, workload.num_internal_shards)
    derived = derived_capacity(tables, machine)
    if derived is not None:
        unset = ", ".join(t.name for t in tables if t.capacity is None)
        notes.insert(0, f"capacity unset for {unset}: each server bounds each of them at "
                        f"{derived:,} rows (with the tables whose capacity is set, "
                        f"{sizing.TABLE_MEMORY_SHARE:.0%} of its memory; docs/sizing.md); the "
                        f"servers are counted so that their rows stay within it")
    params = sum(t.distinct_ids * t.dim for t in tables)
    return {
        "parameter_servers": num_servers,
        "servers_by_memory": by_memory,
        "servers_by_cpu": by_cpu,
        "machine": asdict(machine),
        "memory_per_server": memory,
        "parameters": params,
        "bytes_per_parameter": (memory["total"] * num_servers / params) if params else 0.0,
        "tables": [{**asdict(t), "rows_per_server": rows_per_replica(t, num_servers)}
                   for t in tables],
        "tables_evicting": evicting,
        "notes": notes,
        "embedding_workers": max(1, math.ceil(
            workload.num_nn_workers * EMBEDDING_WORKER_CORES_PER_NN_WORKER)),
        "data_loaders": nodes,
        "nn_workers": workload.num_nn_workers,
        "disk_per_server": {
            # The newest complete checkpoint stays while the next one is written.
            "checkpoints": 2 * checkpoint,
            "update_log": workload.update_log_max_bytes,
        },
        "disk_per_data_loader": {"handover_log": HANDOVER_LOG_BYTES},
    }


def _index_notes(tables: list[TableDemand], num_servers: int, num_shards: int) -> list[str]:
    """Tables whose internal shards are too big for 4-byte index slots, and the shard count
    that would keep them at 4."""
    notes = []
    for table in tables:
        rows = rows_per_replica(table, num_servers)
        need = math.ceil(rows / max_entries_of_narrow_slots())
        if need > num_shards:
            notes.append(f"table {table.name}: {rows:,} rows per server need 8-byte index "
                         f"slots in {num_shards} internal shard(s); "
                         f"num_hashmap_internal_shards >= {need} keeps them at 4 bytes")
    return notes


def checkpoint_row_bytes(dim: int, state_width: int, weight_bytes: int) -> int:
    """Bytes of one row in a checkpoint: its files' element types (``servers/checkpoint``),
    weights as stored."""
    from persia_py.servers.checkpoint import _ARRAYS  # imports grpc: only plans pay

    size = {name: np.dtype(dtype).itemsize for name, dtype in _ARRAYS.items()}
    return (size["ids"] + size["last_access"] + dim * weight_bytes
            + state_width * size["state"])


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"
