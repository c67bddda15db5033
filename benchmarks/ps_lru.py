"""Hit rate of the table's LRU eviction on a Zipf stream, beside exact LRU.

    python -m benchmarks.ps_lru

The table evicts in bulk: when a shard is full it drops the least recently used
``max(needed, share / 16)`` rows at once, so the O(share) index rebuild is amortized.
Exact LRU (dropping only the rows needed) is the same table with that fraction
disabled. Both see the same stream: batches of 2,000 Zipf-distributed ids (deduplicated)
over 2M ids; hit rate = ids found / ids looked up, after a warm-up quarter.
"""

import numpy as np

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


def main() -> None:
    for a in (1.1, 1.3):
        for cap in (20_000, 100_000):
            exact, bulk = run(10**12, cap, a), run(16, cap, a)
            print(f"zipf a={a} capacity={cap:,}: exact LRU hit rate {exact:.4f}, "
                  f"bulk eviction {bulk:.4f}")


if __name__ == "__main__":
    main()
