"""The disk tier in a real parameter-server process (issue 42), filled from a checkpoint.

    python -m benchmarks.disk_tier_process [--smoke] [--rows 100000000] [--ram-fraction 0.1]
        [--draws 20000] [--warmup 6000] [--batches 300] [--heavy-warmup 2]
        [--heavy-batches 8] [--shards 4] [--dir DIR] [--json PATH]

(The defaults are the run in docs/benchmarks.md, "Disk tier": about 25 minutes and 35 GB
of disk on a loaded 2-core VM, 13 of the minutes the warm-up.)

:mod:`benchmarks.disk_tier` drives an ``EmbeddingTable`` in its own process; this one
measures the same figures on a parameter server started as ``persia-launcher`` starts one
(:mod:`benchmarks.ps_process`: its own process and malloc settings), through a real
client (``PSClient``, gRPC), reading the tier's counters from the server's Stats RPC.

1. **Device.** :func:`benchmarks.disk_tier.device_read_iops`, first, in the same run.
2. **Fill.** Filling 100M rows by training lookups runs at 11-17k rows/s on a loaded
   2-core VM (hours); a real job restarted from a checkpoint gets its rows by loading it,
   so the rows are written as a checkpoint (:mod:`persia_py.checkpoint.layout`: ``ids``
   of Zipf ranks ``0..rows-1``, float16 weights in the init range (one block of random
   rows repeated: contents do not matter to the tier), the row-wise Adagrad state's
   initial value, last-access stamps drawn at random so that the rows the load keeps
   in RAM are a random tenth, not the hot ones), then a server with ``capacity`` =
   RAM's share and a disk tier of ``rows`` loads it through its Load RPC (its most
   recently used rows in RAM, the rest appended to the tier). ``fill_rows_per_s``:
   rows over write + load; the checkpoint is deleted once loaded.
3. **One slot's stream.** ``--warmup`` unmeasured steps (their hit rate per 500:
   ``hit_rate_warmup_parts``, RAM starting from a random tenth) then ``--batches``
   measured ones, of ``--draws`` Zipf(1.05) ids deduplicated as a server sees them: a
   training lookup and an update each. ``hit_rate``: the share of the looked-up rows answered from RAM (the
   server's ``hits - disk_answered`` over ``hits + misses``); ``hit_rate_ceiling``: a
   static cache of RAM's size holding the most frequent rows, on the same ids (exact);
   RAM per disk row (the tier's index, from Stats), disk space and read amplification.
4. **The embedding-heavy workload.** Batches of the embedding-heavy job's ids
   (:mod:`benchmarks.throughput.workloads`: 1,024 samples x 26 slots x 20 ids = 532,480
   draws, here from the same Zipf(1.05) over all rows, one table), back to back with no
   NN time: more misses than the device can serve; first without, then with the next
   batch's ids hinted after each lookup (``Prefetch``, as an embedding worker sends a
   batch's when it is put). ``disk_utilization``: the tier's random reads per second
   with hints over ``device_read_iops`` (``disk_utilization_no_prefetch``: without;
   ``disk_utilization_vs_device_before_heavy``: over the device measured again just
   before these batches, the disk being shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from benchmarks.density import cpu_seconds, resident_bytes
from benchmarks.disk_tier import DIM, HEAVY_DRAWS, ZipfIds, device_read_iops
from benchmarks.ps_process import parameter_server_process
from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.coordinator import PSCheckpointClient
from persia_py.config import CommonConfig
from persia_py.launcher.plan import OPTIMIZERS
from persia_py.ops import safe_files
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.servers.checkpoint import replica_file
from persia_py.servers.optimizers import initial_state, optimizer_from_dict, state_width
from persia_py.servers.row_stream import RowSink
from persia_py.servers.table_files import write_table
from persia_py.servers.table_settings import checked_settings
from persia_py.workers.ps_client import PSClient

SLOT = "tier"
OPTIMIZER = OPTIMIZERS["rowwise-adagrad"]
FILL_CHUNK = 1 << 20
"""Rows per slice handed to the checkpoint's writers."""
WARMUP_PART = 500
"""Warm-up steps per reported hit rate."""
ROW_BYTES = DIM * 2 + 4
"""A row's weights (float16) and row-wise Adagrad state."""


