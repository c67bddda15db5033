"""NN worker of tests/test_serving.py: trains the synthetic Criteo model on the stream,
evaluates the first test batches through ``eval_ctx`` (their predictions to --predictions,
a .npy file) and dumps a checkpoint into --checkpoint."""

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"))
from data_generator import SLOT_NAMES, make_batches  # noqa: E402
from model import DLRM  # noqa: E402

from persia_py.ctx import TrainCtx, eval_ctx  # noqa: E402
from persia_py.data import DataLoader, IterableDataset, StreamingDataset  # noqa: E402
from persia_py.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import Adagrad  # noqa: E402


class TestBatches(IterableDataset):
    def __init__(self, num_samples: int, batch_size: int) -> None:
        super().__init__(buffer_size=4)
        self.num_samples, self.batch_size = num_samples, batch_size

    def __iter__(self):
        for dense, ids, _ in make_batches("test", self.num_samples, self.batch_size):
            yield PersiaBatch([IDTypeFeatureWithSingleID(n, i) for n, i in zip(SLOT_NAMES, ids)],
                              non_id_type_features=[NonIDTypeFeature(dense)],
                              requires_grad=False)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--predictions", required=True)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--test-batch-size", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DLRM()
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05)) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=8), embedding_staleness=4):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        with eval_ctx(model=model) as evaluation:
            predictions = [evaluation.forward(b)[0].cpu().numpy() for b in
                           DataLoader(TestBatches(args.test_samples, args.test_batch_size))]
        np.save(args.predictions, np.concatenate(predictions), allow_pickle=False)
        ctx.dump_checkpoint(args.checkpoint)
    print(f"trained {ctx.checkpointer.steps} batches; predictions and checkpoint written",
          flush=True)
