"""NN worker of the adult-income example: one epoch, then rank 0 prints ``test_auc``."""

import argparse
import logging

import numpy as np
import torch
from adult_data import SLOTS, batches
from model import DNN

from persia_py.ctx import TrainCtx, eval_ctx
from persia_py.data import DataLoader, IterableDataset, StreamingDataset
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.embedding.optim import Adagrad
from persia_py.env import get_rank
from persia_py.metrics import roc_auc

logger = logging.getLogger("train")


class TestDataset(IterableDataset):
    def __init__(self, csv: str) -> None:
        super().__init__(buffer_size=4)
        self.csv = csv

    def __iter__(self):
        for dense, ids, labels in batches(self.csv, "test", 1024):
            yield PersiaBatch(
                [IDTypeFeatureWithSingleID(s, i) for s, i in zip(SLOTS, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)],
                requires_grad=False,
            )


def test_auc(model: torch.nn.Module, csv: str) -> float:
    preds, labels = [], []
    with eval_ctx(model=model) as ctx:
        for batch in DataLoader(TestDataset(csv)):
            output, batch_labels = ctx.forward(batch)
            preds.append(output.float().cpu().numpy().reshape(-1))  # .cpu(): outputs may be on a GPU
            labels.append(batch_labels[0].cpu().numpy().reshape(-1))
    return roc_auc(np.concatenate(labels), np.concatenate(preds))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True, help="path of adult.csv")
    parser.add_argument("--embedding-staleness", type=int, default=1)
    parser.add_argument("--reproducible", action="store_true")
    parser.add_argument("--loss-log", default=None, help="write every step's loss here (rank 0)")
    args = parser.parse_args()

    torch.manual_seed(3)
    rank = get_rank()
    model = DNN()
    loss_fn = torch.nn.BCELoss()
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=1e-2),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=16), reproducible=args.reproducible,
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
            print(f"test_auc: {test_auc(model, args.csv):.5f}", flush=True)
