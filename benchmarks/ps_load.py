"""Parameter-server load: N concurrent clients mixing lookups and updates against one PS.

    python -m benchmarks.ps_load [--clients 1,4,16] [--seconds 5] [--dim 16] [--batch 256]
                                 [--capacity 20000] [--id-space 2000000]
                                 [--update-fraction 0.5] [--json PATH] [--smoke]

One real parameter-server process (``persia-launcher embedding-parameter-server``, port 0)
serves every run. For each N, N client threads, each with its own ``PSClient`` (its own
channel), loop for ``--seconds``: draw ``--batch`` distinct ids from ``--id-space`` (far
more ids than ``--capacity``, so most training lookups insert and the table evicts), then
either look them up for training or send Adagrad gradients for them. Printed per N:
operations/s and ids/s, p50/p99 latency, errors (target: 0), and the PS process's peak
resident memory (VmHWM); beside them the baselines from the same run: N = 1's throughput
and the process's resident memory before the load (kernels compiled) plus the table's own bytes at
capacity. Memory must stay bounded however many distinct ids arrive.

``--json PATH`` writes every figure; the top-level keys ``errors`` (all runs) and
``peak_rss_bytes`` (the process's lifetime peak) summarize them.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from benchmarks.ps_process import parameter_server_process
from persia_py.config import CommonConfig
from persia_py.workers.ps_client import PSClient, configure_request

SLOT = "load"
START_TIMEOUT_S = 120.0


def proc_status_bytes(pid: int, field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of a process, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def client_loop(address: str, index: int, args: argparse.Namespace, deadline: float,
                latencies: list[float], errors: list[str], ids_done: list[int]) -> None:
    """One client: lookups and updates of random ids until ``deadline``."""
    rng = np.random.default_rng([args.seed, index])
    client = PSClient(address, CommonConfig(rpc_timeout_sec=30))
    sequence = 0
    # Random per client and run, as the embedding worker's: a reused id would make the
    # server answer this run's first updates as duplicates of an earlier run's.
    worker_id = f"load-{index}-{secrets.token_hex(16)}"
    try:
        while time.monotonic() < deadline:
            ids = np.unique(rng.integers(1, args.id_space, args.batch, dtype=np.uint64))
            update = rng.random() < args.update_fraction
            grads = (rng.standard_normal((ids.size, args.dim)).astype(np.float32) * 0.01
                     if update else None)
            started = time.perf_counter()
            try:
                if update:
                    sequence += 1
                    client.update([(SLOT, ids, grads)], worker_id=worker_id,
                                  sequence=sequence)
                else:
                    client.lookup([(SLOT, ids)], training=True)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                errors.append(f"client {index}: {type(exc).__name__}: {exc}"[:300])
                continue
            latencies.append(time.perf_counter() - started)
            ids_done.append(ids.size)
    finally:
        client.close()


def run_clients(address: str, pid: int, num_clients: int, args: argparse.Namespace) -> dict:
    latencies: list[list[float]] = [[] for _ in range(num_clients)]
    errors: list[list[str]] = [[] for _ in range(num_clients)]
    ids_done: list[list[int]] = [[] for _ in range(num_clients)]
    started = time.monotonic()
    deadline = started + args.seconds
    threads = [threading.Thread(target=client_loop, name=f"client-{i}",
                                args=(address, i, args, deadline, latencies[i], errors[i],
                                      ids_done[i]))
               for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.seconds + 120)
        if t.is_alive():
            raise RuntimeError(f"{t.name} still running {args.seconds + 120:.0f}s after its end")
    elapsed = time.monotonic() - started
    all_latencies = np.array([x for per in latencies for x in per])
    all_errors = [e for per in errors for e in per]
    return {
        "clients": num_clients,
        "seconds": round(elapsed, 3),
        "ops": int(all_latencies.size),
        "ops_per_s": all_latencies.size / elapsed,
        "ids_per_s": sum(sum(per) for per in ids_done) / elapsed,
        "p50_ms": float(np.percentile(all_latencies, 50) * 1e3) if all_latencies.size else None,
        "p99_ms": float(np.percentile(all_latencies, 99) * 1e3) if all_latencies.size else None,
        "errors": len(all_errors),
        "first_errors": all_errors[:5],
        "rss_bytes": proc_status_bytes(pid, "VmRSS"),
        "peak_rss_bytes": proc_status_bytes(pid, "VmHWM"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ps_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each run")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=256, help="ids per request")
    p.add_argument("--capacity", type=int, default=20_000, help="the PS's rows per table")
    p.add_argument("--id-space", type=int, default=2_000_000, help="ids are drawn from [1, N)")
    p.add_argument("--update-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = parse_args_with_smoke(p, argv, clients="1,2", seconds=0.5, capacity=2000,
                                 id_space=100_000)
    args.client_counts = [int(c) for c in args.clients.split(",") if c]
    if not args.client_counts or min(args.client_counts) < 1:
        p.error("--clients needs positive counts")
    if args.id_space <= args.capacity:
        p.error("--id-space must exceed --capacity, so that the table evicts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ps_load-") as tmp, \
            parameter_server_process(Path(tmp), SLOT, args.dim, args.capacity) as (address, pid):
        admin = PSClient(address, CommonConfig(rpc_timeout_sec=30))
        admin.wait_ready()
        admin.configure(configure_request({"type": "adagrad", "lr": 0.01}, init_lower=-0.01,
                                          init_upper=0.01, weight_bound=None, seed=0))
        warm_ids = np.arange(1, 257, dtype=np.uint64)  # compile the kernels before measuring
        admin.lookup([(SLOT, warm_ids)], training=True)
        admin.update([(SLOT, warm_ids, np.zeros((256, args.dim), np.float32))],
                     worker_id=f"warm-up-{secrets.token_hex(16)}", sequence=1)
        idle_rss = proc_status_bytes(pid, "VmRSS")
        # Rows plus Adagrad state, ids and the LRU clock, without the hash index.
        table_payload = args.capacity * (2 * args.dim * 4 + 8 + 8)
        print(f"parameter server pid {pid}: capacity {args.capacity} rows of dim {args.dim}, "
              f"ids from [1, {args.id_space}), {args.batch} ids per request, "
              f"{args.update_fraction:.0%} updates, {args.seconds:.0f}s per run")
        print(f"baseline: resident before load {idle_rss / 2**20:.1f} MiB; "
              f"table rows at capacity {table_payload / 2**20:.1f} MiB")
        runs = []
        for n in args.client_counts:
            run = run_clients(address, pid, n, args)
            stats = next(t for t in admin.stats().tables if t.table == SLOT)
            run.update(entries=stats.entries, evicted=stats.evicted, table_bytes=stats.bytes)
            runs.append(run)
            scaling = run["ops_per_s"] / runs[0]["ops_per_s"] if runs[0]["ops_per_s"] else 0.0
            print(f"clients {n:3d}: {run['ops_per_s']:8.1f} ops/s ({run['ids_per_s']:10.0f} ids/s, "
                  f"{scaling:.2f}x of {runs[0]['clients']} client)  p50 {run['p50_ms']:.2f} ms  "
                  f"p99 {run['p99_ms']:.2f} ms  errors {run['errors']}  "
                  f"peak RSS {run['peak_rss_bytes'] / 2**20:.1f} MiB  "
                  f"rows {stats.entries} (evicted {stats.evicted})")
            for error in run["first_errors"]:
                print(f"    {error}")
        admin.close()
        peak = proc_status_bytes(pid, "VmHWM")
    bounded = all(r["entries"] <= args.capacity for r in runs)
    print(f"errors {sum(r['errors'] for r in runs)} (target 0); peak RSS {peak / 2**20:.1f} MiB "
          f"= {peak / idle_rss:.2f}x the idle process; rows stayed <= capacity: {bounded}")
    result = {
        "errors": sum(r["errors"] for r in runs),
        "peak_rss_bytes": peak,
        "idle_rss_bytes": idle_rss,
        "table_payload_bytes_at_capacity": table_payload,
        "rows_bounded_by_capacity": bounded,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": runs,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
