"""``persia-launcher plan --machine-disk``: a layout with a disk tier under every table.

Each server gets a RAM budget (the machine's usable memory) and a disk budget (the
tier's files, ``--machine-disk``); the rows a server holds are split between RAM and
disk at one share for every table, the largest whose RAM fits the budget, and the
servers are the fewest whose disk then holds the rest. What a server takes is counted
from the storage's own figures: the rows in RAM as :func:`persia_py.launcher.plan.server_memory`
counts them, the tier's files and RAM (its slot arrays and index) by
:func:`persia_py.servers.sizing.tier_bytes`, which follows the tier's file geometry
(``tests/test_plan_tier.py`` fills a real parameter server with a tier and checks its
resident memory and file bytes against the plan).

Random reads a server's disk must serve: every id a batch asks of it that RAM lacks is
one block read (the tier packs a row in one block). The RAM hit rate is an assumption:
``--ram-hit-rate``, else the RAM share of the rows (what uniformly spread ids would
find: the floor; skewed ids find more, docs/benchmarks.md#disk-tier).
"""

from __future__ import annotations

import dataclasses
import math

from persia_py.launcher.plan import (
    MAX_SERVERS,
    PS_CORES_PER_NN_WORKER,
    Machine,
    TableDemand,
    Workload,
    rows_per_replica,
    server_memory,
)
from persia_py.servers import sizing
from persia_py.servers.disk_tier import DEFAULT_FREE_FRACTION

__all__ = ["DiskBudget", "make_tier_plan", "tier_server"]

TIER_PROCESS_BYTES = 32 << 20
"""Resident memory a disk tier adds to a parameter server besides its arrays: the
kernels of frequency eviction and fingerprints (loaded at the first spill) and its I/O
threads; tests/test_plan_tier.py holds a real server to the plan with it
(docs/benchmarks.md#disk-tier)."""
_STEPS = 48
"""Bisection steps over the RAM share (2**-48: exact to the row at any scale here)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskBudget:
    """The disk of one parameter server for its tier, and how the job uses it."""

    disk_bytes: int
    """Bytes the tier's files may take on one server."""
    free_fraction: float = DEFAULT_FREE_FRACTION
    """``disk_tier.free_fraction``."""
    samples_per_second: float | None = None
    """Samples per second of one NN worker (None: no disk reads are planned)."""
    ram_hit_rate: float | None = None
    """Share of the ids asked found in RAM (None: the RAM share of the rows)."""

    def __post_init__(self) -> None:
        if self.disk_bytes <= 0:
            raise ValueError(f"disk bytes must be > 0, got {self.disk_bytes}")
        if not 0 <= self.free_fraction <= 0.9:
            raise ValueError(f"free_fraction must lie in [0, 0.9], got {self.free_fraction}")
        if self.ram_hit_rate is not None and not 0 <= self.ram_hit_rate <= 1:
            raise ValueError(f"ram hit rate must lie in [0, 1], got {self.ram_hit_rate}")
        if self.samples_per_second is not None and not self.samples_per_second > 0:
            raise ValueError(f"samples per second must be > 0, got {self.samples_per_second}")


def tier_server(tables: list[TableDemand], num_servers: int, workload: Workload,
                ram_rows: dict[str, int], disk_capacity_rows: int, *,
                free_fraction: float = DEFAULT_FREE_FRACTION) -> dict[str, int]:
    """One server holding ``rows_per_replica`` of each table, ``ram_rows[name]`` of them
    in RAM (its ``capacity``), the rest in a tier of ``disk_capacity_rows``
    (``disk_tier.capacity_rows``, every table's file sized by it): the parts of
    :func:`server_memory` plus ``disk_tier_ram``, ``total``, ``disk_rows`` and
    ``disk_bytes``."""
    in_ram = [dataclasses.replace(t, capacity=max(1, ram_rows[t.name])) for t in tables]
    memory = server_memory(in_ram, num_servers, workload)
    tier_ram = disk = disk_rows = 0
    for table in tables:
        rows = rows_per_replica(dataclasses.replace(table, capacity=None), num_servers)
        on_disk = max(0, rows - ram_rows[table.name])
        if disk_capacity_rows:
            got = sizing.tier_bytes(disk_capacity_rows, on_disk, table.dim, table.state_width,
                                    num_shards=workload.num_internal_shards,
                                    weight_bytes=table.weight_bytes,
                                    free_fraction=free_fraction,
                                    ram_rows=ram_rows[table.name])
            tier_ram, disk = tier_ram + got.ram, disk + got.disk
        disk_rows += on_disk
    memory["disk_tier_ram"] = tier_ram + TIER_PROCESS_BYTES
    memory["total"] += tier_ram + TIER_PROCESS_BYTES
    memory["disk_rows"] = disk_rows
    memory["disk_bytes"] = disk
    return memory


