"""Checkpoint dump and load throughput of one parameter server, beside plain ``numpy.save``.

    python -m benchmarks.checkpoint [--rows 2000000] [--dim 32] [--json PATH] [--smoke]

Fills one Adagrad table (weights + per-row optimizer state), then times
``dump_replica`` + ``commit`` (every file fsync'd, manifest, rename) and ``load_replica``
into a fresh server, against ``numpy.save`` / ``numpy.load`` of the very same arrays in the
same run. Ratios are ours / baseline in rows per second (> 1: faster than the baseline).
``numpy.load`` runs right before our load and right after it (best of both, and of the
repeats): each then faults in memory just freed by the other, the same state of memory
for both (this VM hands memory freed seconds ago back to its host: faulting it in again
costs more than the disk's reads).
``dump_ratio_fsync`` is against ``numpy.save`` of the same arrays each followed by an
``fsync`` of its file: a dump that is on the disk when it returns, as ours is (``numpy.save``
alone returns once the page cache holds the bytes).
Our files are written past the page cache (``O_DIRECT``), so our load reads the device,
while ``numpy.load`` of files ``numpy.save`` just wrote reads RAM: ``load_ratio_cold`` is
against ``numpy.load`` of the same files once dropped from the page cache
(``POSIX_FADV_DONTNEED`` after an fsync), the device's rate for both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.checkpoint import layout as fmt
from persia_py.config import EmbeddingTablesConfig, GlobalConfig, ParameterServerConfig, SlotConfig
from persia_py.servers.checkpoint import dump_replica, load_replica
from persia_py.servers.parameter_server import ParameterServer


def _server(rows: int, dim: int) -> ParameterServer:
    cfg = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        capacity=2 * rows, num_hashmap_internal_shards=4))
    ps = ParameterServer(cfg, EmbeddingTablesConfig(slots_config={"slot": SlotConfig(dim=dim)}))
    ps.configure(optimizer={"type": "adagrad", "lr": 0.01})
    return ps


def _drop_cache(path: Path) -> None:
    """Write ``path`` out and drop its pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _timed(best: dict, cpu: dict, name: str) -> Iterator[None]:
    """Keep the block's wall seconds in ``best[name]`` and its process CPU seconds in
    ``cpu[name]`` where lower than before."""
    c, t = time.process_time(), time.perf_counter()
    yield
    best[name] = min(best[name], time.perf_counter() - t)
    if name in cpu:
        cpu[name] = min(cpu[name], time.process_time() - c)


def _np_save_fsync(folder: Path, arrays: dict) -> None:
    """``numpy.save`` of each array, its file fsync'd before the next (a durable save)."""
    for name, a in arrays.items():
        with open(folder / f"{name}.npy", "wb") as f:
            np.save(f, a)
            f.flush()
            os.fsync(f.fileno())


def _np_load(folder: Path, arrays: dict) -> dict:
    return {name: np.load(folder / f"{name}.npy") for name in arrays}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parse_args_with_smoke(parser, argv, rows=2000, repeats=1)
    rng = np.random.default_rng(0)
    ps = _server(args.rows, args.dim)
    table = ps._tables["slot"]
    ids = rng.choice(2**62, size=args.rows, replace=False).astype(np.uint64)
    table.import_rows(ids, rng.normal(size=(args.rows, args.dim)).astype(np.float32),
                      rng.random((args.rows, table.state_width), dtype=np.float32))
    rows = table.export_rows()
    arrays = {k: rows[k] for k in ("ids", "weights", "state", "last_access")}
    num_bytes = sum(a.nbytes for a in arrays.values())
    work = Path(tempfile.mkdtemp(prefix="persia-ckpt-bench-"))
    best = {"dump": np.inf, "load": np.inf, "np_save": np.inf, "np_save_fsync": np.inf,
            "np_load": np.inf, "np_load_cold": np.inf}
    cpu = {"dump": np.inf, "load": np.inf, "np_load": np.inf}
    try:
        for i in range(args.repeats):
            plain = work / f"plain-{i}"
            plain.mkdir()
            t = time.perf_counter()
            for name, a in arrays.items():
                np.save(plain / f"{name}.npy", a)
            best["np_save"] = min(best["np_save"], time.perf_counter() - t)
            durable = work / f"durable-{i}"
            durable.mkdir()
            with _timed(best, cpu, "np_save_fsync"):
                _np_save_fsync(durable, arrays)
            shutil.rmtree(durable)
            # numpy.load before and after ours: each load then faults in memory the other
            # has just freed (on this VM memory freed a few seconds ago is handed back to
            # the host and costs more to fault in again than the disk's reads: docs/benchmarks.md)
            with _timed(best, cpu, "np_load"):
                back = _np_load(plain, arrays)
            assert back["ids"].shape[0] == args.rows
            tmp = fmt.new_tmp_dir(work / "ckpt")
            with _timed(best, cpu, "dump"):
                dump_replica(ps, tmp)
                fmt.commit(tmp, {"num_ps_replicas": 1, "rank_steps": [i]}, step=i)
            fresh = _server(args.rows, args.dim)
            del back
            with _timed(best, cpu, "load"):
                loaded, _ = load_replica(fresh, work / "ckpt")
            assert loaded == args.rows
            fresh.close()
            with _timed(best, cpu, "np_load"):
                back = _np_load(plain, arrays)
            del back
            for name in arrays:  # out of the page cache: read from the device, as ours are
                _drop_cache(plain / f"{name}.npy")
            with _timed(best, cpu, "np_load_cold"):
                back = _np_load(plain, arrays)
            del back
            shutil.rmtree(plain)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ps.close()
    mb = num_bytes / 1e6
    figures = {"rows": args.rows, "dim": args.dim, "megabytes": mb}
    print(f"{args.rows:,} rows, dim {args.dim}, adagrad state: {mb:.0f} MB of arrays")
    for name, label in (("dump", "persia_py dump (fsync, manifest, rename)"),
                        ("np_save", "numpy.save, same arrays"),
                        ("np_save_fsync", "numpy.save + fsync of each file"),
                        ("load", "persia_py load (route every row, insert)"),
                        ("np_load", "numpy.load, same arrays"),
                        ("np_load_cold", "numpy.load, not in the page cache")):
        seconds = best[name]
        figures[f"{name}_rows_per_s"] = args.rows / seconds
        figures[f"{name}_mb_per_s"] = mb / seconds
        print(f"  {label:42s} {seconds:7.3f} s  {args.rows / seconds / 1e6:7.2f} M rows/s  "
              f"{mb / seconds:8.1f} MB/s")
    for name, seconds in cpu.items():  # the process's CPU seconds (all threads), best run
        figures[f"{name}_cpu_s"] = seconds
    figures["dump_ratio"] = best["np_save"] / best["dump"]
    figures["dump_ratio_fsync"] = best["np_save_fsync"] / best["dump"]
    figures["load_ratio"] = best["np_load"] / best["load"]
    figures["load_ratio_cold"] = best["np_load_cold"] / best["load"]
    print(f"dump_ratio (ours/numpy.save, rows/s) {figures['dump_ratio']:.2f}; dump_ratio_fsync "
          f"{figures['dump_ratio_fsync']:.2f}; "
          f"load_ratio (ours/numpy.load) {figures['load_ratio']:.2f}; load_ratio_cold "
          f"{figures['load_ratio_cold']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
