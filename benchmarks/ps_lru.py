"""Hit rate of the table's LRU eviction on a Zipf stream, beside exact LRU.

    python -m benchmarks.ps_lru [--zipf 1.1,1.3] [--capacities 20000,100000] [--json PATH]
                                [--smoke]

The table evicts in bulk: when a shard is full it drops the least recently used
``max(needed, share / 16)`` rows at once, so the O(share) index rebuild is amortized.
Exact LRU (dropping only the rows needed) is the same table with that fraction
disabled. Both see the same stream: batches of 2,000 Zipf-distributed ids (deduplicated)
over 2M ids; hit rate = ids found / ids looked up, after a warm-up quarter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.servers import shard
from persia_py.servers.optimizers import SGDConfig
from persia_py.servers.storage import EmbeddingTable


def run(fraction: int, capacity: int, a: float, seed: int = 0, batches: int = 400,
        batch: int = 2000, universe: int = 2_000_000) -> float:
    shard._EVICT_FRACTION = fraction  # the bulk-eviction knob; 10**12: exact LRU
    rng = np.random.default_rng(seed)
    t = EmbeddingTable(dim=4, optimizer=SGDConfig(lr=0.1), capacity=capacity)
    warm = batches // 4
    for i in range(batches):
        ids = (rng.zipf(a, batch) % universe).astype(np.uint64)
        ids = np.unique(ids)
        if i == warm:
            s0 = t.stats()
        t.lookup(ids, True)
    s = t.stats()
    t.close()
    h, m = s['hits'] - s0['hits'], s['misses'] - s0['misses']
    return h / (h + m)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zipf", default="1.1,1.3", help="Zipf exponents, comma-separated")
    parser.add_argument("--capacities", default="20000,100000",
                        help="table capacities, comma-separated")
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--batch", type=int, default=2000, help="ids drawn per batch")
    parser.add_argument("--universe", type=int, default=2_000_000, help="distinct ids")
    parser.add_argument("--json", default=None, help="also write the hit rates here")
    args = parse_args_with_smoke(parser, argv, zipf="1.1", capacities="500", batches=8,
                                 batch=200, universe=20_000)
    sizes = {"batches": args.batches, "batch": args.batch, "universe": args.universe}
    runs = []
    for a in (float(x) for x in args.zipf.split(",")):
        for cap in (int(x) for x in args.capacities.split(",")):
            exact, bulk = run(10**12, cap, a, **sizes), run(16, cap, a, **sizes)
            runs.append({"zipf": a, "capacity": cap, "exact_lru_hit_rate": exact,
                         "bulk_eviction_hit_rate": bulk})
            print(f"zipf a={a} capacity={cap:,}: exact LRU hit rate {exact:.4f}, "
                  f"bulk eviction {bulk:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**sizes, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
