"""Online freshness: serving AUC against how often training pushes to serving, and what
pushing costs training (Monolith's experiment, on a synthetic drifting stream).

    python -m benchmarks.online_freshness [--batches N] [--json PATH] [--smoke]

The stream (seeded, generated here) is time-ordered and drifts: every batch, new items
are born, and impressions favour young items (an item's chance to be shown fades with
its age), so most clicks of any hour go to items that did not exist a few hours
before. A click depends on the item's hidden quality, on a user-item affinity and on the
user.

One online training job (TrainCtx in this process, its embedding parameter server and
embedding worker as real processes) trains on the stream once, exporting embedding
increments (``incremental_every_updates``: one update request per batch, so stream time)
and dense versions (:class:`~persia_py.checkpoint.dense_export.DenseExporter`) every ``short``
batches; every export records its stream position. Serving replicas (inference-mode
parameter servers and a dense model in this process) then follow that export folder
through the stream, each syncing at its own interval: every batch arriving after a sync
is scored by the replica as of that sync, before any later export, exactly as a
replica that polls at that interval would have answered it, with the same apply code
(:func:`~persia_py.servers.increments.apply_increment`,
:func:`~persia_py.checkpoint.dense_export.read_dense_version`). ``never`` keeps the state of the end
of the first quarter of the stream; all replicas are scored on the rest.

Printed: serving AUC per interval, mean serving staleness (stream seconds between a
sample and the export its replica answered with), training samples/s with exports every
``short`` batches and with no export (runs alternated after an untimed warm-up run,
medians). Items unseen for
``--item-expiry`` lookups expire on the training side; the increments carry those
removals, and the replicas' row counts show they were applied.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import parse_args_with_smoke
from benchmarks.ps_process import role_process
from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.dense_export import DenseExporter, dense_versions, read_dense_version
from persia_py.config import (
    CommonConfig,
    EmbeddingTablesConfig,
    GlobalConfig,
    ParameterServerConfig,
    SlotConfig,
)
from persia_py.embedding.data import (
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.metrics import roc_auc
from persia_py.ops import safe_files
from persia_py.servers.increments import apply_increment, increment_folders
from persia_py.servers.parameter_server import ParameterServer

DIM = 8
LR = 0.05
CAPACITY = 1 << 20
"""Rows per table: the stream has a few thousand items and users."""
WARMUP_BATCHES = 20
"""Batches of each training run before its clock starts (kernels compile, rows appear)."""


@dataclass(frozen=True)
class Stream:
    """A time-ordered click stream whose items are born and fade (all from ``seed``)."""

    num_batches: int = 400
    batch_size: int = 512
    batch_stream_sec: float = 216.0
    """Stream time one batch covers (400 batches: 24 h)."""
    num_users: int = 4000
    items_per_batch: int = 12
    """Items born per batch."""
    fade_batches: float = 20.0
    """Mean age, in batches, of the item of an impression: old items fade away."""
    seed: int = 0

    def batches(self) -> list[tuple[np.ndarray, ...]]:
        """Every batch as (user ids, item ids, dense features, labels), in time order."""
        rng = np.random.default_rng(self.seed)
        num_items = self.num_batches * self.items_per_batch
        quality = rng.normal(0.0, 1.2, num_items)
        item_taste = rng.normal(0.0, 0.6, (num_items, 4))
        user_taste = rng.normal(0.0, 0.6, (self.num_users, 4))
        user_bias = rng.normal(0.0, 0.5, self.num_users)
        out = []
        for b in range(self.num_batches):
            n = self.batch_size
            users = rng.integers(0, self.num_users, n)
            born = np.maximum(b - np.floor(rng.exponential(self.fade_batches, n)), 0)
            items = born.astype(np.int64) * self.items_per_batch + rng.integers(
                0, self.items_per_batch, n)
            logit = (quality[items] + np.einsum("nd,nd->n", user_taste[users], item_taste[items])
                     + user_bias[users] - 1.0)
            labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
            hour = 2 * np.pi * ((b * self.batch_stream_sec) % 86400.0) / 86400.0
            dense = np.tile(np.array([[np.sin(hour), np.cos(hour)]], np.float32), (n, 1))
            out.append((users.astype(np.uint64) + 1, items.astype(np.uint64) + 1, dense,
                        labels[:, None]))
        return out


class Tower(torch.nn.Module):
    """Dense tower over the user and item embeddings and the hour of day."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2 + 2 * DIM, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, dense: list[torch.Tensor], embeddings: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.mlp(torch.cat([dense[0], *embeddings], dim=1)))


