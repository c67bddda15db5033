"""The checkpoint half of ``python -m benchmarks.disk_tier``: a table with most rows on
its disk tier dumped as a checkpoint writes it, and loaded into a fresh tiered table."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time

from persia_py.ops import safe_files
from persia_py.servers.page_file import PageFile, aligned_empty
from persia_py.servers.storage import EmbeddingTable
from persia_py.servers.table_files import TableFiles, row_chunks, write_table


def checkpoint_speed(table: EmbeddingTable, directory: str, fresh: EmbeddingTable) -> dict:
    """Dump ``table`` (most of its rows on disk) as a checkpoint does (its four files, rows
    streamed from RAM and from the tier's sequential reads, O_DIRECT, fsync'd), then load
    them into ``fresh`` (an empty tiered table, closed here: RAM's share in RAM, the rest to its
    tier); GB/s of the rows' checkpoint bytes each way (``checkpoint_gb_per_s``: the
    slower), and the process's CPU seconds each way (``checkpoint_dump_cpu_s``,
    ``checkpoint_load_cpu_s``: on a shared machine the wall clock measures the others'
    load too), beside this disk's copy rate measured right after
    (``checkpoint_device_copy_gb_per_s``, :func:`device_copy_gb_per_s`)."""
    work = tempfile.mkdtemp(prefix="persia-tier-ckpt-", dir=directory)
    try:
        with safe_files.opened_dir(None, work) as fd:
            t0, c0 = time.perf_counter(), time.process_time()
            description, num_bytes = write_table(fd, "t0", table)
            dump, dump_cpu = time.perf_counter() - t0, time.process_time() - c0
            with contextlib.ExitStack() as stack:
                t0, c0 = time.perf_counter(), time.process_time()
                files = TableFiles(fd, description, "t0", None, stack)
                loaded = fresh.load_chunks(row_chunks([files]))
                load, load_cpu = time.perf_counter() - t0, time.process_time() - c0
        on_disk = fresh.disk_stats()["disk_rows"]
    finally:
        fresh.close()
        shutil.rmtree(work, ignore_errors=True)
    if loaded != description["num_rows"]:
        raise RuntimeError(f"loaded {loaded} rows of {description['num_rows']}")
    device = device_copy_gb_per_s(directory, max(64, int(num_bytes / 2**20)))
    print(f"checkpoint of {loaded:,} rows ({on_disk:,} to disk on load), {num_bytes / 1e9:.2f} "
          f"GB: dump {dump:.2f}s ({num_bytes / dump / 1e9:.2f} GB/s, {dump_cpu:.2f} CPU s), "
          f"load {load:.2f}s ({num_bytes / load / 1e9:.2f} GB/s, {load_cpu:.2f} CPU s); "
          f"the disk copies {device:.2f} GB/s (read and written at once)")
    return {"checkpoint_rows": loaded, "checkpoint_bytes": num_bytes,
            "checkpoint_device_copy_gb_per_s": device,
            "checkpoint_rows_on_disk": on_disk,
            "checkpoint_dump_gb_per_s": num_bytes / dump / 1e9,
            "checkpoint_load_gb_per_s": num_bytes / load / 1e9,
            "checkpoint_gb_per_s": num_bytes / max(dump, load) / 1e9,
            "checkpoint_dump_cpu_s": dump_cpu, "checkpoint_load_cpu_s": load_cpu}


def device_copy_gb_per_s(directory: str, mib: int) -> float:
    """GB/s at which this disk copies ``mib`` MiB from one file of ``directory`` to another,
    ``O_DIRECT``, in 8 MiB pieces, reading and writing at once: what a dump (the tier's
    file read, the checkpoint written) or a load (the checkpoint read, the tier written)
    of rows on disk moves, so the rate their rows' GB/s cannot pass on this machine."""
    chunk = 2048  # 4 KiB blocks: 8 MiB
    blocks = max(chunk, mib * 256)
    source = PageFile(directory, block_bytes=4096, num_blocks=blocks)
    target = PageFile(directory, block_bytes=4096, num_blocks=blocks)
    try:
        data = aligned_empty((chunk, 4096))
        data[:] = 1  # written blocks: an unwritten extent would read as zeros, not the disk
        pieces = [(first, min(chunk, blocks - first)) for first in range(0, blocks, chunk)]
        for first, n in pieces:
            source.write_blocks(first, data[:n])
        into = aligned_empty((chunk, 4096))

        def read() -> None:
            for first, n in pieces:
                source.read_range(first, n, into[:n])

        t0 = time.perf_counter()
        reader = threading.Thread(target=read)
        reader.start()
        for first, n in pieces:
            target.write_blocks(first, data[:n])
        reader.join()
        return blocks * 4096 / (time.perf_counter() - t0) / 1e9
    finally:
        source.close()
        target.close()