def _split(tables: list[TableDemand], num_servers: int, workload: Workload,
           share: float) -> tuple[dict[str, int], int]:
    """RAM rows per table at RAM share ``share`` and the disk capacity the rest needs."""
    ram, most = {}, 0
    for table in tables:
        rows = rows_per_replica(dataclasses.replace(table, capacity=None), num_servers)
        ram[table.name] = max(1, math.ceil(rows * share))
        most = max(most, rows - ram[table.name])
    return ram, most


def _fit(tables: list[TableDemand], num_servers: int, machine: Machine, workload: Workload,
         budget: DiskBudget) -> tuple[float, dict[str, int]] | None:
    """The largest RAM share whose server fits the RAM budget, and that server, if its
    disk then fits the disk budget (None: not with ``num_servers``)."""
    ram_budget = machine.memory_bytes * machine.usable

    def server(share: float) -> dict[str, int]:
        ram, capacity = _split(tables, num_servers, workload, share)
        return tier_server(tables, num_servers, workload, ram, capacity,
                           free_fraction=budget.free_fraction)

    low, high = 0.0, 1.0
    if server(high)["total"] <= ram_budget:
        low = high
    else:
        if server(low)["total"] > ram_budget:
            return None
        for _ in range(_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if server(mid)["total"] <= ram_budget else (low, mid)
    got = server(low)
    return (low, got) if got["disk_bytes"] <= budget.disk_bytes else None


def make_tier_plan(tables: list[TableDemand], *, machine: Machine, workload: Workload,
                   budget: DiskBudget) -> dict:
    """Servers, each one's RAM (by part) and disk, the config that gives them, and the
    random reads each one's disk must serve (JSON-ready)."""
    if _fit(tables, MAX_SERVERS, machine, workload, budget) is None:
        raise ValueError("no number of parameter servers fits the RAM and disk budgets")
    low, high = 1, MAX_SERVERS
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if _fit(tables, mid, machine, workload, budget) else (mid + 1,
                                                                                   high)
    by_cpu = math.ceil(workload.num_nn_workers * PS_CORES_PER_NN_WORKER / machine.cores)
    num_servers = max(low, by_cpu)
    fitted = _fit(tables, num_servers, machine, workload, budget)
    assert fitted is not None, "a server count past the fewest that fit does not fit"
    share, memory = fitted
    ram_rows, capacity_rows = _split(tables, num_servers, workload, share)
    hit = share if budget.ram_hit_rate is None else budget.ram_hit_rate
    reads = None
    if budget.samples_per_second is not None:
        ids = sum(t.ids_per_sample for t in tables)
        reads = (workload.num_nn_workers * budget.samples_per_second * ids * (1 - hit)
                 / num_servers)
    return {
        "parameter_servers": num_servers, "servers_by_memory_and_disk": low,
        "servers_by_cpu": by_cpu, "ram_row_share": share,
        "memory_per_server": memory,
        "disk_budget_per_server": budget.disk_bytes,
        "config": {"capacity": ram_rows, "disk_tier": {
            "capacity_rows": capacity_rows, "free_fraction": budget.free_fraction}},
        "assumed_ram_hit_rate": hit,
        "random_reads_per_s_per_server": reads,
    }