def _persia_batch(batch: tuple[np.ndarray, ...]) -> PersiaBatch:
    users, items, dense, labels = batch
    return PersiaBatch([IDTypeFeatureWithSingleID("user", users),
                        IDTypeFeatureWithSingleID("item", items)],
                       non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)])


def _write_configs(workdir: Path, short: int | None, item_expiry: int) -> list[str]:
    embedding = workdir / "embedding_config.yml"
    embedding.write_text(f"slots_config:\n  user:\n    dim: {DIM}\n  item:\n    dim: {DIM}\n"
                         f"    expire_after_steps: {item_expiry}\n")
    exports = (f"  incremental_dir: {workdir / 'inc'}\n  incremental_every_updates: {short}\n"
               if short else "")
    global_ = workdir / "global_config.yml"
    global_.write_text(f"embedding_parameter_server_config:\n  capacity: {CAPACITY}\n"
                       f"checkpoint_config:\n  root: {workdir}\n{exports}")
    return ["--embedding-config", str(embedding), "--global-config", str(global_)]


def train(stream: list[tuple[np.ndarray, ...]], workdir: Path, *, short: int | None,
          item_expiry: int, warmup: int = WARMUP_BATCHES) -> float:
    """Train online on ``stream`` with real PS and embedding-worker processes, exporting
    every ``short`` batches (None: no export); returns samples/s after the first
    ``warmup`` batches."""
    if len(stream) <= warmup:
        raise ValueError(f"a stream of {len(stream)} batches has none after the {warmup} "
                         "warm-up batches to time")
    from persia_py.ctx import TrainCtx
    from persia_py.data import DataLoader, IterableDataset
    from persia_py.embedding.optim import Adagrad
    from persia_py.env import PersiaEnv

    class Batches(IterableDataset):
        def __iter__(self):
            return (_persia_batch(b) for b in stream)

    workdir.mkdir(parents=True)
    config = _write_configs(workdir, short, item_expiry)
    torch.manual_seed(0)
    model = Tower()
    with contextlib.ExitStack() as stack:
        ps, _ = stack.enter_context(role_process(workdir, "embedding-parameter-server", config))
        ew, _ = stack.enter_context(role_process(workdir, "embedding-worker",
                                                 [*config, "--ps-addrs", ps], name="ew"))
        exporter = (None if short is None else stack.enter_context(contextlib.closing(
            DenseExporter(workdir / "dense", every_steps=short, keep=None).start())))
        common = CommonConfig(rpc_timeout_sec=60, startup_timeout_sec=120)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=LR),
                      dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=LR),
                      global_config=GlobalConfig(common_config=common),
                      env=PersiaEnv(embedding_worker_addrs=(ew,), ps_addrs=(ps,))) as ctx:
            started = None
            for step, batch in enumerate(DataLoader(Batches(buffer_size=8),
                                                    embedding_staleness=2)):
                if step == warmup:
                    started = time.perf_counter()
                output, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
                if exporter is not None:
                    exporter.after_step(model)
            ctx.flush()
            elapsed = time.perf_counter() - started
    return (len(stream) - warmup) * len(stream[0][0]) / elapsed