class GeneratedRows:
    """``rows`` rows, Zipf ranks ``0..rows-1`` as ids, for ``write_table`` (a
    :class:`persia_py.servers.table_files.RowSource`)."""

    def __init__(self, rows: int, seed: int) -> None:
        self.rows, self.dim, self.row_dtype = rows, DIM, "float16"
        optimizer = optimizer_from_dict(OPTIMIZER)
        self.state_width = state_width(optimizer, DIM)
        self.rng = np.random.default_rng(seed)
        n = min(rows, FILL_CHUNK)
        self.weights = self.rng.uniform(-0.01, 0.01, (n, DIM)).astype(np.float16)
        self.state = initial_state(optimizer, n, DIM)

    def stream_rows(self, sink: RowSink) -> tuple[int, int]:
        for first in range(0, self.rows, FILL_CHUNK):
            n = min(FILL_CHUNK, self.rows - first)
            sink(ZipfIds.ids(np.arange(first, first + n)), self.weights[:n], self.state[:n],
                 self.rng.integers(0, self.rows, n))
        return self.rows, self.rows


def write_checkpoint(root: Path, rows: int) -> tuple[Path, int]:
    """A complete one-replica checkpoint of :class:`GeneratedRows` in ``root``; returns
    (its folder, the table files' bytes)."""
    settings = dataclasses.asdict(checked_settings(optimizer=OPTIMIZER, init_lower=-0.01,
                                                   init_upper=0.01, weight_bound=None, seed=0))
    tmp = fmt.new_tmp_dir(root)
    with safe_files.opened_dir(None, tmp) as fd:
        description, num_bytes = write_table(fd, "ps-0-t0", GeneratedRows(rows, seed=3))
        safe_files.save_json_at(fd, replica_file(0), {
            "replica_index": 0, "replica_size": 1, "settings": settings,
            "tables": {SLOT: description}, "seen": [], "increment_seq": 0})
    return fmt.commit(tmp, {"num_ps_replicas": 1}, step=0), num_bytes


def table_stats(client: PSClient) -> dict[str, int]:
    """The slot's counters from the server's Stats RPC, the disk tier's included."""
    got = {t.table: t for t in client.stats().tables}[SLOT]
    if not got.HasField("disk"):
        raise RuntimeError(f"the server's table {SLOT!r} has no disk tier")
    plain = {f.name: getattr(got, f.name) for f in pb.TableStats.DESCRIPTOR.fields
             if f.name not in ("table", "disk")}
    return dict(plain, **{f.name: getattr(got.disk, f.name)
                          for f in pb.DiskTierStats.DESCRIPTOR.fields})


def stream(client: PSClient, sampler: ZipfIds, batches: int, draws: int, ram_rows: int,
           sequence: itertools.count, hint: bool = False, pid: int | None = None) -> dict:
    """``batches`` steps of ``draws`` ids (deduplicated): a training lookup and an update
    each, back to back; the server's counters before and after, hit rate and ceiling.
    ``hint``: after each lookup the next batch's ids are sent as a Prefetch, as an
    embedding worker sends a batch's when it is put (its rows on disk are read on the
    server's background thread meanwhile). The batches are drawn before the clock starts,
    as an embedding worker has them at hand (drawing one from the Zipf CDF of 100M rows
    takes the client about as long as the server's lookup). ``pid``: the server's, whose
    CPU seconds over the steps are reported."""
    grads = np.full((draws, DIM), 1e-3, np.float32)
    drawn = [np.unique(sampler.ranks(draws)) for _ in range(batches + 1)]
    before = table_stats(client)
    distinct = in_ceiling = 0
    cpu0 = 0.0 if pid is None else cpu_seconds(pid)
    t0 = time.perf_counter()
    for ranks, upcoming in zip(drawn, drawn[1:]):
        ids = ZipfIds.ids(ranks)
        client.lookup([(SLOT, ids)], training=True, as_float32=False)
        if hint:
            client.prefetch([(SLOT, ZipfIds.ids(upcoming))])
        client.update([(SLOT, ids, grads[:ids.shape[0]])], worker_id="bench",
                      sequence=next(sequence))
        distinct += ids.shape[0]
        in_ceiling += int(np.count_nonzero(ranks < ram_rows))
    seconds = time.perf_counter() - t0
    server_cpu = None if pid is None else cpu_seconds(pid) - cpu0
    after = table_stats(client)
    delta = {k: after[k] - before[k] for k in after}
    asked = delta["hits"] + delta["misses"]
    if asked != distinct:
        raise RuntimeError(f"the server counted {asked} looked-up ids, the client sent {distinct}")
    return {"seconds": seconds, "steps_per_s": batches / max(seconds, 1e-9),
            "hit_rate": (delta["hits"] - delta["disk_answered"]) / max(asked, 1),
            "hit_rate_ceiling": in_ceiling / max(distinct, 1),
            "distinct_ids_per_batch": distinct / max(batches, 1),
            "misses_per_batch": delta["disk_answered"] / max(batches, 1),
            "disk_reads_per_s": delta["disk_block_reads"] / max(seconds, 1e-9),
            "server_cpu_per_step": None if server_cpu is None else server_cpu / max(batches, 1),
            "disk_reads_per_server_cpu_s": None if not server_cpu
                                           else delta["disk_block_reads"] / server_cpu,
            "delta": delta, "after": after}


