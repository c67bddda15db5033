"""NN worker of tests/test_online_training.py: trains the stream until SIGTERM
(``TrainCtx(stop_on_signal=True)``), with progressive validation every 4 steps (GAUC
grouped by sample id modulo 7). After each step a rank appends the sample ids it
trained to ``OUT/ids-rank<r>.txt`` (a line per step; each start of the rank appends that
file's line count to ``OUT/starts-rank<r>.txt``) and prints its running sample count, each
in one write: the launcher's roles run unbuffered, and two ranks' lines must not interleave.
With ``--test-csv FILE`` (rows as the stream's, never trained), rank 0 then scores them and
prints ``test_auc: <value>``, as the synthetic Criteo example does."""

import argparse
import logging
import os
import sys
import threading
import time

import numpy as np
import torch

from persia_py.ctx import TrainCtx, eval_ctx
from persia_py.data import DataLoader, IterableDataset, StreamingDataset
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.embedding.optim import Adagrad
from persia_py.env import get_rank
from persia_py.input.readers import CsvColumn, CsvReader, CsvReaderConfig
from persia_py.metrics import roc_auc
from persia_py.progressive import ProgressiveValidation
from persia_py.workers.handover_log import read_handovers

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
           CsvColumn(name="x", kind="float"), CsvColumn(name="user", kind="ids"),
           CsvColumn(name="item", kind="ids"))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1 + 8 + 8, 1)

    def forward(self, dense, embeddings):
        return torch.sigmoid(self.linear(torch.cat([dense[0], *embeddings], dim=1)))


class TestRows(IterableDataset):
    """The rows of a CSV file as the data loader's, scored only (no gradients)."""

    def __init__(self, path: str) -> None:
        super().__init__(buffer_size=4)
        self.path = path

    def __iter__(self):
        for r in CsvReader(self.path, CsvReaderConfig(columns=COLUMNS, header=True)).batches(256):
            yield PersiaBatch(
                [IDTypeFeatureWithSingleID("user", r.id_lists["user"][0]),
                 IDTypeFeatureWithSingleID("item", r.id_lists["item"][0])],
                non_id_type_features=[NonIDTypeFeature(r.values["x"][:, None], name="x")],
                labels=[Label(r.values["label"][:, None], name="click")], requires_grad=False)


def score_auc(model: torch.nn.Module, path: str) -> float:
    scores, labels = [], []
    with eval_ctx(model=model) as ctx:
        for batch in DataLoader(TestRows(path)):
            output, batch_labels = ctx.forward(batch)
            scores.append(output.float().cpu().numpy().reshape(-1))
            labels.append(batch_labels[0].cpu().numpy().reshape(-1))
    return roc_auc(np.concatenate(labels), np.concatenate(scores))


LATE_START_SEC = 2.0
"""How much later than rank 0 reaching ``--rank1-after`` rank 1 starts taking batches."""


def _wait_for_rank0(run_dir: str, count: int, timeout: float = 60.0) -> None:
    """Until the data loader's handover log (in the run folder) says it handed rank 0 at
    least ``count`` batches; TimeoutError after ``timeout`` seconds."""
    log = os.path.join(run_dir, "data-loader-0-handovers.log")
    deadline = time.monotonic() + timeout
    while sum(h.rank == 0 for h in read_handovers(log).in_training.values()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 was not handed {count} batches within {timeout} s")
        threading.Event().wait(0.02)  # the log is a file: no event to wait on but its lines


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank1-after", type=int, default=0,
                        help="rank 1 starts taking batches only once the loader has handed "
                             f"rank 0 this many, and {LATE_START_SEC:g} s after that (a rank "
                             "that starts late)")
    parser.add_argument("--test-csv", default=None,
                        help="after training, rank 0 prints the test AUC of these rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model()
    rank = get_rank()
    os.makedirs(args.out, exist_ok=True)
    ids_path = os.path.join(args.out, f"ids-rank{rank}.txt")
    ids_file = os.open(ids_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with open(ids_path, "rb") as f, open(os.path.join(args.out, f"starts-rank{rank}.txt"),
                                          "a") as starts:
        # Where this run of the rank starts in its ids file (a line per step): a rank
        # restarted from a checkpoint trains the steps after it again.
        starts.write(f"{sum(1 for _ in f)}\n")
    num_samples = 0
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05),
                  stop_on_signal=True, progressive_validation=ProgressiveValidation(
                      every_steps=4, group_by=lambda b: np.frombuffer(b.meta, np.int64) % 7),
                  ) as ctx:
        if rank == 1 and args.rank1_after:
            _wait_for_rank0(args.out, args.rank1_after)
            # The late start itself (not a wait for a result): time for rank 0 to take
            # the rest of the stream if nothing bounded it, as it did before MAX_LEAD.
            time.sleep(LATE_START_SEC)
        for batch in DataLoader(StreamingDataset(buffer_size=4), embedding_staleness=2):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            sids = np.frombuffer(batch.meta, dtype=np.int64)
            os.write(ids_file, (" ".join(map(str, sids.tolist())) + "\n").encode())
            num_samples += sids.size
            sys.stdout.write(f"rank {rank} trained {num_samples} samples\n")
            sys.stdout.flush()
        if args.test_csv and rank == 0:
            print(f"test_auc: {score_auc(model, args.test_csv):.5f}", flush=True)
    os.close(ids_file)
    sys.stdout.write(f"rank {rank} stopped cleanly after {num_samples} samples\n")
    sys.stdout.flush()
