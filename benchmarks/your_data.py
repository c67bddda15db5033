"""Bring-your-own-data costs: hashing categorical strings, and reading a file's share.

    python -m benchmarks.your_data [--values 1000000] [--rows 100000] [--repeats 3]
                                   [--json PATH] [--smoke]

* ``hash_values``: ids of ``--values`` 8-character hex strings (Criteo's categorical
  values) by :func:`persia_py.ids.hash_values`, beside Python's ``hash()`` of the same
  strings in a list comprehension (the per-value loop it replaces; unstable across
  processes too) in the same run.
* ``csv share``: rows/s of the CSV reader over a Criteo-layout file read whole, beside
  the same reader over one of 2 shares (the per-loader cost of sharding: the newline scan
  before the share and the cut at a line).

Medians of ``--repeats``; figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.ids import hash_values
from persia_py.input.reader_share import ReaderShare
from persia_py.input.readers import CsvReader

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "criteo_tsv"


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parse_args_with_smoke(parser, argv, values=1000, rows=1000, repeats=1)

    rng = np.random.default_rng(0)
    values = np.char.zfill(np.char.mod("%x", rng.integers(0, 2**32, args.values)), 8)
    as_list = values.tolist()
    vectorized = _median_seconds(lambda: hash_values(values, salt="C1"), args.repeats)
    python = _median_seconds(lambda: [hash(v) for v in as_list], args.repeats)
    print(f"hash_values: {args.values / vectorized / 1e6:.1f}M values/s; Python hash() "
          f"loop: {args.values / python / 1e6:.1f}M values/s")

    sys.path.insert(0, str(EXAMPLE))
    from criteo_layout import CONFIG
    from generate_tsv import write_tsv

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "train.tsv")
        write_tsv(path, args.rows, seed=1)
        whole = _median_seconds(
            lambda: CsvReader(path, CONFIG, share=ReaderShare.whole()).read_all(), args.repeats)
        share = _median_seconds(
            lambda: CsvReader(path, CONFIG, share=ReaderShare(1, 2)).read_all(), args.repeats)
        rows = CsvReader(path, CONFIG, share=ReaderShare(1, 2)).read_all().num_records
    print(f"csv whole: {args.rows / whole:,.0f} rows/s; share 1 of 2: {rows / share:,.0f} "
          f"rows/s ({rows} rows)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "values": args.values, "hash_values_per_s": args.values / vectorized,
            "python_hash_values_per_s": args.values / python, "rows": args.rows,
            "csv_whole_rows_per_s": args.rows / whole, "csv_share_rows_per_s": rows / share,
            "share_rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