def fill(workdir: Path, address: str, rows: int) -> dict:
    """Write the checkpoint and load it into the server at ``address``; rates."""
    root = workdir / "checkpoints"
    t0 = time.perf_counter()
    folder, num_bytes = write_checkpoint(root, rows)
    written = time.perf_counter() - t0
    loader = PSCheckpointClient([address], CommonConfig(rpc_timeout_sec=4 * 3600.0), root)
    try:
        loader.wait_ready()
        t1 = time.perf_counter()
        (answer,) = loader.load(folder)
        loaded = time.perf_counter() - t1
    finally:
        loader.close()
        shutil.rmtree(root)
    if answer.num_rows != rows:
        raise RuntimeError(f"the server loaded {answer.num_rows} rows of {rows}")
    seconds = written + loaded
    print(f"fill: {rows:,} rows ({num_bytes / 1e9:.2f} GB of checkpoint) written in "
          f"{written:.1f}s, loaded in {loaded:.1f}s: {rows / seconds:,.0f} rows/s", flush=True)
    return {"fill_seconds": seconds, "fill_rows_per_s": rows / seconds,
            "fill_write_seconds": written, "fill_load_seconds": loaded,
            "fill_checkpoint_bytes": num_bytes}


def _device(args: argparse.Namespace) -> float:
    return device_read_iops(args.dir, 16 if args.smoke else 1024,
                            2_000 if args.smoke else 60_000)


def run(args: argparse.Namespace) -> dict:
    rows, ram_rows = args.rows, max(1, int(args.rows * args.ram_fraction))
    device = _device(args)
    print(f"device: {device:,.0f} random 4 KiB O_DIRECT reads/s at queue depth 32", flush=True)
    figures: dict = {"date": time.strftime("%Y-%m-%d"), "rows": rows,
                     "ram_row_fraction": ram_rows / rows, "device_read_iops": device,
                     "batch_draws": args.draws, "internal_shards": args.shards,
                     "heavy_batch_draws": min(args.heavy_draws, ram_rows)}
    workdir = Path(tempfile.mkdtemp(prefix="persia-tier-ps-", dir=args.dir))
    try:
        with parameter_server_process(workdir, SLOT, DIM, capacity=ram_rows,
                                      row_dtype="float16", disk_tier_rows=rows,
                                      args=("--checkpoint-root", str(workdir / "checkpoints")),
                                      internal_shards=args.shards) as (address, pid):
            (workdir / "checkpoints").mkdir(exist_ok=True)
            figures.update(fill(workdir, address, rows))
            client = PSClient(address, CommonConfig(rpc_timeout_sec=3600.0, embedding_fp16=True))
            try:
                figures.update(_measure(client, args, ram_rows, device, pid))
                figures["process_rss_bytes"] = resident_bytes(pid)
            finally:
                client.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for key, value in figures.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return figures


