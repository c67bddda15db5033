"""The disk tier under a parameter-server table (issue 42), beside baselines of the same run.

    python -m benchmarks.disk_tier [--smoke] [--rows 5000000] [--batches 100]
                                   [--warmup 200] [--free-fraction 0.125] [--json PATH]
    python -m benchmarks.disk_tier --compare-stores [--rows 1000000]

Default run, in this order, all in one process, files in ``--dir`` (default: the current
folder; the tier's files are unnamed and vanish with the process):

1. **Device.** Random 4 KiB ``O_DIRECT`` reads at queue depth 32 over a file written for
   it (``--device-mib``), through the tier's own reader (:mod:`persia_py.servers.page_file`):
   ``device_read_iops``; the tier is held to it.
2. **Table with a tier.** A real ``EmbeddingTable`` (dim 64, float16 rows, row-wise
   Adagrad) of ``--rows`` rows, ``--ram-fraction`` of them in RAM, the rest spilled to
   the tier: filled by inserting every id once, then ``--warmup`` training steps (lookup
   + update) that are not measured (the fill leaves the rows inserted last in RAM, the
   coldest: ``hit_rate_warmup`` is the hit rate over them), then ``--batches`` measured
   ones, of batches of Zipf(1.05) ids (20,000 ids drawn per batch, deduplicated as a
   parameter server sees them). ``hit_rate``: the share of a batch's distinct ids found
   in RAM; ``hit_rate_ceiling``: the share a static cache of the same size holding the
   most frequent ids finds on the same stream (computed from the sampler's ranks,
   exact): a steady-state figure, hence the warm-up. RAM bytes per disk row, disk space
   amplification (file bytes / the disk rows' weight and state bytes), read
   amplification (bytes read / rows' bytes brought back), the tier's disk reads per
   second in its lookups beside the device's.
3. **The fitting workload, prefetch off and on, and the baseline.** Measured steps wait
   ``--step-ms`` between lookup and update, the NN worker's time (default: twice the
   warm-up's misses per batch over the device's rate, so misses per second are at most
   half of it). The same steps again on a second tiered table whose server is hinted
   each next batch's ids after a lookup (:mod:`persia_py.servers.prefetch`, as an
   embedding worker does), and on a table with every row in RAM:
   ``throughput_ratio_vs_ram`` is the prefetching tier's steps/s over the latter,
   ``throughput_ratio_vs_ram_no_prefetch`` the first tier's.

``--compare-stores``: the measurement behind the store (docs/benchmarks.md, "Disk tier"):
batch writes and random batch reads of fixed 140-byte records (dim 64 float16 + one float32
Adagrad accumulator) through this tier's page file, LMDB (``lmdb``: ``putmulti`` /
``getmulti``) and RocksDB (``rocksdict``: ``WriteBatch`` / multi-get, direct reads),
those two only if installed. Bytes read from the device per row come from
``/proc/self/io``.

4. **UCI Adult** (:mod:`benchmarks.disk_tier_adult`): trained with most rows on the tier
   and with all in RAM, the same seeds: ``auc_delta_adult`` (tier minus RAM test AUC),
   ``auc_adult_ram``, ``auc_adult_tier``, ``adult_disk_row_fraction``.
5. **Checkpoint.** The tier's table (after its steps) dumped as a checkpoint writes it
   and loaded into a fresh table with a tier (:mod:`benchmarks.disk_tier_checkpoint`):
   ``checkpoint_dump_gb_per_s``, ``checkpoint_load_gb_per_s`` and
   ``checkpoint_gb_per_s`` (the slower) in GB/s of the rows' checkpoint bytes.
6. **The embedding-heavy workload**, on the tier's table after its steps: ``--heavy-batches``
   batches of the embedding-heavy job's ids (:data:`HEAVY_DRAWS`, at most
   RAM's rows), back to back: ``disk_utilization``, the tier's random reads per
   second over ``device_read_iops``.

The same figures on a real parameter-server process, filled from a checkpoint (the issue's
100M rows): :mod:`benchmarks.disk_tier_process`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.disk_tier_adult import adult_figures
from benchmarks.disk_tier_checkpoint import checkpoint_speed
from benchmarks.throughput.workloads import NUM_SLOTS, WORKLOADS
from persia_py.config import DiskTierConfig
from persia_py.servers.disk_tier import DEFAULT_FREE_FRACTION, DiskTier
from persia_py.servers.optimizers import AdagradConfig
from persia_py.servers.page_file import PageFile, aligned_empty
from persia_py.servers.prefetch import Prefetcher
from persia_py.servers.storage import EmbeddingTable

DIM = 64
_HEAVY = WORKLOADS["embedding_heavy"]
HEAVY_DRAWS = _HEAVY.batch_size * NUM_SLOTS * _HEAVY.ids_per_slot
"""Ids of one embedding-heavy batch, before deduplication (532,480)."""
_MIX = np.uint64(0x9E3779B97F4A7C15)  # rank -> id: odd multiplier, a bijection mod 2**64


def device_read_iops(directory: str, file_mib: int, reads: int, queue_depth: int = 32
                     ) -> float:
    """Random 4 KiB O_DIRECT reads per second at ``queue_depth`` over a new file."""
    blocks = file_mib * 256
    pf = PageFile(directory, block_bytes=4096, num_blocks=blocks, queue_depth=queue_depth)
    try:
        chunk = 2048  # 8 MiB of random bytes per write: unwritten extents read as zeros
        data = aligned_empty((chunk, 4096))
        data[:] = np.random.default_rng(0).integers(0, 256, data.shape, np.uint8)
        for first in range(0, blocks, chunk):
            n = min(chunk, blocks - first)
            pf.write_blocks(first, data[:n])
        rng = np.random.default_rng(1)
        pf.read_blocks(np.sort(rng.integers(0, blocks, 256)))  # warm the threads and JIT
        picks = np.sort(rng.integers(0, blocks, reads))
        t0 = time.perf_counter()
        for part in np.array_split(picks, max(1, reads // 8192)):
            pf.read_blocks(part)
        return reads / (time.perf_counter() - t0)
    finally:
        pf.close()


def _io_read_bytes() -> int:
    """Bytes this process has had read from storage (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


class ZipfIds:
    """Ids of ranks drawn from Zipf(``a``) over ``n`` ranks (rank 0 most frequent)."""

    def __init__(self, n: int, a: float, seed: int) -> None:
        weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.rng = np.random.default_rng(seed)

    def ranks(self, k: int) -> np.ndarray:
        return np.searchsorted(self.cdf, self.rng.random(k), side="right").astype(np.int64)

    @staticmethod
    def ids(ranks: np.ndarray) -> np.ndarray:
        return (ranks.astype(np.uint64) + np.uint64(1)) * _MIX


def _records(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(n).astype(np.uint64) * _MIX + np.uint64(1)
    weights = rng.standard_normal((n, DIM)).astype(np.float16)
    state = rng.random((n, 1), dtype=np.float32)
    return ids, weights, state


def compare_stores(directory: str, rows: int, batches: tuple[int, ...]) -> dict:
    """Batch write and random batch read rates of the page file, LMDB and RocksDB."""
    ids, weights, state = _records(rows, 0)
    record_bytes = 8 + DIM * 2 + 4
    results: dict[str, dict] = {}
    rng = np.random.default_rng(7)
    picks = {b: [np.unique(ids[rng.integers(0, rows, b)]) for _ in range(3)] for b in batches}

    def reads(name: str, read_batch) -> None:
        for b, sets in picks.items():
            before, t0 = _io_read_bytes(), time.perf_counter()
            n = 0
            for keys in sets:
                n += read_batch(keys)
            dt = time.perf_counter() - t0
            results[name][f"read_{b}_rows_per_s"] = n / dt
            results[name][f"read_{b}_device_bytes_per_row"] = (_io_read_bytes() - before) / n

    # Own page file: the tier itself.
    tier = DiskTier(directory, capacity_rows=rows, dim=DIM, weight_dtype=np.float16,
                    state_width=1)
    try:
        t0 = time.perf_counter()
        for part in range(0, rows, 100_000):
            tier.write(ids[part:part + 100_000], weights[part:part + 100_000],
                       state[part:part + 100_000])
        results["page_file"] = {"write_rows_per_s": rows / (time.perf_counter() - t0),
                                "disk_bytes_per_row": tier.disk_bytes / rows,
                                "ram_bytes_per_row": tier.ram_bytes / rows}

        def tier_read(keys: np.ndarray) -> int:
            found, w, _ = tier.peek(keys)
            return int(found.sum())

        reads("page_file", tier_read)
    finally:
        tier.close()

    values = np.concatenate([weights.view(np.uint8).reshape(rows, -1),
                             state.view(np.uint8).reshape(rows, -1)], axis=1)
    keys_be = ids.astype(">u8")
    try:
        import lmdb
    except ImportError:
        lmdb = None
    if lmdb is not None:
        folder = tempfile.mkdtemp(dir=directory, prefix="lmdb-")
        try:
            env = lmdb.open(folder, map_size=rows * 1024 + (256 << 20), readahead=False,
                            sync=False, metasync=False, lock=False)
            t0 = time.perf_counter()
            for part in range(0, rows, 100_000):
                # The binding takes Python bytes per key and value: the conversion is part
                # of what a batch write costs through it.
                items = list(zip((k.tobytes() for k in keys_be[part:part + 100_000]),
                                 (v.tobytes() for v in values[part:part + 100_000])))
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(items)
            env.sync(True)
            size = os.path.getsize(os.path.join(folder, "data.mdb"))
            results["lmdb"] = {"write_rows_per_s": rows / (time.perf_counter() - t0),
                               "disk_bytes_per_row": size / rows,
                               "ram_bytes_per_row": None}

            def drop_cache() -> None:
                fd = os.open(os.path.join(folder, "data.mdb"), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

            def lmdb_read(keys: np.ndarray) -> int:
                drop_cache()  # reads go through the page cache: empty it of this file
                wanted = [k.tobytes() for k in keys.astype(">u8")]
                with env.begin() as txn:
                    got = txn.cursor().getmulti(wanted)
                out = np.frombuffer(b"".join(v for _, v in got), np.uint8)
                return out.shape[0] // values.shape[1]

            reads("lmdb", lmdb_read)
            env.close()
        finally:
            shutil.rmtree(folder)
    try:
        import rocksdict
    except ImportError:
        rocksdict = None
    if rocksdict is not None:
        folder = tempfile.mkdtemp(dir=directory, prefix="rocksdb-")
        try:
            opts = rocksdict.Options(raw_mode=True)
            opts.set_use_direct_reads(True)
            opts.set_use_direct_io_for_flush_and_compaction(True)
            table = rocksdict.BlockBasedOptions()
            table.set_bloom_filter(10, False)
            table.set_block_cache(rocksdict.Cache(8 << 20))
            opts.set_block_based_table_factory(table)
            db = rocksdict.Rdict(folder, opts)
            t0 = time.perf_counter()
            for part in range(0, rows, 100_000):
                batch = rocksdict.WriteBatch(raw_mode=True)
                for k, v in zip(keys_be[part:part + 100_000], values[part:part + 100_000]):
                    batch.put(k.tobytes(), v.tobytes())  # no batch put: one call per row
                db.write(batch)
            db.flush()
            db.compact_range(None, None)
            write_s = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in Path(folder).glob("*.sst"))
            results["rocksdb"] = {"write_rows_per_s": rows / write_s,
                                  "disk_bytes_per_row": size / rows,
                                  "ram_bytes_per_row": None}

            def rocks_read(keys: np.ndarray) -> int:
                got = db.get([k.tobytes() for k in keys.astype(">u8")])
                return sum(v is not None for v in got)

            reads("rocksdb", rocks_read)
            db.close()
        finally:
            shutil.rmtree(folder)
    return {"rows": rows, "record_bytes": record_bytes, "stores": results}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=".", help="folder for the files (default: .)")
    parser.add_argument("--compare-stores", action="store_true",
                        help="compare the page file with LMDB and RocksDB, then stop")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: seconds")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows of the table (default 5,000,000; --smoke 50,000)")
    parser.add_argument("--ram-fraction", type=float, default=0.1,
                        help="share of the rows RAM holds (default 0.1)")
    parser.add_argument("--batches", type=int, default=None,
                        help="training steps measured (default 100; --smoke 20)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="training steps before the measured ones, not measured: the "
                             "RAM starts with the rows filled last (default 200; --smoke 100)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the NN worker's time per batch, between lookup and update "
                             "(default: the fitting workload's, whose misses per second are "
                             "half the device's random reads; 0: none)")
    parser.add_argument("--heavy-batches", type=int, default=None,
                        help="embedding-heavy batches measured after the tier's steps "
                             "(default 10; --smoke 3)")
    parser.add_argument("--tier-only", action="store_true",
                        help="only the tier's run (hit rate, sizes): no prefetch, no all-in-RAM "
                             "baseline (which needs every row's RAM)")
    parser.add_argument("--free-fraction", type=float, default=DEFAULT_FREE_FRACTION,
                        help="share of the tier's file kept free (default 1/8)")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"--dir {args.dir!r} is not a folder", file=sys.stderr)
        return 2
    figures: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if args.compare_stores:
        rows = args.rows or (20_000 if args.smoke else 1_000_000)
        batches = (2_000,) if args.smoke else (20_000, 100_000)
        figures["device_read_iops"] = device_read_iops(args.dir, 16 if args.smoke else 1024,
                                                       2_000 if args.smoke else 60_000)
        print(f"device: {figures['device_read_iops']:,.0f} random 4 KiB O_DIRECT reads/s "
              f"at queue depth 32")
        figures.update(compare_stores(args.dir, rows, batches))
        for name, got in figures["stores"].items():
            print(name, {k: (round(v, 1) if isinstance(v, float) else v)
                         for k, v in got.items()})
    else:
        figures.update(run_tier(args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _table(rows_in_ram: int, tier_dir: str | None, tier_rows: int,
           free_fraction: float = DEFAULT_FREE_FRACTION) -> EmbeddingTable:
    tier = None if tier_dir is None else DiskTierConfig(path=tier_dir, capacity_rows=tier_rows,
                                                        free_fraction=free_fraction)
    return EmbeddingTable(dim=DIM, optimizer=AdagradConfig(lr=0.01, vectorwise_shared=True),
                          capacity=rows_in_ram, row_dtype="float16", disk_tier=tier, seed=1)


def _steps(table: EmbeddingTable, sampler: ZipfIds, batches: int, batch: int,
           ram_rows: int, step_s: float = 0.0, prefetcher: Prefetcher | None = None) -> dict:
    """``batches`` lookup+update steps; hit rates against the static-cache ceiling.

    ``step_s``: the NN worker's time per batch, between its lookup and its update (the
    parameter server idles meanwhile). ``prefetcher``: the next batch's ids are hinted
    (:meth:`EmbeddingTable.prefetch` on the server's background thread) after each
    lookup, as an embedding worker does for the batches queued behind it."""
    grads_rng = np.random.default_rng(5)
    distinct = found_in_ram = in_ceiling = 0
    before = table.disk_stats()
    t0 = time.perf_counter()
    upcoming = np.unique(sampler.ranks(batch))
    for _ in range(batches):
        ranks, upcoming = upcoming, np.unique(sampler.ranks(batch))
        ids = ZipfIds.ids(ranks)
        restored = table.disk_stats().get("restored", 0)
        table.lookup(ids, True, dtype=np.float16)
        # Rows the lookup itself brought from disk (with prefetch: also any the background
        # thread moved during the lookup, so an upper bound).
        found_in_ram += ids.shape[0] - (table.disk_stats().get("restored", 0) - restored)
        if prefetcher is not None:
            hint = ZipfIds.ids(upcoming)
            prefetcher.submit(lambda hint=hint: table.prefetch(hint))
        if step_s:
            time.sleep(step_s)  # the NN worker's forward and backward of this batch
        table.update(ids, grads_rng.standard_normal((ids.shape[0], DIM)).astype(np.float16))
        distinct += ids.shape[0]
        in_ceiling += int(np.count_nonzero(ranks < ram_rows))
    seconds = time.perf_counter() - t0
    after = table.disk_stats()
    delta = {k: after[k] - before.get(k, 0) for k in after if k != "disk_block_bytes"}
    return {"seconds": seconds, "steps_per_s": batches / seconds,
            "hit_rate": found_in_ram / distinct, "hit_rate_ceiling": in_ceiling / distinct,
            "distinct_ids_per_batch": distinct / batches, "delta": delta, "after": after}


def _run_table(tier_dir: str | None, rows: int, ram_rows: int, free_fraction: float,
               warmup: int, batches: int, batch: int, device: float, step_s: float | None,
               prefetch: bool, checkpoint: bool = False, heavy_batches: int = 0) -> dict:
    """Fill a table (every row exists: most go to disk), run ``warmup`` steps at full
    speed, then ``batches`` measured ones. ``step_s`` None: the fitting workload's, set
    from the warm-up so that its misses per second are half the device's rate."""
    all_ids = ZipfIds.ids(np.arange(rows))
    table = _table(ram_rows if tier_dir else rows + 1, tier_dir, rows, free_fraction)
    prefetcher = Prefetcher() if prefetch else None
    try:
        t0 = time.perf_counter()
        chunk = max(1, min(100_000, ram_rows // 2))
        for start in range(0, rows, chunk):
            table.lookup(all_ids[start:start + chunk], True, dtype=np.float16)
        fill = time.perf_counter() - t0
        sampler = ZipfIds(rows, 1.05, seed=2)
        warm = _steps(table, sampler, warmup, batch, ram_rows) if warmup else None
        if step_s is None:
            misses = (1 - warm["hit_rate"]) * warm["distinct_ids_per_batch"] if warm else 0.0
            step_s = 2 * misses / device
        result = _steps(table, sampler, batches, batch, ram_rows, step_s, prefetcher)
        if heavy_batches:  # more misses than the device serves: its reads/s are the bound
            _steps(table, sampler, 1, min(HEAVY_DRAWS, ram_rows), ram_rows)
            result["heavy"] = _steps(table, sampler, heavy_batches,
                                     min(HEAVY_DRAWS, ram_rows), ram_rows)
        if checkpoint:  # the tier's table after its steps, most rows on disk
            result["checkpoint"] = checkpoint_speed(table, tier_dir,
                                                    _table(ram_rows, tier_dir, rows))
    finally:
        if prefetcher is not None:
            prefetcher.close()
        table.close()
    return dict(result, warmup_hit_rate=warm["hit_rate"] if warm else None,
                fill_seconds=fill, step_s=step_s)


def run_tier(args: argparse.Namespace) -> dict:
    rows = args.rows or (50_000 if args.smoke else 5_000_000)
    batches, batch = (20, 2_000) if args.smoke else (100, 20_000)
    batches = args.batches or batches
    heavy_batches = args.heavy_batches if args.heavy_batches is not None else (
        3 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (100 if args.smoke else 200)
    ram_rows = max(1, int(rows * args.ram_fraction))
    device = device_read_iops(args.dir, 16 if args.smoke else 1024,
                              2_000 if args.smoke else 60_000)
    print(f"device: {device:,.0f} random 4 KiB O_DIRECT reads/s at queue depth 32")
    figures: dict = {"rows": rows, "ram_row_fraction": ram_rows / rows,
                     "free_fraction": args.free_fraction, "batch": batch,
                     "batches": batches, "warmup_batches": warmup,
                     "device_read_iops": device}
    results: dict[str, dict] = {}
    step_s = None if args.step_ms is None else args.step_ms / 1000
    runs = (("tier", args.dir, False), ("prefetch", args.dir, True), ("ram", None, False))
    for name, tier_dir, prefetch in runs[:1] if args.tier_only else runs:
        results[name] = got = _run_table(tier_dir, rows, ram_rows, args.free_fraction, warmup,
                                         batches, batch, device, step_s, prefetch,
                                         checkpoint=name == "tier",
                                         heavy_batches=heavy_batches if name == "tier" else 0)
        step_s = got["step_s"]
        print(f"{name}: filled {rows:,} rows in {got['fill_seconds']:.1f}s; "
              f"{got['steps_per_s']:.2f} steps/s ({got['step_s'] * 1000:.0f} ms per step "
              f"for the NN worker)", flush=True)
    figures.update(results["tier"]["checkpoint"])
    figures.update(_tier_figures(results["tier"], device))
    figures.update(_speed_figures(results, device))
    figures.update(adult_figures(args.dir, args.smoke))
    for key, value in figures.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return figures


def _tier_figures(tier: dict, device: float) -> dict:
    """Hit rate, sizes and amplifications of the tier's run."""
    after, delta = tier["after"], tier["delta"]
    row_bytes = DIM * 2 + 4  # weights and state of a row
    reads_per_s = delta["disk_block_reads"] / tier["seconds"]
    return {
        "hit_rate": tier["hit_rate"], "hit_rate_ceiling": tier["hit_rate_ceiling"],
        "hit_rate_vs_ceiling": tier["hit_rate"] / tier["hit_rate_ceiling"],
        "hit_rate_warmup": tier["warmup_hit_rate"],
        "distinct_ids_per_batch": tier["distinct_ids_per_batch"],
        "ram_bytes_per_disk_row": after["disk_ram_bytes"] / max(after["disk_rows"], 1),
        "fingerprint_clashes": after["disk_fingerprint_clashes"],
        "disk_space_amplification": after["disk_bytes"] / (max(after["disk_rows"], 1) * row_bytes),
        # The same at a full disk (``capacity_rows`` live; the run fills it to 1 - RAM's share).
        "disk_space_amplification_full": after["disk_bytes"]
                                         / (after["disk_capacity_rows"] * row_bytes),
        "read_amplification": (delta["disk_block_reads"] * after["disk_block_bytes"])
                              / (max(delta["disk_read"], 1) * row_bytes),
        "tier_disk_reads_per_s": reads_per_s,
        "tier_reads_vs_device": reads_per_s / device,
        "step_ms": tier["step_s"] * 1000,
        "steps_per_s_tier": tier["steps_per_s"],
        "fill_seconds_tier": tier["fill_seconds"],
        "disk_evicted": after["disk_evicted"],
        "relocated_per_spilled": delta["disk_relocated"] / max(delta["spilled"], 1),
        **_heavy_figures(tier.get("heavy"), device),
    }


def _heavy_figures(heavy: dict | None, device: float) -> dict:
    """The embedding-heavy batches' reads per second against the device's."""
    if heavy is None:
        return {"disk_utilization": None}
    reads_per_s = heavy["delta"]["disk_block_reads"] / heavy["seconds"]
    return {"disk_utilization": reads_per_s / device, "heavy_disk_reads_per_s": reads_per_s,
            "heavy_steps_per_s": heavy["steps_per_s"],
            "heavy_distinct_ids_per_batch": heavy["distinct_ids_per_batch"],
            "heavy_hit_rate": heavy["hit_rate"]}


def _speed_figures(results: dict[str, dict], device: float) -> dict:
    """The fitting workload: prefetching tier and tier beside all in RAM (None where
    ``--tier-only`` left them out)."""
    if "ram" not in results:
        return {"throughput_ratio_vs_ram": None}
    tier, ram, prefetch = results["tier"], results["ram"], results["prefetch"]
    return {
        # Misses per second of the tier's stream at the all-in-RAM job's pace.
        "fitting_misses_per_s_vs_device": (1 - tier["hit_rate"]) * tier["distinct_ids_per_batch"]
                                          * ram["steps_per_s"] / device,
        "steps_per_s_ram": ram["steps_per_s"],
        "steps_per_s_tier_prefetch": prefetch["steps_per_s"],
        "throughput_ratio_vs_ram": prefetch["steps_per_s"] / ram["steps_per_s"],
        "throughput_ratio_vs_ram_no_prefetch": tier["steps_per_s"] / ram["steps_per_s"],
        "lookup_hit_rate_prefetch": prefetch["hit_rate"],
        "fill_seconds_ram": ram["fill_seconds"],
    }


if __name__ == "__main__":
    sys.exit(main())
