"""A parameter server's lookup and update over many tables: one kernel call across the
tables (``servers/request_tables.py``, issue 43) beside the same requests served table by
table, call by call on twin tables in the same run.

    python -m benchmarks.ps_request [--tables 26] [--batches 200] [--warmup 20]
                                    [--json PATH] [--smoke]

The requests are the embedding-heavy workload's of ``benchmarks.train_throughput``: per
batch of 1,024 samples, every slot's 20 ids per sample (Zipf over 200k ids), made distinct
as the embedding worker sends them (~10k ids per table), one table per slot, dim 32,
Adagrad, rows answered as float16 and gradients sent back as float16 (its float16 wire).
Each batch is looked up and then updated on both sets of tables, in turn first (ours,
table by table; then table by table, ours), so both see the same machine and the same
rows; the figures are this thread's CPU time per batch (``time.thread_time``: every
kernel runs on the calling thread), medians over the batches after ``--warmup`` (the
first batches insert most rows: new memory, touched for the first time; later ones fewer).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.config.optimizer import AdagradConfig
from persia_py.ids.dedup import unique_in_order
from persia_py.servers.request_tables import lookup_tables, update_tables
from persia_py.servers.storage import EmbeddingTable

sys.path.insert(0, str(Path(__file__).resolve().parent / "throughput"))
from workloads import NUM_SLOTS, workload  # noqa: E402

Request = list[np.ndarray]


def tables(count: int, dim: int) -> list[EmbeddingTable]:
    return [EmbeddingTable(dim=dim, optimizer=AdagradConfig(lr=0.01), seed=1,
                           capacity=10_000_000) for _ in range(count)]


def one_call(group: list[EmbeddingTable], ids: Request) -> float:
    """CPU seconds of the lookup and update of ``ids``, one kernel call across tables."""
    start = time.thread_time()
    rows = lookup_tables(group, ids, True, [None] * len(group), [np.float16] * len(group))
    update_tables(group, [t.check_update(i, r) for t, i, r in zip(group, ids, rows)])
    return time.thread_time() - start


def by_table(group: list[EmbeddingTable], ids: Request) -> float:
    """The same, table by table (``EmbeddingTable.lookup`` and ``apply_update`` each)."""
    start = time.thread_time()
    rows = [t.lookup(i, True, dtype=np.float16) for t, i in zip(group, ids)]
    for t, i, r in zip(group, ids, rows):
        t.apply_update(*t.check_update(i, r))
    return time.thread_time() - start


def run(args: argparse.Namespace) -> dict[str, float]:
    w = workload("embedding_heavy", args.smoke)
    ours, theirs = tables(args.tables, w.dim), tables(args.tables, w.dim)
    sides: dict[str, tuple[Callable[[list[EmbeddingTable], Request], float],
                           list[EmbeddingTable], list[float]]] = {
        "one_call": (one_call, ours, []), "by_table": (by_table, theirs, [])}
    usage = [resource.getrusage(resource.RUSAGE_SELF)]
    for b in range(args.batches):
        if b == args.warmup:
            usage = [resource.getrusage(resource.RUSAGE_SELF)]
        slots = w.batch(b)[1]
        ids = [unique_in_order(slots[k % NUM_SLOTS] + np.uint64(k // NUM_SLOTS << 40))[0]
               for k in range(args.tables)]
        for name in (("one_call", "by_table") if b % 2 == 0 else ("by_table", "one_call")):
            serve, group, seconds = sides[name]
            spent = serve(group, ids)
            if b >= args.warmup:
                seconds.append(spent)
    before, after = usage[0], resource.getrusage(resource.RUSAGE_SELF)
    served = sum(sides["one_call"][2]) + sum(sides["by_table"][2])
    one = statistics.median(sides["one_call"][2])
    table = statistics.median(sides["by_table"][2])
    return {"tables": float(args.tables), "ids_per_batch": float(sum(i.size for i in ids)),
            "one_call_cpu_ms": 1e3 * one, "by_table_cpu_ms": 1e3 * table,
            "cpu_ratio": one / table, "batches_timed": float(len(sides["one_call"][2])),
            # The kernel's share of the CPU after the warm-up (zeroing the pages the growing
            # tables touch first, mostly), and the page faults per batch and side.
            "system_cpu_share": (after.ru_stime - before.ru_stime) / max(served, 1e-9),
            "page_faults_per_batch": (after.ru_minflt - before.ru_minflt)
            / (2 * max(args.batches - args.warmup, 1))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=NUM_SLOTS)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parse_args_with_smoke(parser, argv, tables=3, batches=4, warmup=1)
    if args.warmup >= args.batches:
        parser.error("--warmup must be below --batches")
    figures = run(args)
    print(f"{args.tables} tables, {int(figures['ids_per_batch'])} ids per batch; CPU per batch "
          f"(lookup + update), medians of {int(figures['batches_timed'])} batches: one call "
          f"{figures['one_call_cpu_ms']:.2f} ms, table by table {figures['by_table_cpu_ms']:.2f} "
          f"ms, ratio {figures['cpu_ratio']:.3f}; the kernel's share of the CPU "
          f"{figures['system_cpu_share']:.3f}, {figures['page_faults_per_batch']:.0f} page "
          "faults per batch")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
