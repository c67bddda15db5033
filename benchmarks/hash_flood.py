"""Hash flooding: inserting ids crafted to collide, beside random ids in the same run.

    python -m benchmarks.hash_flood [--ids 40000] [--repeats 5] [--json PATH] [--quick]

Every figure is ``median seconds of crafted ids / median seconds of random ids`` for a
training lookup (``EmbeddingTable.lookup(insert=True)``) of ``--ids`` new ids into a fresh
table, and for a second lookup of the same ids afterwards (a flooded index stays slow:
``after`` ratios). Each crafted call is paired with a random one right before or after
it (alternating), so both see the same machine.

* ``old_hash_ratio``: ids that all share one home slot under the index hash as it was
  before it was keyed (``mix64(id, HASH_STACK_SALT)``, computed here by inverting the
  mix), against today's keyed table; ~1 means the old attack no longer works.
* ``old_hash_ratio_before_fix``: the same ids against a table whose index hashes with
  that old public function (``PublicHashIndex`` below: the old home slot, today's probe
  loop): what the attack did.
* ``keyed_hash_ratio``: the worst insert ratio, over every attack below, against the
  keyed table (``keyed_hash_after_ratio``: the worst ``after`` ratio):
  old-hash collisions (index, dedup, replica routing), ids differing only in their high
  bits, sequential ids, and ids that collide under the keyed hash with a guessed key
  (knowing the algorithm, not the key). Target <= 2 (printed, never asserted).

Each table's ``probe_bound`` (the longest probe any lookup can make) is reported too: a
count of slots, independent of the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persia_py.ids.hashing import HASH_STACK_SALT, REPLICA_SALT, HashKey, inverse_mix64, mix64
from persia_py.servers.hash_index import HashIndex, _insert_all_kernel
from persia_py.servers.optimizers import SGDConfig
from persia_py.servers.storage import EmbeddingTable

DIM = 16
OLD_INDEX_SALT = HASH_STACK_SALT
"""The salt of the index hash before keying (it equalled hash stacking's)."""
OLD_DEDUP_SALT = 0
"""The dedup hash before keying was the plain finalizer."""
COLLIDE_SHIFT = 20
"""Crafted hashes differ only above this bit: one home slot in any index up to 2**20 slots."""
TARGET = 2.0
AFTER_LOOKUPS = 5
"""Lookups of the flooded ids per table after the flood (median taken)."""
QUICK = {"ids": 10_000, "repeats": 3}
DEFAULT = {"ids": 40_000, "repeats": 5}


class PublicHashIndex(HashIndex):
    """The index as it was before keying: home slot ``mix64(id, HASH_STACK_SALT)``."""

    def _homes(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        hashed = mix64(ids[start:], OLD_INDEX_SALT)
        home = (hashed & np.uint64(self.slots - 1)).astype(np.int64)
        return home, (hashed >> np.uint64(self._tag_shift)) << np.uint64(self._row_bits)

    def _grow(self, slots: int, row_limit: int) -> None:
        # Today's growth rehashes with the keyed hash inside one kernel; re-insert by
        # the public home slots instead.
        occupied = self._slots[self._slots != 0].astype(np.uint64)
        rows = (occupied & self._row_mask).astype(np.int64) - 1
        count = self._count
        self._reset(slots, row_limit)
        ids = self.row_ids[rows]
        _insert_all_kernel(self._slots, self.row_ids, self._row_mask, ids, *self._homes(ids),
                           rows)
        self._count = count


def colliding(count: int, offset: int, salt: int) -> np.ndarray:
    """``count`` distinct ids whose ``mix64(id, salt)`` has its low ``COLLIDE_SHIFT`` bits zero."""
    hashed = np.arange(offset + 1, offset + count + 1, dtype=np.uint64) << np.uint64(COLLIDE_SHIFT)
    return inverse_mix64(hashed, salt)


def guessed_key_collisions(count: int, offset: int) -> np.ndarray:
    """Ids colliding under the keyed hash ``mix(mix(id ^ k0) ^ k1)`` for a key the attacker
    guessed (the algorithm is public; the table's key is not)."""
    k0, k1 = (int(w) for w in HashKey.random().words)
    return inverse_mix64(colliding(count, offset, k1), k0)


ATTACKS: dict[str, Callable[[int, int], np.ndarray]] = {
    "old_index_collisions": lambda n, r: colliding(n, r * n, OLD_INDEX_SALT),
    "old_dedup_collisions": lambda n, r: colliding(n, r * n, OLD_DEDUP_SALT),
    "replica_hash_collisions": lambda n, r: colliding(n, r * n, REPLICA_SALT),
    "high_bits_only": lambda n, r: (np.uint64(r + 1)
                                    | np.arange(1, n + 1, dtype=np.uint64) << np.uint64(44)),
    "sequential": lambda n, r: np.arange(r * n + 1, (r + 1) * n + 1, dtype=np.uint64),
    "guessed_key_collisions": guessed_key_collisions,
}
"""Crafted id sets: ``attack(count, repeat)`` gives distinct ids, different per repeat."""


def random_ids(rng: np.random.Generator, count: int) -> np.ndarray:
    return np.unique(rng.integers(1, 2**63, count + count // 100 + 16, dtype=np.uint64))[:count]


def fresh_table(index: type[HashIndex], capacity: int) -> EmbeddingTable:
    # Capacity for just these ids: small row arrays stay off huge pages, whose first
    # touch (and compaction) costs far more, and far more erratically, than any hash.
    table = EmbeddingTable(dim=DIM, optimizer=SGDConfig(lr=0.1), capacity=capacity)
    table._shards[0].index = index()  # the one internal shard, still empty
    return table


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flood(ids: np.ndarray, index: type[HashIndex]) -> tuple[float, float, int]:
    """Seconds of the inserting lookup and of a lookup afterwards, and the probe bound."""
    table = fresh_table(index, ids.shape[0])
    insert_s = _timed(lambda: table.lookup(ids, insert=True))
    # A few ms each: the median of several keeps one scheduling hiccup out of the figure.
    after_s = statistics.median(_timed(lambda: table.lookup(ids, insert=False))
                                for _ in range(AFTER_LOOKUPS))
    bound = table._shards[0].index.probe_bound()
    table.close()
    return insert_s, after_s, bound


def measure(make_ids: Callable[[int, int], np.ndarray], index: type[HashIndex], count: int,
            repeats: int, rng: np.random.Generator) -> dict[str, float]:
    """Ratios of crafted over random ids (same count, same index class), paired."""
    crafted: list[tuple[float, float, int]] = []
    plain: list[tuple[float, float, int]] = []
    for r in range(repeats):
        ids, baseline = make_ids(count, r), random_ids(rng, count)
        if r % 2:
            crafted.append(flood(ids, index))
            plain.append(flood(baseline, index))
        else:
            plain.append(flood(baseline, index))
            crafted.append(flood(ids, index))
    figures = {}
    for k, name in enumerate(("insert", "after")):
        ours = statistics.median(c[k] for c in crafted)
        base = statistics.median(p[k] for p in plain)
        figures[f"{name}_ratio"] = ours / base
        figures[f"{name}_ms"] = ours * 1e3
        figures[f"random_{name}_ms"] = base * 1e3
    figures["probe_bound"] = max(c[2] for c in crafted)
    figures["random_probe_bound"] = max(p[2] for p in plain)
    return figures


def line(name: str, f: dict[str, float]) -> str:
    return (f"{name:<34} insert {f['insert_ms']:9.2f} ms / random {f['random_insert_ms']:7.2f} ms"
            f" = {f['insert_ratio']:7.2f}   after {f['after_ratio']:7.2f}   probe bound "
            f"{f['probe_bound']:>6} (random {f['random_probe_bound']})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hash_flood", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"small run: {QUICK['ids']:,} ids, {QUICK['repeats']} repeats")
    parser.add_argument("--ids", type=int, help=f"ids per lookup (default {DEFAULT['ids']:,})")
    parser.add_argument("--repeats", type=int,
                        help=f"tables per figure (default {DEFAULT['repeats']})")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    # Explicit flags win over the preset.
    unset = {k: v for k, v in (QUICK if args.quick else DEFAULT).items() if getattr(args, k) is None}
    vars(args).update(unset)
    if min(args.ids, args.repeats) < 1:
        parser.error("--ids and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    for index in (HashIndex, PublicHashIndex):  # numba compiles (or loads) on first use
        flood(random_ids(rng, 1000), index)
    print(f"{args.ids:,} new ids per lookup, median of {args.repeats} tables each, "
          f"ratio = crafted / random ids")
    before = measure(ATTACKS["old_index_collisions"], PublicHashIndex, args.ids,
                     args.repeats, rng)
    print(line("before fix: old_index_collisions", before))
    attacks = {}
    for name, make_ids in ATTACKS.items():
        attacks[name] = measure(make_ids, HashIndex, args.ids, args.repeats, rng)
        print(line(f"keyed: {name}", attacks[name]))
    worst = max(f["insert_ratio"] for f in attacks.values())
    figures = {
        "ids": args.ids,
        "repeats": args.repeats,
        "old_hash_ratio": attacks["old_index_collisions"]["insert_ratio"],
        "old_hash_ratio_before_fix": before["insert_ratio"],
        "old_hash_after_ratio_before_fix": before["after_ratio"],
        "keyed_hash_ratio": worst,
        "keyed_hash_after_ratio": max(f["after_ratio"] for f in attacks.values()),
        "keyed_probe_bound": max(f["probe_bound"] for f in attacks.values()),
        "before_fix": before,
        "attacks": attacks,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")
    met = "met" if worst <= TARGET else "NOT met"
    print(f"old_hash_ratio {figures['old_hash_ratio']:.2f} (before fix "
          f"{before['insert_ratio']:.1f}); keyed_hash_ratio {worst:.2f}, "
          f"target <= {TARGET} ({met})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