def _increments(directory: Path) -> list[tuple[int, Path]]:
    """(update requests before its rows were read, folder) of every increment, in order."""
    out = []
    for _, _, folder in increment_folders(directory):
        manifest = safe_files.load_json(folder / fmt.MANIFEST)
        out.append((int(manifest["num_updates"]), folder))
    return out


class Replica:
    """A serving replica that syncs with the export folder at its own interval."""

    def __init__(self, workdir: Path, embedding: EmbeddingTablesConfig) -> None:
        self.ps = ParameterServer(GlobalConfig(embedding_parameter_server_config=(
            ParameterServerConfig(capacity=CAPACITY))), embedding, inference=True)
        self.ps.configure(optimizer={"type": "adagrad", "lr": LR})
        self.model = Tower().eval()
        self.increments = _increments(workdir / "inc")
        self.versions = [(int(safe_files.load_json(f / fmt.MANIFEST)["step"]), f)
                         for _, f in dense_versions(workdir / "dense")]
        self.next_increment = 0
        self.position = 0
        """Update requests the newest applied increment counts (its stream position)."""
        self.dense_step = 0

    def sync(self, batch: int, dense: bool = True) -> None:
        """Apply every export made before ``batch`` was trained on."""
        while (self.next_increment < len(self.increments)
               and self.increments[self.next_increment][0] <= batch):
            self.position, folder = self.increments[self.next_increment]
            apply_increment(self.ps, folder, 0)
            self.next_increment += 1
        newest = [(s, f) for s, f in self.versions if s <= batch]
        if dense and newest and newest[-1][0] > self.dense_step:
            self.dense_step, folder = newest[-1]
            state, _ = read_dense_version(folder, self.model.state_dict())
            self.model.load_state_dict(state)

    @torch.no_grad()
    def score(self, batch: tuple[np.ndarray, ...]) -> np.ndarray:
        users, items, dense, _ = batch
        rows = self.ps.lookup([("user", users), ("item", items)], training=False)
        return self.model([torch.from_numpy(dense)],
                          [torch.from_numpy(r) for r in rows]).numpy()[:, 0]


