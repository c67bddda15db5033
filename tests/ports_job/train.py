"""NN worker of tests/test_ports.py: once every rank has joined the process group (so
every port the job opens is open), rank 0 prints the rendezvous store's port and waits
until the test has probed the ports (it reads the FIFO ``--hold`` until the test closes
it); every rank waits for rank 0 at a barrier, then trains the short stream."""

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"))
from model import DLRM  # noqa: E402

from persia_py.ctx import TrainCtx  # noqa: E402
from persia_py.data import DataLoader, StreamingDataset  # noqa: E402
from persia_py.embedding.optim import Adagrad  # noqa: E402
from persia_py.env import get_rank  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", required=True, help="a FIFO rank 0 reads to its end")
    args = parser.parse_args()
    model = DLRM()
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05)) as ctx:
        if get_rank() == 0:
            print(f"ports open; store on {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']}", flush=True)
            with open(args.hold) as fifo:
                fifo.read()
        dist.barrier()
        for batch in DataLoader(StreamingDataset(buffer_size=8)):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        ctx.flush()
    print(f"rank {get_rank()} done", flush=True)
