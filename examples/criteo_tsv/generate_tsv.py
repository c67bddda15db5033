"""Writes a synthetic file in Criteo's TSV layout: label, 13 integer columns, 26 hex
categorical columns, tab-separated, no header, as Criteo's ``train.txt``.

Row ``r`` is on line ``r + 1``: a row's id is its line number, which the CSV reader gives
with every record (``CsvBatch.rows``). Labels come from a hidden model: each categorical
value has an effect that is a pure function of (column, value), so a file of another
seed shares it (a test set), and a model that learns the embeddings of frequent values
beats chance clearly. Some fields are empty, as in Criteo: missing counts and categories.

    python generate_tsv.py --rows 100000 --seed 1 train.tsv
"""

from __future__ import annotations

import argparse

import numpy as np

NUM_INT = 13
NUM_CAT = 26
MISSING_RATE = 0.05


def _mix(values: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64's finalizer of ``values + salt`` (uint64)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def make_columns(num_rows: int, seed: int, vocab_size: int = 500) -> list[np.ndarray]:
    """The file's columns as strings, in order: label, I1..I13, C1..C26."""
    rng = np.random.default_rng(seed)
    int_weights = np.random.default_rng(0).normal(0.0, 0.3, NUM_INT)
    counts = rng.poisson(np.exp(rng.normal(1.0, 1.0, (num_rows, NUM_INT))))
    logit = np.log1p(counts) @ int_weights - 0.6
    columns: list[np.ndarray] = []
    for j in range(NUM_INT):
        text = counts[:, j].astype(np.str_).astype(object)
        text[rng.random(num_rows) < MISSING_RATE] = ""
        columns.append(text)
    for c in range(NUM_CAT):
        index = (rng.zipf(1.3, num_rows) - 1) % vocab_size
        hashed = _mix(index, c + 1)
        effect = (hashed >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0
        logit = logit + 0.7 * effect
        text = np.char.zfill(np.char.mod("%x", (hashed >> np.uint64(32)).astype(np.int64)),
                             8).astype(object)
        text[rng.random(num_rows) < MISSING_RATE] = ""
        columns.append(text)
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return [labels.astype(np.str_).astype(object), *columns]


def write_tsv(path: str, num_rows: int, seed: int) -> None:
    """Write ``num_rows`` rows to ``path`` (the columns joined per row by numpy)."""
    columns = make_columns(num_rows, seed)
    lines = columns[0]
    for column in columns[1:]:
        lines = lines + "\t" + column  # object arrays: elementwise string concatenation
    with open(path, "w", encoding="ascii") as f:
        f.write("\n".join(lines.tolist()))
        if num_rows:
            f.write("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    write_tsv(args.path, args.rows, args.seed)
