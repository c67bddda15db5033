"""CSV throughput of the streaming reader, beside the row-by-row ``CsvReader``.

    python -m benchmarks.stream_reader [--rows 200000] [--batch-size 1024] [--json PATH] [--smoke]

Writes one CSV file (an int, two floats and two id-list columns, as a click log) and
reads it in batches with :class:`persia_py.input.stream_reader.StreamReader` (array-parsed,
positions kept) and with :class:`persia_py.input.readers.CsvReader` (``csv`` module, a
Python loop per row) in the same run; then times the position log's durable append
(one ``write`` + ``fsync`` per batch), the price of exact restarts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.input.readers import CsvColumn, CsvReader, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamPosition, StreamReader
from persia_py.stream_source import PositionLog

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
           CsvColumn(name="x", kind="float"), CsvColumn(name="user", kind="ids"),
           CsvColumn(name="tags", kind="ids"))


def _write(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    tags = rng.integers(0, 10**6, (rows, 3))
    lines = [f"{i},{rng.integers(0, 2)},{rng.random():.5f},{rng.integers(0, 10**7)},"
             f"{t[0]} {t[1]} {t[2]}\n" for i, t in zip(range(rows), tags)]
    path.write_text("".join(lines))


def _best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--appends", type=int, default=500,
                        help="position-log appends timed (each one fsync'd)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args_with_smoke(parser, argv, rows=2000, batch_size=256, repeats=1,
                                 appends=5)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "stream")
        folder.mkdir()
        _write(folder / "000.csv", args.rows)
        (folder / "001.csv").write_text("")  # a later file: 000.csv is finished
        config = CsvReaderConfig(columns=COLUMNS)

        def stream() -> None:
            reader = StreamReader(folder, CsvFormat(config), poll_interval_sec=0.01,
                                  idle_timeout_sec=0.01)
            assert sum(b.num_records for b in reader.batches(args.batch_size)) == args.rows

        def rows() -> None:
            reader = CsvReader(folder / "000.csv", config)
            assert sum(b.num_records for b in reader.batches(args.batch_size)) == args.rows

        stream_sec = _best(args.repeats, stream)
        baseline_sec = _best(args.repeats, rows)
        num_appends = args.appends
        log = PositionLog(Path(tmp, "loader-0.positions"))
        position = StreamPosition("000.csv", 0, 0)
        started = time.perf_counter()
        for seq in range(num_appends):
            log.append(seq, position, position)
        append_ms = (time.perf_counter() - started) / num_appends * 1e3
        log.close()
    result = {
        "rows": args.rows, "batch_size": args.batch_size,
        "stream_rows_per_sec": round(args.rows / stream_sec),
        "csv_reader_rows_per_sec": round(args.rows / baseline_sec),
        "ratio": round(baseline_sec / stream_sec, 2),
        "position_log_append_ms": round(append_ms, 3),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
