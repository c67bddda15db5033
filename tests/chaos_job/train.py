"""NN worker of tests/test_chaos.py: the synthetic Criteo example's training, printing
progress every 10 steps; at the end each rank writes the data-loader batch ids this run
trained into ``OUT/ids-rank<r>.txt`` and rank 0 prints the test AUC. Lines go out in one
write each: the launcher's roles run unbuffered, and print's separate write of the line
end would let two ranks' lines run into each other."""

import argparse
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


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--lr", type=float, default=0.05, help="of both optimizers")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DLRM()
    ids: list[int] = []
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=args.lr),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=args.lr)) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=8), embedding_staleness=4):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            ids.append(batch.batch_id)
            if len(ids) % 10 == 0:
                say(f"rank {get_rank()} trained step {len(ids)}")
        ctx.flush()
        Path(args.out, f"ids-rank{get_rank()}.txt").write_text(",".join(map(str, sorted(ids))))
        if get_rank() == 0:
            say(f"test_auc: {evaluate(model, 20_000):.5f}")