def _measure(client: PSClient, args: argparse.Namespace, ram_rows: int, device: float,
             pid: int) -> dict:
    sampler = ZipfIds(args.rows, 1.05, seed=2)
    sequence = itertools.count(1)
    warm = []  # the warm-up in parts, to show the hit rate converging
    for first in range(0, args.warmup, WARMUP_PART):
        part = stream(client, sampler, min(WARMUP_PART, args.warmup - first), args.draws,
                      ram_rows, sequence)
        warm.append(part["hit_rate"])
        last = min(first + WARMUP_PART, args.warmup)
        print(f"warm-up steps {first}-{last}: {part['steps_per_s']:.2f} steps/s, hit rate "
              f"{part['hit_rate']:.3f} of {part['hit_rate_ceiling']:.3f}", flush=True)
    slot = stream(client, sampler, args.batches, args.draws, ram_rows, sequence)
    after, delta = slot["after"], slot["delta"]
    print(f"one slot: {slot['steps_per_s']:.2f} steps/s, hit rate {slot['hit_rate']:.3f} "
          f"of {slot['hit_rate_ceiling']:.3f}", flush=True)
    draws = min(args.heavy_draws, ram_rows)  # a batch's rows must fit in RAM
    # The disk may be shared (other jobs' reads move its rate within minutes): measured
    # again just before the heavy batches, beside the run's first figure.
    adjacent = _device(args)
    heavy = {}
    for hint in (False, True):
        stream(client, sampler, args.heavy_warmup, draws, ram_rows, sequence, hint)
        heavy[hint] = got = stream(client, sampler, args.heavy_batches, draws, ram_rows,
                                   sequence, hint, pid)
        print(f"embedding-heavy, {'' if hint else 'no '}prefetch: {got['steps_per_s']:.3f} "
              f"steps/s, {got['disk_reads_per_s']:,.0f} disk reads/s", flush=True)
    disk_rows = max(after["disk_rows"], 1)
    return {
        "hit_rate": slot["hit_rate"], "hit_rate_ceiling": slot["hit_rate_ceiling"],
        "hit_rate_vs_ceiling": slot["hit_rate"] / max(slot["hit_rate_ceiling"], 1e-9),
        "hit_rate_warmup_parts": warm, "warmup_part_batches": WARMUP_PART,
        "distinct_ids_per_batch": slot["distinct_ids_per_batch"],
        "steps_per_s": slot["steps_per_s"], "warmup_batches": args.warmup,
        "batches": args.batches,
        "ram_rows": after["entries"], "disk_rows": after["disk_rows"],
        "ram_bytes_per_disk_row": after["disk_ram_bytes"] / disk_rows,
        "fingerprint_clashes": after["disk_fingerprint_clashes"],
        "disk_space_amplification": after["disk_bytes"] / (disk_rows * ROW_BYTES),
        "disk_space_amplification_full": after["disk_bytes"]
                                         / (after["disk_capacity_rows"] * ROW_BYTES),
        "read_amplification": delta["disk_block_reads"] * after["disk_block_bytes"]
                              / (max(delta["disk_read_random"], 1) * ROW_BYTES),
        "tier_disk_reads_per_s": slot["disk_reads_per_s"],
        "heavy_distinct_ids_per_batch": heavy[False]["distinct_ids_per_batch"],
        "heavy_misses_per_batch": heavy[False]["misses_per_batch"],
        "heavy_hit_rate": heavy[False]["hit_rate"],
        "heavy_hit_rate_ceiling": heavy[False]["hit_rate_ceiling"],
        "heavy_steps_per_s_no_prefetch": heavy[False]["steps_per_s"],
        "heavy_disk_reads_per_s_no_prefetch": heavy[False]["disk_reads_per_s"],
        "disk_utilization_no_prefetch": heavy[False]["disk_reads_per_s"] / device,
        # As a job runs with a tier: the embedding worker hints each batch when it is put.
        "heavy_steps_per_s": heavy[True]["steps_per_s"],
        "heavy_disk_reads_per_s": heavy[True]["disk_reads_per_s"],
        "disk_utilization": heavy[True]["disk_reads_per_s"] / device,
        # The server's own pace: reads per second of its CPU (the bound where it has a core).
        "heavy_server_cpu_per_step": heavy[True]["server_cpu_per_step"],
        "heavy_server_cpu_per_step_no_prefetch": heavy[False]["server_cpu_per_step"],
        "heavy_disk_reads_per_server_cpu_s": heavy[True]["disk_reads_per_server_cpu_s"],
        "device_read_iops_before_heavy": adjacent,
        "disk_utilization_vs_device_before_heavy": heavy[True]["disk_reads_per_s"] / adjacent,
        "table_bytes_ram": after["bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk_tier_process",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=".", help="folder for the files (default: .)")
    parser.add_argument("--rows", type=int, default=100_000_000)
    parser.add_argument("--ram-fraction", type=float, default=0.1)
    parser.add_argument("--draws", type=int, default=20_000, help="ids drawn per step")
    parser.add_argument("--warmup", type=int, default=6000)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--heavy-draws", type=int, default=HEAVY_DRAWS)
    parser.add_argument("--heavy-warmup", type=int, default=2)
    parser.add_argument("--heavy-batches", type=int, default=8)
    parser.add_argument("--shards", type=int, default=4,
                        help="the server's num_hashmap_internal_shards (default 4)")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parse_args_with_smoke(parser, argv, rows=50_000, draws=2_000, warmup=50,
                                 batches=20, heavy_draws=6_000, heavy_batches=5)
    figures = run(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
