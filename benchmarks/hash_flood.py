"""Hash flooding: inserting ids crafted to collide, beside random ids in the same run.

    python -m benchmarks.hash_flood [--ids 40000] [--repeats 5] [--json PATH] [--quick|--smoke]

Every figure is ``median seconds of crafted ids / median seconds of random ids`` for a
training lookup (``EmbeddingTable.lookup(insert=True)``) of ``--ids`` new ids into a fresh
table, and for a second lookup of the same ids afterwards (a flooded index stays slow:
``after`` ratios). Each crafted call is paired with a random one right before or after
it (alternating), so both see the same machine.

* ``old_hash_ratio``: ids crafted, by inverting the hash, to share one home slot of an
  index whose hash is public (``PublicHashIndex`` below), against today's keyed table;
  ~1 means the attack no longer works.
* ``old_hash_ratio_before_fix``: the same ids against ``PublicHashIndex``: what the
  attack does to an index without a secret key, as the index was before it was keyed
  (it hashed with the public ``mix64(id, HASH_STACK_SALT)``; one public bijection is as
  invertible as another).
* ``keyed_hash_ratio``: the worst insert ratio, over every attack below, against the
  keyed table (``keyed_hash_after_ratio``: the worst ``after`` ratio): those ids,
  collisions under the old public hashes (the index's, the dedup's, replica routing's),
  ids differing only in their high bits, sequential ids, and ids that collide under the
  keyed hash with a guessed key (knowing the algorithm, not the key). Target <= 2
  (printed, never asserted).

Each table's ``probe_bound`` (the longest probe any lookup can make) is reported too: a
count of slots, independent of the machine. The crafted ids must make the public table's
bound about their count; if they do not (the index placed ids differently from what
``colliding_homes`` assumes), the run stops with an error instead of reporting a
"before" figure that shows no attack.

``--smoke``: a few hundred ids, one table per figure, for the test suite (seconds; the
figures mean nothing at that size).
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

from benchmarks import SMOKE_HELP
from persia_py.ids.hashing import HASH_STACK_SALT, REPLICA_SALT, HashKey, inverse_mix64
from persia_py.servers.hash_index import HashIndex
from persia_py.servers.optimizers import SGDConfig
from persia_py.servers.storage import EmbeddingTable

DIM = 16
OLD_INDEX_SALT = HASH_STACK_SALT
"""The salt of the index hash before keying (it equalled hash stacking's)."""
OLD_DEDUP_SALT = 0
"""The dedup hash before keying was the plain finalizer."""
COLLIDE_SHIFT = 20
"""Hashes crafted against a masked table (the old index, dedup, replica routing: bucket
``hash mod 2**k``) differ only above this bit: one bucket in any such table up to 2**20."""
HOME_BITS = 32
"""Today's index takes an id's home slot from its hash's top ``HOME_BITS`` bits (scaled to
the slot count): hashes equal there share one home slot in an index of any size."""
PUBLIC_KEY = HashKey([0x5EED, 0xC0FFEE])
"""The key of ``PublicHashIndex``, known to the attacker: the index as it was before its key
was secret."""
TARGET = 2.0
AFTER_LOOKUPS = 5
"""Lookups of the flooded ids per table after the flood (median taken)."""
QUICK = {"ids": 10_000, "repeats": 3}
SMOKE = {"ids": 500, "repeats": 1}
DEFAULT = {"ids": 40_000, "repeats": 5}


class PublicHashIndex(HashIndex):
    """Today's index under a key everyone knows (``PUBLIC_KEY``, at every rebuild too):
    its home slots, tags, probes and growth are the keyed index's own, only the secret
    is gone."""

    def _reset(self, slots: int, row_limit: int) -> None:
        super()._reset(slots, row_limit)
        self._key = PUBLIC_KEY


def colliding(count: int, offset: int, salt: int) -> np.ndarray:
    """``count`` distinct ids whose ``mix64(id, salt)`` has its low ``COLLIDE_SHIFT`` bits
    zero: one bucket of a masked table under that public hash."""
    hashed = np.arange(offset + 1, offset + count + 1, dtype=np.uint64) << np.uint64(COLLIDE_SHIFT)
    return inverse_mix64(hashed, salt)


def colliding_homes(count: int, offset: int, key: HashKey) -> np.ndarray:
    """``count`` distinct ids whose keyed hash ``mix(mix(id ^ k0) ^ k1)`` under ``key`` has
    the same top ``HOME_BITS`` bits: one home slot of an index under that key, whatever
    its size. The low bits (the tags) count up from ``offset``."""
    top = np.uint64(0x5A5A5A5A) << np.uint64(64 - HOME_BITS)
    hashed = top | np.arange(offset + 1, offset + count + 1, dtype=np.uint64)
    k0, k1 = (int(w) for w in key.words)
    return inverse_mix64(inverse_mix64(hashed, k1), k0)


def guessed_key_collisions(count: int, offset: int) -> np.ndarray:
    """Ids sharing one home slot under a key the attacker guessed (the algorithm is
    public; the table's key is not)."""
    return colliding_homes(count, offset, HashKey.random())


ATTACKS: dict[str, Callable[[int, int], np.ndarray]] = {
    "public_index_collisions": lambda n, r: colliding_homes(n, r * n, PUBLIC_KEY),
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
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true",
                       help=f"small run: {QUICK['ids']:,} ids, {QUICK['repeats']} repeats")
    sizes.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    parser.add_argument("--ids", type=int, help=f"ids per lookup (default {DEFAULT['ids']:,})")
    parser.add_argument("--repeats", type=int,
                        help=f"tables per figure (default {DEFAULT['repeats']})")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    # Explicit flags win over the preset.
    preset = SMOKE if args.smoke else QUICK if args.quick else DEFAULT
    unset = {k: v for k, v in preset.items() if getattr(args, k) is None}
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
    before = measure(ATTACKS["public_index_collisions"], PublicHashIndex, args.ids,
                     args.repeats, rng)
    print(line("before fix: public_index_collisions", before))
    if before["probe_bound"] < args.ids // 2:
        raise SystemExit(
            f"the ids crafted against PublicHashIndex left its longest probe at "
            f"{before['probe_bound']} slots for {args.ids} ids: they no longer share a home "
            f"slot (has HashIndex changed how a hash picks the slot? see colliding_homes), "
            f"so the before-the-fix figure would show no attack")
    attacks = {}
    for name, make_ids in ATTACKS.items():
        attacks[name] = measure(make_ids, HashIndex, args.ids, args.repeats, rng)
        print(line(f"keyed: {name}", attacks[name]))
    worst = max(f["insert_ratio"] for f in attacks.values())
    figures = {
        "ids": args.ids,
        "repeats": args.repeats,
        "old_hash_ratio": attacks["public_index_collisions"]["insert_ratio"],
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
