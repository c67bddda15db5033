"""NN worker of the synthetic Criteo example: trains on the stream, then rank 0 evaluates
on the test split and prints ``test_auc: <value>``."""

import argparse
import logging

import numpy as np
import torch
from data_generator import SLOT_NAMES, make_batches
from model import DLRM

from persia_py.ctx import TrainCtx, eval_ctx
from persia_py.data import DataLoader, IterableDataset, StreamingDataset
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.embedding.optim import Adagrad
from persia_py.env import get_rank
from persia_py.metrics import roc_auc

logger = logging.getLogger("train")


class TestDataset(IterableDataset):
    def __init__(self, num_samples: int, batch_size: int) -> None:
        super().__init__(buffer_size=4)
        self.num_samples, self.batch_size = num_samples, batch_size

    def __iter__(self):
        for dense, ids, labels in make_batches("test", self.num_samples, self.batch_size):
            yield PersiaBatch(
                [IDTypeFeatureWithSingleID(n, i) for n, i in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)],
                labels=[Label(labels)],
                requires_grad=False,
            )


def evaluate(model: torch.nn.Module, num_samples: int) -> float:
    preds, labels = [], []
    with eval_ctx(model=model) as ctx:
        for batch in DataLoader(TestDataset(num_samples, 1024)):
            output, batch_labels = ctx.forward(batch)
            preds.append(output.float().cpu().numpy().reshape(-1))  # .cpu(): outputs may be on a GPU
            labels.append(batch_labels[0].cpu().numpy().reshape(-1))
    return roc_auc(np.concatenate(labels), np.concatenate(preds))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--embedding-staleness", type=int, default=4)
    parser.add_argument("--test-samples", type=int, default=20_000)
    parser.add_argument("--dense-lr", type=float, default=0.05)
    parser.add_argument("--embedding-lr", type=float, default=0.05)
    parser.add_argument("--reproducible", action="store_true")
    parser.add_argument("--loss-log", default=None, help="write every step's loss here (rank 0)")
    args = parser.parse_args()

    torch.manual_seed(0)
    rank = get_rank()
    model = DLRM()
    loss_fn = torch.nn.BCELoss()
    with TrainCtx(
        model=model,
        embedding_optimizer=Adagrad(lr=args.embedding_lr),
        dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=args.dense_lr),
    ) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=8), reproducible=args.reproducible,
                            embedding_staleness=args.embedding_staleness)
        losses = []
        for step, batch in enumerate(loader):
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            ctx.backward(loss)
            losses.append(loss.item())
            if rank == 0 and step % 50 == 0:
                logger.info("step %d loss %.4f staleness %d", step, losses[-1], ctx.staleness)
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "w") as f:
                f.writelines(f"{loss!r}\n" for loss in losses)
        if rank == 0:
            auc = evaluate(model, args.test_samples)
            ctx.log(test_auc=auc)  # into the training log, for `persia-launcher plot`
            print(f"test_auc: {auc:.5f}", flush=True)
