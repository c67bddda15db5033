"""What a parameter server's update log costs, and how fast a restart replays it.

    python -m benchmarks.update_log [--updates 300] [--ids 2048] [--dim 32] [--rounds 5] [--json PATH]
                                    [--smoke]

Applies the same stream of updates (a training lookup, then an Adagrad update of
``--ids`` ids in each of two tables) to a ``ParameterServer`` without a log and to one
with ``--update-log``, alternating, ``--rounds`` times; reports the medians and their
ratio. Then replays the log into a new replica, as a restart does (``open_update_log``
with ``replay``), beside the time the live replica took to apply the same updates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from persia_py.config import (
    EmbeddingTablesConfig,
    GlobalConfig,
    ParameterServerConfig,
    SlotConfig,
)
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.replica_start import open_update_log

ADAGRAD = {"type": "adagrad", "lr": 0.05}


def _server(dim: int) -> ParameterServer:
    config = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        capacity=2_000_000))
    embedding = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=dim),
                                                    "item": SlotConfig(dim=dim)})
    return ParameterServer(config, embedding)


def _stream(num_updates: int, num_ids: int, dim: int) -> list[list]:
    rng = np.random.default_rng(0)
    stream = []
    for _ in range(num_updates):
        requests = []
        for table in ("user", "item"):
            ids = np.unique(rng.zipf(1.2, num_ids).astype(np.uint64) % 1_000_000 + 1)
            requests.append((table, ids, rng.normal(size=(ids.size, dim)).astype(np.float32)))
        stream.append(requests)
    return stream


def _apply(ps: ParameterServer, stream: list[list]) -> float:
    started = time.perf_counter()
    for sequence, requests in enumerate(stream):
        for table, ids, _ in requests:
            ps.lookup([(table, ids)], training=True)
        ps.update(requests, worker_id="bench", sequence=sequence)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--ids", type=int, default=2048, help="ids per table per update")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args_with_smoke(parser, argv, updates=5, ids=64, dim=8, rounds=1)
    stream = _stream(args.updates, args.ids, args.dim)
    plain, logged = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            ps = _server(args.dim)
            ps.configure(optimizer=ADAGRAD)
            plain.append(_apply(ps, stream))
            ps.close()
            ps = _server(args.dim)
            open_update_log(ps, Path(tmp, f"log{r}"), replay=False, checkpoint=None, root=tmp)
            ps.configure(optimizer=ADAGRAD)
            logged.append(_apply(ps, stream))
            ps.update_log.close()
            ps.close()
        log_bytes = sum(f.stat().st_size for f in Path(tmp, "log0").iterdir())
        replays = []
        for r in range(args.rounds):
            ps = _server(args.dim)
            started = time.perf_counter()
            open_update_log(ps, Path(tmp, f"log{r}"), replay=True, checkpoint=None, root=tmp)
            replays.append(time.perf_counter() - started)
            ps.update_log.close()
            ps.close()
    results = {
        "updates": args.updates, "ids_per_table": args.ids, "dim": args.dim,
        "median_s_without_log": statistics.median(plain),
        "median_s_with_log": statistics.median(logged),
        "with_log_over_without": statistics.median(logged) / statistics.median(plain),
        "log_mb": log_bytes / 1e6,
        "median_s_replay": statistics.median(replays),
        "replay_over_live": statistics.median(replays) / statistics.median(plain),
    }
    for key, value in results.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
