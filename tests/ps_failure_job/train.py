"""NN worker of tests/test_ps_failure.py: trains the synthetic Criteo model on the stream
and prints how many batches it trained, how many distinct batch numbers it saw and which."""

import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"))
from model import DLRM  # noqa: E402

from persia_py.ctx import TrainCtx  # noqa: E402
from persia_py.data import DataLoader, StreamingDataset  # noqa: E402
from persia_py.embedding.optim import Adagrad  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = DLRM()
    seen: list[int] = []
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05)) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=8), embedding_staleness=4):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            seen.append(int(batch.meta.decode()))
            if len(seen) % 10 == 0:
                print(f"trained step {len(seen)}", flush=True)
        ctx.flush()
    print(f"trained {len(seen)} batches, {len(set(seen))} distinct", flush=True)
    print(f"trained batch ids {','.join(map(str, sorted(seen)))}", flush=True)
