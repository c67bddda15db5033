"""Parameter-server storage benchmark: every figure beside a baseline measured in the same run.

    python -m benchmarks.ps_ops [--rows N] [--dim 32] [--batch 100000] [--repeats R]
                                [--memory-rows 10000000] [--json PATH] [--quick|--smoke]

Each throughput is ``batch / median seconds`` over ``--repeats`` batches, each batch
different (so no batch finds its rows already in cache from the previous repeat), and
each call is paired with a call of its baseline right before or right after it (in
turn), on a batch of its own:
ours and the baseline see the same machine, however busy it is, so the ratio of the two
medians holds up on a noisy machine where either figure alone would not.

1. ``lookup``: existing ids, ``EmbeddingTable`` with Adagrad, 1 and 4 internal shards;
2. ``insert``: new ids, ``lookup(insert=True)``;
3. ``update``: one Adagrad step on existing ids;
4. ``memory``: resident bytes per stored row over the row's payload, (dim + state) * 4;
5. ``grpc``: lookup of existing ids through one parameter-server process on loopback;
6. ``fp16``: lookup (rows as stored: what a float16 wire sends) and Adagrad update
   (stochastic rounding) of a table of float16 rows, 1 internal shard; then the update
   with each other optimizer (SGD, row-wise Adagrad, Adam), a float16 and a float32
   table of its own each, since what float16 rows save depends on the optimizer's
   float32 state beside them.

The baseline of 1-3 is ``numpy.take`` of as many random rows from a plain float32 array
of the table's shape: the floor of any gather, without hashing, locking or bookkeeping.
The gRPC baseline is the in-process lookup. The baseline of 6 is the same operation on the
float32 table of 1-3, paired call by call. Ratios are ours / baseline; the ``*_ratio``
keys use one internal shard, the parameter server's default
(``num_hashmap_internal_shards: 1``). Targets are printed, never asserted: the figures
depend on the machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import SMOKE_HELP
from benchmarks.ps_process import parameter_server_process
from persia_py.config import CommonConfig
from persia_py.ids.routing import mix64
from persia_py.ops import allocator
from persia_py.servers.optimizers import (
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    optimizer_to_dict,
    state_width,
)
from persia_py.servers.storage import EmbeddingTable
from persia_py.workers.ps_client import PSClient, configure_request

SLOT = "bench"
OPTIMIZER = AdagradConfig()
FILL_CHUNK = 1_000_000
"""New ids per insert call when filling a table (the memory figure's batch size too)."""
PS_START_TIMEOUT_S = 120.0
HALF_OPTIMIZERS: dict[str, OptimizerConfig] = {
    "sgd": SGDConfig(lr=1e-2), "rowwise_adagrad": AdagradConfig(vectorwise_shared=True),
    "adam": AdamConfig()}
"""The optimizers of 6's other update figures (``fp16_update_ratio_<name>``)."""

TARGETS = {
    "lookup_ratio": (">=", 0.5),
    "update_ratio": (">=", 0.25),
    "memory_ratio": ("<=", 1.3),
    "grpc_ratio": (">=", 0.3),
    "fp16_lookup_ratio": (">=", 1.0),
    "fp16_update_ratio": (">=", 1.0),
}
"""The issue's targets, printed beside the ratios."""

QUICK = {"rows": 200_000, "batch": 20_000, "repeats": 5, "memory_rows": 1_000_000}
SMOKE = {"rows": 2000, "batch": 500, "repeats": 1, "memory_rows": 2000}
DEFAULT = {"rows": 4_000_000, "batch": 100_000, "repeats": 7, "memory_rows": 10_000_000}


# -- helpers ---------------------------------------------------------------------------


def _seconds(fn: Callable[[Any], object], x: Any) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def paired_medians(ours: Callable[[Any], object], inputs: Sequence[Any],
                   baseline: Callable[[Any], object], baseline_inputs: Sequence[Any]
                   ) -> tuple[float, float]:
    """Median wall times ``(ours, baseline)``, calling ``baseline(baseline_inputs[i])``
    and ``ours(inputs[i])`` one right after the other, the baseline first in even pairs
    and second in odd ones: a call finds the caches as the other left them, and which
    goes first changes both (a float16 update right after a float32 one is 1-2 ms slower
    than after its own kind); inputs are built beforehand."""
    ours_s, base_s = [], []
    for i, (x, y) in enumerate(zip(inputs, baseline_inputs, strict=True)):
        if i % 2 == 0:
            base_s.append(_seconds(baseline, y))
            ours_s.append(_seconds(ours, x))
        else:
            ours_s.append(_seconds(ours, x))
            base_s.append(_seconds(baseline, y))
    return statistics.median(ours_s), statistics.median(base_s)


class Take:
    """The baseline of 1-3: ``numpy.take`` of random rows of a plain float32 array."""

    def __init__(self, rng: np.random.Generator, num_rows: int, dim: int, batch: int) -> None:
        self.plain = np.full((num_rows, dim), 0.01, dtype=np.float32)  # every page resident
        self.rng, self.num_rows, self.batch = rng, num_rows, batch
        np.take(self.plain, self.batches(1)[0], axis=0)  # first touch of an output

    def batches(self, repeats: int) -> list[np.ndarray]:
        return [self.rng.choice(self.num_rows, self.batch, replace=False)
                for _ in range(repeats)]

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        return np.take(self.plain, rows, axis=0)

    def paired(self, ours: Callable[[Any], object], inputs: Sequence[Any]
               ) -> tuple[float, float]:
        """``(ours, take)`` ids/s, paired call by call (see :func:`paired_medians`)."""
        ours_s, take_s = paired_medians(ours, inputs, self, self.batches(len(inputs)))
        return self.batch / ours_s, self.batch / take_s


def ids_of(keys: np.ndarray) -> np.ndarray:
    """Id number ``k`` -> a uint64 id scattered like a hashed feature.

    ``mix64`` is a bijection, so distinct keys give distinct ids: "the first N ids" and
    "N new ids" are plain ranges of keys, with no uniqueness bookkeeping.
    """
    return mix64(np.asarray(keys, dtype=np.uint64))


def existing_batches(rng: np.random.Generator, num_rows: int, batch: int,
                     repeats: int) -> list[np.ndarray]:
    """``repeats`` batches of ``batch`` unique ids among the first ``num_rows``."""
    return [ids_of(rng.choice(num_rows, batch, replace=False)) for _ in range(repeats)]


def new_batches(first_key: int, batch: int, repeats: int) -> list[np.ndarray]:
    """``repeats`` disjoint batches of ids never stored, starting at key ``first_key``."""
    return [ids_of(np.arange(first_key + i * batch, first_key + (i + 1) * batch))
            for i in range(repeats)]


def fill(table: EmbeddingTable, num_rows: int, chunk: int = FILL_CHUNK) -> None:
    """Insert the ids of keys ``0..num_rows-1``, ``chunk`` at a time."""
    for start in range(0, num_rows, chunk):
        table.lookup(ids_of(np.arange(start, min(start + chunk, num_rows))), insert=True)


def check_all_found(rows: np.ndarray, batch: int, what: str) -> None:
    """Missing ids read as zero rows; a zero row means the benchmark measured the wrong path."""
    found = int(np.count_nonzero(rows.any(axis=1)))
    if rows.shape[0] != batch or found != batch:
        raise RuntimeError(f"{what}: {found} of {batch} ids found; the table was not filled")


def warm_up(dim: int) -> None:
    """Call every storage kernel once: numba compiles (or loads its cache) on first use."""
    for num_shards, row_dtype in ((1, "float32"), (4, "float32"), (1, "float16")):
        with EmbeddingTable(dim=dim, optimizer=OPTIMIZER, num_shards=num_shards,
                            capacity=100_000, row_dtype=row_dtype) as table:
            # Above the table's parallel threshold, so the threaded shard path runs too.
            ids = ids_of(np.arange(20_000))
            table.lookup(ids, insert=True)
            table.lookup(ids, insert=False)
            if row_dtype == "float16":
                table.lookup(ids, insert=False, dtype=np.float16)
            table.update(ids, np.full((ids.shape[0], dim), 0.01, dtype=np.float32))


def resident_bytes() -> int:
    """This process's resident set size now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ratio_line(name: str, ours: float, baseline: float, baseline_name: str,
               key: str | None, unit: str = "M ids/s", scale: float = 1e-6) -> str:
    ratio = ours / baseline
    line = (f"{name:<22} {ours * scale:9.2f} {unit}   {baseline_name} {baseline * scale:9.2f} "
            f"{unit}   ratio {ratio:5.2f}")
    if key in TARGETS:
        op, bound = TARGETS[key]
        met = ratio >= bound if op == ">=" else ratio <= bound
        line += f"   target {op} {bound} ({'met' if met else 'NOT met'})"
    return line


# -- 1-3: in-process table -------------------------------------------------------------


def bench_lookup(table: EmbeddingTable, take: Take, rng: np.random.Generator, num_rows: int,
                 batch: int, repeats: int) -> tuple[float, float]:
    batches = existing_batches(rng, num_rows, batch, repeats)
    check_all_found(table.lookup(batches[0], insert=False), batch, "lookup")
    return take.paired(lambda ids: table.lookup(ids, insert=False), batches)


def bench_insert(table: EmbeddingTable, take: Take, num_rows: int, batch: int,
                 repeats: int) -> tuple[float, float]:
    # Into the filled table, as in training; a batch that makes the arrays double pays
    # for copying them, which the median leaves out but a mean would not.
    batches = new_batches(num_rows, batch, repeats)
    return take.paired(lambda ids: table.lookup(ids, insert=True), batches)


def bench_update(table: EmbeddingTable, take: Take, rng: np.random.Generator, num_rows: int,
                 batch: int, repeats: int) -> tuple[float, float]:
    batches = existing_batches(rng, num_rows, batch, repeats)
    grads = rng.standard_normal((batch, table.dim), dtype=np.float32) * np.float32(0.01)
    if table.update(batches[0], grads) != batch:
        raise RuntimeError("update: not every id was found; the table was not filled")
    return take.paired(lambda ids: table.update(ids, grads), batches)


def filled_table(num_shards: int, num_rows: int, dim: int, batch: int, repeats: int,
                 row_dtype: str = "float32", optimizer: OptimizerConfig = OPTIMIZER
                 ) -> tuple[EmbeddingTable, float]:
    """A table holding ``num_rows`` rows, with room for the inserts of :func:`bench_insert`
    (nothing evicted), and its fill rate in ids/s."""
    capacity = num_rows + (repeats + 1) * batch
    table = EmbeddingTable(dim=dim, optimizer=optimizer, num_shards=num_shards,
                           capacity=capacity, row_dtype=row_dtype)
    start = time.perf_counter()
    fill(table, num_rows)
    return table, num_rows / (time.perf_counter() - start)


def bench_table(table: EmbeddingTable, take: Take, rng: np.random.Generator, num_rows: int,
                batch: int, repeats: int) -> dict[str, float]:
    """Lookup, insert and update on a filled table, each paired with ``take``."""
    out: dict[str, float] = {}
    for op, (ours, base) in (
            ("lookup", bench_lookup(table, take, rng, num_rows, batch, repeats)),
            ("insert", bench_insert(table, take, num_rows, batch, repeats)),
            ("update", bench_update(table, take, rng, num_rows, batch, repeats))):
        out[f"{op}_ids_per_s"], out[f"{op}_take_ids_per_s"] = ours, base
    if table.stats()["evicted"]:
        raise RuntimeError("rows were evicted; capacity is too small for the benchmark")
    return out


# -- 6: float16 rows ---------------------------------------------------------------------


def bench_half(full: EmbeddingTable, rng: np.random.Generator, num_rows: int, dim: int,
               batch: int, repeats: int) -> dict[str, float]:
    """ids/s of lookup and update on a table of float16 rows, each call paired with the
    same operation on ``full`` (float32 rows, filled the same way) on a batch of its own."""
    half, _ = filled_table(1, num_rows, dim, batch, repeats, row_dtype="float16")
    out: dict[str, float] = {}
    grads = rng.standard_normal((batch, dim), dtype=np.float32) * np.float32(0.01)
    with half:
        check_all_found(half.lookup(existing_batches(rng, num_rows, batch, 1)[0], insert=False,
                                    dtype=np.float16), batch, "fp16 lookup")
        ops = {"lookup": (lambda ids: half.lookup(ids, insert=False, dtype=np.float16),
                          lambda ids: full.lookup(ids, insert=False)),
               "update": (lambda ids: half.update(ids, grads),
                          lambda ids: full.update(ids, grads))}
        for op, (ours, baseline) in ops.items():
            out.update(_half_figures(f"fp16_{op}", "", ours, baseline, rng, num_rows, batch,
                                     repeats))
    return out


def bench_half_optimizers(rng: np.random.Generator, num_rows: int, dim: int, batch: int,
                          repeats: int) -> dict[str, float]:
    """The update of :func:`bench_half` with each of :data:`HALF_OPTIMIZERS`: a float32 and
    a float16 table of its own each (one optimizer's pair in memory at a time)."""
    out: dict[str, float] = {}
    grads = rng.standard_normal((batch, dim), dtype=np.float32) * np.float32(0.01)
    for name, optimizer in HALF_OPTIMIZERS.items():
        full, _ = filled_table(1, num_rows, dim, batch, repeats, optimizer=optimizer)
        half, _ = filled_table(1, num_rows, dim, batch, repeats, "float16", optimizer)
        with full, half:
            for table in (full, half):  # compiles this optimizer's kernel for the type
                table.update(existing_batches(rng, num_rows, batch, 1)[0], grads)
            out.update(_half_figures("fp16_update", f"_{name}",
                                     functools.partial(half.update, grads=grads),
                                     functools.partial(full.update, grads=grads),
                                     rng, num_rows, batch, repeats))
    return out


def _half_figures(prefix: str, suffix: str, ours: Callable[[Any], object],
                  baseline: Callable[[Any], object], rng: np.random.Generator, num_rows: int,
                  batch: int, repeats: int) -> dict[str, float]:
    """``ours`` (on float16 rows) paired call by call with ``baseline`` (float32 rows) on
    batches of existing ids: ids/s of each and their ratio, keyed ``prefix`` + what +
    ``suffix``."""
    seconds, base_seconds = paired_medians(
        ours, existing_batches(rng, num_rows, batch, repeats),
        baseline, existing_batches(rng, num_rows, batch, repeats))
    return {f"{prefix}_ids_per_s{suffix}": batch / seconds,
            f"{prefix}_fp32_ids_per_s{suffix}": batch / base_seconds,
            f"{prefix}_ratio{suffix}": base_seconds / seconds}


# -- 4: memory -------------------------------------------------------------------------


def memory_in_fresh_process(num_rows: int, dim: int) -> dict[str, int]:
    """Resident growth from filling one table, in a spawned child.

    A fresh process so the growth holds nothing but the table: no other tables, no
    allocator arenas left over from the throughput runs.
    """
    warm_up(dim)
    before = resident_bytes()
    table = EmbeddingTable(dim=dim, optimizer=OPTIMIZER, capacity=num_rows + FILL_CHUNK)
    fill(table, num_rows)
    after = resident_bytes()
    stats = table.stats()
    return {"rows": stats["entries"], "rss_delta": after - before, "table_bytes": stats["bytes"]}


def bench_memory(num_rows: int, dim: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        child = pool.submit(memory_in_fresh_process, num_rows, dim).result()
    if child["rows"] != num_rows:
        raise RuntimeError(f"memory: table holds {child['rows']} rows, expected {num_rows}")
    payload = (dim + state_width(OPTIMIZER, dim)) * 4
    rss_per_row = child["rss_delta"] / num_rows
    return {
        "memory_rows": num_rows,
        "payload_bytes_per_row": payload,
        "rss_bytes_per_row": rss_per_row,
        "table_nbytes_per_row": child["table_bytes"] / num_rows,
        "memory_ratio": rss_per_row / payload,
    }


# -- 5: gRPC ---------------------------------------------------------------------------


def bench_grpc(table: EmbeddingTable, rng: np.random.Generator, num_rows: int, dim: int,
               batch: int, repeats: int) -> dict[str, float]:
    """ids/s of ``PSClient.lookup`` of existing ids from one PS process on loopback,
    paired call by call with an in-process lookup on ``table`` (filled the same way)."""
    with tempfile.TemporaryDirectory(prefix="ps_ops-") as tmp, \
            parameter_server_process(Path(tmp), SLOT, dim, capacity=2 * num_rows) as (address, _):
        client = PSClient(address, CommonConfig())
        try:
            client.wait_ready()
            client.configure(configure_request(
                optimizer_to_dict(OPTIMIZER), init_lower=-0.01, init_upper=0.01,
                weight_bound=None, seed=0))
            start = time.perf_counter()
            for first in range(0, num_rows, FILL_CHUNK):
                keys = np.arange(first, min(first + FILL_CHUNK, num_rows))
                client.lookup([(SLOT, ids_of(keys))], training=True)
            fill_s = time.perf_counter() - start

            def lookup(ids: np.ndarray) -> np.ndarray:
                return client.lookup([(SLOT, ids)], training=False)[0]

            batches = existing_batches(rng, num_rows, batch, repeats)
            check_all_found(lookup(batches[0]), batch, "grpc lookup")
            seconds, local_seconds = paired_medians(
                lookup, batches, lambda ids: table.lookup(ids, insert=False),
                existing_batches(rng, num_rows, batch, repeats))
        finally:
            client.close()
    return {"grpc_fill_ids_per_s": num_rows / fill_s, "grpc_lookup_ids_per_s": batch / seconds,
            "grpc_local_lookup_ids_per_s": batch / local_seconds}


# -- entry point -----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ps_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help=f"rows per table (default {DEFAULT['rows']:,})")
    parser.add_argument("--dim", type=int, default=32, help="embedding dimension (default 32)")
    parser.add_argument("--batch", type=int, help=f"ids per batch (default {DEFAULT['batch']:,})")
    parser.add_argument("--repeats", type=int,
                        help=f"batches per figure (default {DEFAULT['repeats']})")
    parser.add_argument("--memory-rows", type=int,
                        help=f"rows of the memory table (default {DEFAULT['memory_rows']:,})")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true",
                         help=f"small sizes, a first look: {QUICK}; explicit flags still win")
    presets.add_argument("--smoke", action="store_true",
                         help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else QUICK if args.quick else DEFAULT
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("rows", "dim", "batch", "repeats", "memory_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch > args.rows:
        parser.error(f"--batch ({args.batch}) must not exceed --rows ({args.rows}): "
                     "lookup batches are unique existing ids")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    allocator.tune_this_process()  # as every persia_py role does (the gRPC client side)
    rows, dim, batch, repeats = args.rows, args.dim, args.batch, args.repeats
    rng = np.random.default_rng(0)
    figures: dict[str, Any] = {"rows": rows, "dim": dim, "batch": batch, "repeats": repeats,
                               "cpus": os.cpu_count()}
    print(f"EmbeddingTable benchmark: {rows:,} rows x dim {dim}, Adagrad, batches of "
          f"{batch:,} ids, median of {repeats}, {os.cpu_count()} CPUs", flush=True)

    warm_up(dim)
    take = Take(rng, rows, dim, batch)
    tables = {}
    for num_shards in (1, 4):
        table, fill_rate = filled_table(num_shards, rows, dim, batch, repeats)
        figures_of = bench_table(table, take, rng, rows, batch, repeats)
        if num_shards == 1:
            tables[1] = table  # kept for the gRPC figure's in-process side
        else:
            table.close()
        suffix = "" if num_shards == 1 else f"_shards{num_shards}"
        print(f"-- {num_shards} internal shard(s); filled at {fill_rate * 1e-6:.2f} M ids/s",
              flush=True)
        figures[f"fill_ids_per_s{suffix}"] = fill_rate
        for op in ("lookup", "insert", "update"):
            ours, base = figures_of[f"{op}_ids_per_s"], figures_of[f"{op}_take_ids_per_s"]
            figures[f"{op}_ids_per_s{suffix}"] = ours
            figures[f"{op}_take_ids_per_s{suffix}"] = base
            figures[f"{op}_ratio{suffix}"] = ours / base
            print(ratio_line(f"{op} shards={num_shards}", ours, base, "numpy.take",
                             f"{op}_ratio"), flush=True)
    del take

    memory = bench_memory(args.memory_rows, dim)
    figures.update(memory)
    print(f"-- memory at {args.memory_rows:,} rows", flush=True)
    print(ratio_line("memory bytes/row", memory["rss_bytes_per_row"],
                     memory["payload_bytes_per_row"], "payload", "memory_ratio",
                     unit="B", scale=1.0)
          + f"   (arrays {memory['table_nbytes_per_row']:.1f} B/row incl. spare capacity)",
          flush=True)

    half = bench_half(tables[1], rng, rows, dim, batch, repeats)
    figures.update(half)
    print("-- float16 rows (1 internal shard) beside the float32 table", flush=True)
    for op in ("lookup", "update"):
        print(ratio_line(f"fp16 {op}", half[f"fp16_{op}_ids_per_s"],
                         half[f"fp16_{op}_fp32_ids_per_s"], "float32", f"fp16_{op}_ratio"),
              flush=True)
    others = bench_half_optimizers(rng, rows, dim, batch, repeats)
    figures.update(others)
    for name in HALF_OPTIMIZERS:
        print(ratio_line(f"fp16 update {name.split('_')[0]}",
                         others[f"fp16_update_ids_per_s_{name}"],
                         others[f"fp16_update_fp32_ids_per_s_{name}"], "float32", None),
              flush=True)

    with tables[1] as table:
        grpc = bench_grpc(table, rng, rows, dim, batch, repeats)
    figures.update(grpc)
    local = grpc["grpc_local_lookup_ids_per_s"]
    figures["grpc_ratio"] = grpc["grpc_lookup_ids_per_s"] / local
    print(f"-- one PS process over loopback gRPC; filled at "
          f"{grpc['grpc_fill_ids_per_s'] * 1e-6:.2f} M ids/s", flush=True)
    print(ratio_line("grpc lookup", grpc["grpc_lookup_ids_per_s"], local, "in-process",
                     "grpc_ratio"), flush=True)

    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
