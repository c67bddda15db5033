"""Resident bytes per parameter of a real parameter server, process included, beside the plan.

    python -m benchmarks.density [--parts memory,accuracy] [--rows 10000000]
                                 [--dims 16,64] [--optimizers adagrad,rowwise-adagrad,sgd]
                                 [--row-dtypes float32,float16] [--json PATH] [--smoke]

For each configuration, one after another (a table of 10M rows at dim 64 with Adagrad
takes over 5 GB): a parameter server is started as ``persia-launcher`` starts one (its own
process, the launcher's malloc settings), configured with the optimizer, filled with
``--rows`` distinct ids by training lookups, and its resident memory (``VmRSS``) read.
Bytes per parameter are that over ``rows x dim``; beside each, what ``persia-launcher
plan`` predicts for the same table and traffic, and the idle server's memory (the plan's
``PROCESS_BYTES``). JSON keys: ``bytes_per_param_dim<D>_<fp32|fp16|bf16>_<optimizer>``
(``adagrad``, ``rowwise``, ``sgd``), ``planned_...``, ``table_...`` (the resident bytes
less the idle server's) and ``idle_rss_bytes``.

``--parts accuracy`` runs what half-precision rows cost in test AUC instead (or beside,
``memory,accuracy``): :mod:`benchmarks.density_accuracy`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from benchmarks.density_accuracy import accuracy
from benchmarks.ps_process import parameter_server_process
from persia_py.config import CommonConfig
from persia_py.ids.routing import mix64
from persia_py.launcher.plan import (
    OPTIMIZERS,
    TableDemand,
    Workload,
    server_memory,
)
from persia_py.servers.optimizers import optimizer_from_dict, state_width
from persia_py.workers.ps_client import PSClient, configure_request

SLOT = "density"
FILL_CHUNK = 100_000
"""New ids per training lookup while filling."""
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
          "adagrad": "adagrad", "rowwise-adagrad": "rowwise", "sgd": "sgd", "adam": "adam"}


def resident_bytes(pid: int) -> int:
    """``VmRSS`` of process ``pid`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tier_file_bytes(pid: int, folder: Path) -> int:
    """Bytes the disk holds for process ``pid``'s open files in ``folder`` (its tier's,
    unnamed: found through ``/proc/PID/fd``)."""
    total, inside = 0, str(folder.resolve()) + "/"
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(inside):
                total += os.stat(fd).st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return total


def _ids(first: int, end: int) -> np.ndarray:
    """Ids ``first..end-1`` of the fill, spread like real ids (the hashes see random bits)."""
    return mix64(np.arange(first, end, dtype=np.uint64), np.uint64(0x5EED))


def fill_server(workdir: Path, *, dim: int, optimizer: str, rows: int,
                row_dtype: str = "float32", chunk: int = FILL_CHUNK,
                ram_rows: int | None = None, disk_rows: int = 0) -> dict[str, int]:
    """Start a parameter server, fill one table of ``row_dtype`` rows with ``rows`` rows,
    and return its resident memory idle (configured, a few rows stored) and full. With
    ``disk_rows``: ``ram_rows`` in RAM (its capacity) and a disk tier of ``disk_rows``,
    whose files' allocated bytes come back as ``disk_file_bytes``."""
    with parameter_server_process(workdir, SLOT, dim, capacity=ram_rows or 2 * rows,
                                  row_dtype=row_dtype,
                                  disk_tier_rows=disk_rows) as (address, pid):
        client = PSClient(address, CommonConfig())
        try:
            client.wait_ready()
            client.configure(configure_request(OPTIMIZERS[optimizer], init_lower=-0.01,
                                               init_upper=0.01, weight_bound=None, seed=0))
            # Every kernel of the fill loaded (numba's cache), a handful of rows stored.
            client.lookup([(SLOT, _ids(0, min(64, rows)))], training=True)
            idle = resident_bytes(pid)
            for first in range(0, rows, chunk):
                client.lookup([(SLOT, _ids(first, min(first + chunk, rows)))], training=True)
            stored = {t.table: t for t in client.stats().tables}[SLOT]
            return {"idle_rss_bytes": idle, "rss_bytes": resident_bytes(pid),
                    "rows": int(stored.entries), "table_bytes": int(stored.bytes),
                    "disk_file_bytes": _tier_file_bytes(pid, workdir / "tier")}
        finally:
            client.close()


def planned_bytes(*, dim: int, optimizer: str, rows: int, row_dtype: str = "float32",
                  chunk: int = FILL_CHUNK) -> int:
    """What the plan says one server holding this table, filled as :func:`fill_server`
    fills it (one caller, ``chunk`` ids a call), takes."""
    table = TableDemand(name=SLOT, dim=dim, distinct_ids=rows, capacity=2 * rows,
                        state_width=state_width(optimizer_from_dict(OPTIMIZERS[optimizer]),
                                                dim), row_dtype=row_dtype)
    workload = Workload(batch_size=chunk, staleness=1, num_nn_workers=1)
    return server_memory([table], 1, workload)["total"]


def measure_memory(rows: int, dims: list[int], optimizers: list[str],
                   row_dtypes: list[str]) -> dict[str, float]:
    """Every configuration in turn (one server at a time): bytes per parameter resident
    and planned."""
    results: dict[str, float] = {"rows": rows}
    for row_dtype in row_dtypes:
        for dim in dims:
            for optimizer in optimizers:
                with tempfile.TemporaryDirectory(prefix="density-") as tmp:
                    measured = fill_server(Path(tmp), dim=dim, optimizer=optimizer,
                                           rows=rows, row_dtype=row_dtype)
                plan = planned_bytes(dim=dim, optimizer=optimizer, rows=rows,
                                     row_dtype=row_dtype)
                key = f"dim{dim}_{_SHORT[row_dtype]}_{_SHORT[optimizer]}"
                params = rows * dim
                results[f"bytes_per_param_{key}"] = measured["rss_bytes"] / params
                results[f"planned_bytes_per_param_{key}"] = plan / params
                # Without the process's own memory: what a row costs where servers hold
                # billions of rows (the process is then a rounding error).
                results[f"table_bytes_per_param_{key}"] = (
                    measured["rss_bytes"] - measured["idle_rss_bytes"]) / params
                results["idle_rss_bytes"] = measured["idle_rss_bytes"]
                print(f"dim {dim:>3} {row_dtype:<8} {optimizer:<16} {rows:,} rows: "
                      f"{measured['rss_bytes'] / params:6.2f} B/param resident "
                      f"(plan {plan / params:6.2f}, {measured['rss_bytes'] / plan:5.3f}x); "
                      f"idle server {measured['idle_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="memory",
                        help="memory, accuracy or both (memory,accuracy)")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dims", default="16,64")
    parser.add_argument("--optimizers", default="adagrad,rowwise-adagrad,sgd")
    parser.add_argument("--row-dtypes", default="float32,float16",
                        help="row storage types, comma-separated (float32, float16, bfloat16)")
    parser.add_argument("--criteo-samples", type=int, default=50_000,
                        help="training samples of the accuracy part's Criteo runs")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parse_args_with_smoke(parser, argv, rows=2000, dims="8", optimizers="adagrad",
                                 row_dtypes="float16")
    parts = set(args.parts.split(","))
    if not parts or parts - {"memory", "accuracy"}:
        parser.error(f"--parts takes memory and/or accuracy, got {args.parts!r}")
    results: dict[str, float] = {}
    if "memory" in parts:
        results.update(measure_memory(args.rows, [int(d) for d in args.dims.split(",")],
                                      args.optimizers.split(","), args.row_dtypes.split(",")))
    if "accuracy" in parts:
        results.update(accuracy(args.criteo_samples))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