def replay(stream: list[tuple[np.ndarray, ...]], workdir: Path, intervals: dict[str, int | None],
           spec: Stream, item_expiry: int) -> dict[str, dict]:
    """Serving AUC and staleness of a replica per interval over the last 3/4 of the stream
    (``None``: it never syncs after the first quarter; ``"sparse/dense"`` names of the
    form ``(a, b)`` sync embeddings every a and the dense model every b batches)."""
    embedding = EmbeddingTablesConfig(slots_config={
        "user": SlotConfig(dim=DIM), "item": SlotConfig(dim=DIM)})
    first = len(stream) // 4
    out = {}
    for name, interval in intervals.items():
        sparse_every, dense_every = interval if isinstance(interval, tuple) else (interval,) * 2
        replica = Replica(workdir, embedding)
        labels, scores, stale = [], [], []
        for b in range(first, len(stream)):
            since = b - first
            if since == 0 or (sparse_every and since % sparse_every == 0):
                replica.sync(b, dense=since == 0 or bool(dense_every and since % dense_every == 0))
            scores.append(replica.score(stream[b]))
            labels.append(stream[b][3][:, 0])
            stale.append((b + 0.5 - replica.position) * spec.batch_stream_sec)
        entries = replica.ps.stats()["item"]["entries"]
        out[name] = {"auc": roc_auc(np.concatenate(labels), np.concatenate(scores)),
                     "staleness_sec": float(np.mean(stale)), "item_rows": int(entries)}
        replica.ps.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=400, help="stream length in batches")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--short", type=int, default=8,
                        help="short interval, in batches (8: 29 stream-min)")
    parser.add_argument("--medium", type=int, default=17,
                        help="medium interval, in batches (17: 61 stream-min)")
    parser.add_argument("--long", type=int, default=83,
                        help="long interval, in batches (83: 5 stream-h)")
    parser.add_argument("--item-expiry", type=int, default=100,
                        help="item rows unseen for this many lookups expire in training")
    parser.add_argument("--repeats", type=int, default=3,
                        help="training runs of each kind (no export, short), alternated")
    parser.add_argument("--warmup-batches", type=int, default=WARMUP_BATCHES,
                        help="untimed batches at the start of each training run")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parse_args_with_smoke(parser, argv, batches=12, batch_size=32, short=2, medium=3,
                                 long=5, item_expiry=6, repeats=1, warmup_batches=2)
    spec = Stream(num_batches=args.batches, batch_size=args.batch_size)
    stream = spec.batches()
    hours = spec.num_batches * spec.batch_stream_sec / 3600
    print(f"stream: {spec.num_batches} batches of {spec.batch_size} over {hours:.0f} h of "
          f"stream time ({spec.batch_stream_sec:.0f} s per batch), "
          f"{spec.items_per_batch} new items per batch, seed {spec.seed}")
    throughput: dict[str, list[float]] = {"no_export": [], "short": []}
    with tempfile.TemporaryDirectory(prefix="online_freshness-") as tmp:
        # Not timed: the first run of a session fills numba's kernel cache and the page
        # cache, and would otherwise slow whichever kind runs first (a smoke times nothing).
        if not args.smoke:
            train(stream[:args.warmup_batches * 2], Path(tmp) / "warm-up", short=None,
                  item_expiry=args.item_expiry, warmup=args.warmup_batches)
        for r in range(args.repeats):
            for kind, short in (("no_export", None), ("short", args.short)):
                rate = train(stream, Path(tmp) / f"{kind}-{r}", short=short,
                             item_expiry=args.item_expiry, warmup=args.warmup_batches)
                throughput[kind].append(rate)
                print(f"training run {r + 1} ({kind}): {rate:.0f} samples/s", flush=True)
        intervals = {"never": None, "long": args.long, "medium": args.medium,
                     "short": args.short, "short_sparse_long_dense": (args.short, args.long)}
        served = replay(stream, Path(tmp) / "short-0", intervals, spec, args.item_expiry)
    def every(interval: int | tuple[int, int] | None) -> str:
        if interval is None:
            return "never (state at 1/4 of the stream)"
        if isinstance(interval, tuple):
            return f"sparse {every(interval[0])}, dense {every(interval[1])}"
        return f"every {interval * spec.batch_stream_sec / 60:.0f} stream-min"

    for name, figures in served.items():
        print(f"serving {name:24s} {every(intervals[name]):48s} AUC {figures['auc']:.4f}  mean staleness "
              f"{figures['staleness_sec'] / 60:.0f} stream-min  item rows {figures['item_rows']}")
    rates = {k: statistics.median(v) for k, v in throughput.items()}
    ratio = rates["short"] / rates["no_export"]
    gain = served["short"]["auc"] - served["never"]["auc"]
    seen = np.unique(np.concatenate([b[1] for b in stream])).size
    print(f"items in the whole stream: {seen}; the replicas hold only those the training side "
          f"had not expired (unseen for {args.item_expiry} lookups) at their last sync")
    print(f"AUC gain short vs never: {gain:+.4f} (target > 0.01)")
    print(f"training throughput: {rates['short']:.0f} samples/s exporting every {args.short} "
          f"batches vs {rates['no_export']:.0f} with no export: {ratio:.3f}x (target >= 0.9)")
    result = {f"auc_{k}": v["auc"] for k, v in served.items()}
    result.update({f"staleness_sec_{k}": v["staleness_sec"] for k, v in served.items()})
    result.update({f"item_rows_{k}": v["item_rows"] for k, v in served.items()})
    result.update(auc_gain_short_vs_never=gain, items_in_stream=seen, throughput_no_export=rates["no_export"],
                  throughput_short=rates["short"], throughput_ratio_short_vs_no_export=ratio,
                  throughput_runs=throughput, stream=asdict(spec),
                  intervals_batches={k: v for k, v in intervals.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
