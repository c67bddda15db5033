"""NN worker of the Criteo-TSV example: trains on the data loaders' stream, then every
rank evaluates its share of a test file, the ranks' sums are added up, and rank 0 prints
``test_auc: <value> test_logloss: <value>`` of the whole file.

``--trained-rows DIR`` writes the ids (line numbers) of the rows this rank trained to
``DIR/rank-<rank>.npy``: the test checks every row was trained exactly once.
"""

import argparse
import logging
import os

import numpy as np
import torch
from criteo_layout import TsvDataset
from model import ConcatMLP

from persia_py.ctx import TrainCtx, eval_ctx
from persia_py.data import DataLoader, StreamingDataset
from persia_py.embedding.optim import Adagrad
from persia_py.env import get_rank, get_world_size
from persia_py.metrics import BinaryStats
from persia_py.reader_share import ReaderShare

logger = logging.getLogger("train")


def evaluate(model: torch.nn.Module, path: str, device: torch.device) -> BinaryStats:
    """AUC, log loss and normalized entropy on the whole test file: each rank scores its
    share of the lines (the reader's shares, here by rank), and the ranks' sums are added
    up (one all_reduce; every rank calls it and gets the totals)."""
    stats = BinaryStats()
    share = ReaderShare(get_rank(), get_world_size())
    with eval_ctx(model=model) as ctx:
        for batch in DataLoader(TsvDataset(path, batch_size=1024, requires_grad=False,
                                           share=share)):
            logits, labels = ctx.forward(batch)
            # .cpu() first: on a GPU the outputs live in device memory.
            stats.update(labels[0].cpu().numpy().reshape(-1),
                         torch.sigmoid(logits.float()).cpu().numpy().reshape(-1))
    return stats.all_reduced(device)  # NCCL's collectives run on the rank's GPU


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--test", required=True, help="TSV test file in Criteo's layout")
    parser.add_argument("--trained-rows", default=None, metavar="DIR")
    parser.add_argument("--dense-lr", type=float, default=0.05)
    parser.add_argument("--embedding-lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    rank = get_rank()
    model = ConcatMLP()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    trained = []
    with TrainCtx(
        model=model,
        embedding_optimizer=Adagrad(lr=args.embedding_lr),
        dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=args.dense_lr),
    ) as ctx:  # TrainCtx picks cuda:LOCAL_RANK by itself where CUDA is available
        for step, batch in enumerate(DataLoader(StreamingDataset(buffer_size=8),
                                                embedding_staleness=4)):
            logits, labels = ctx.forward(batch)
            loss = loss_fn(logits, labels[0])
            ctx.backward(loss)
            trained.append(np.frombuffer(batch.meta, dtype="<i8"))
            if rank == 0 and step % 20 == 0:
                logger.info("step %d loss %.4f", step, loss.item())
        if args.trained_rows:
            os.makedirs(args.trained_rows, exist_ok=True)
            np.save(os.path.join(args.trained_rows, f"rank-{rank}.npy"),
                    np.concatenate(trained) if trained else np.zeros(0, np.int64))
        stats = evaluate(model, args.test, ctx.device)
        if rank == 0:
            ctx.log(test_auc=stats.auc(), test_logloss=stats.log_loss())
            print(f"test_auc: {stats.auc():.5f} test_logloss: {stats.log_loss():.5f}",
                  flush=True)
