"""NN worker of tests/test_chaos.py: the synthetic Criteo example's training, printing
progress every 10 steps and, at the end, the data-loader batch ids this run trained;
rank 0 then prints the test AUC."""

import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"))
from model import DLRM  # noqa: E402
from train import evaluate  # noqa: E402

from persia_py.ctx import TrainCtx  # noqa: E402
from persia_py.data import DataLoader, StreamingDataset  # noqa: E402
from persia_py.embedding.optim import Adagrad  # noqa: E402
from persia_py.env import get_rank  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = DLRM()
    ids: list[int] = []
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05)) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=8), embedding_staleness=4):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            ids.append(batch.batch_id)
            if len(ids) % 10 == 0:
                print(f"rank {get_rank()} trained step {len(ids)}", flush=True)
        ctx.flush()
        print(f"rank {get_rank()} trained batch ids {','.join(map(str, sorted(ids)))}",
              flush=True)
        if get_rank() == 0:
            print(f"test_auc: {evaluate(model, 20_000):.5f}", flush=True)
