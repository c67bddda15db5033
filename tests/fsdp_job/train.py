"""NN worker of the FSDP tests: the Criteo-shaped DLRM on batches made in each rank (its
own part of the synthetic data, with ids that no other rank uses, so that every rank's
embedding rows depend only on its own updates and a 2-rank run is deterministic)."""

import argparse
import json
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"
sys.path.insert(0, str(EXAMPLE))

from data_generator import SLOT_NAMES, make_batches  # noqa: E402
from model import DLRM  # noqa: E402

from persia_py.ctx import TrainCtx  # noqa: E402
from persia_py.data import DataLoader, IterableDataset  # noqa: E402
from persia_py.distributed import DDPOption, FSDPOption  # noqa: E402
from persia_py.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import Adagrad  # noqa: E402
from persia_py.env import PersiaEnv  # noqa: E402

BATCH = 64


class RankBatches(IterableDataset):
    def __init__(self, steps: int, rank: int, world: int) -> None:
        super().__init__(buffer_size=4)
        self.steps, self.rank, self.world = steps, rank, world

    def __iter__(self):
        for dense, ids, labels in make_batches("train", self.steps * BATCH * self.world, BATCH,
                                               part=self.rank, num_parts=self.world):
            yield PersiaBatch(
                [IDTypeFeatureWithSingleID(n, i * 2 + self.rank) for n, i in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--bound-units", type=int, default=0,
                        help="max_unsharded_bytes = this many of the largest unit's bytes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True, help="folder for losses and stats")
    parser.add_argument("--load", default=None)
    parser.add_argument("--dump", default=None)
    args = parser.parse_args()
    env = PersiaEnv.from_environ()
    torch.manual_seed(0)
    model = DLRM()
    if args.dist == "fsdp":
        bound = None
        if args.bound_units:
            sizes, _ = FSDPOption().sizes(model, env.world_size)
            bound = args.bound_units * max(sizes)
        option = FSDPOption(max_unsharded_bytes=bound)
    else:
        option = DDPOption()
    losses = []
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                  dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05),
                  distributed_option=option) as ctx:
        if args.load:
            ctx.load_checkpoint(args.load)
        if args.steps:
            for batch in DataLoader(RankBatches(args.steps, env.rank, env.world_size),
                                    embedding_staleness=1):
                output, labels = ctx.forward(batch)
                loss = torch.nn.functional.binary_cross_entropy(output, labels[0])
                ctx.backward(loss)
                losses.append(loss.item())
            ctx.flush()
        if args.dump:
            ctx.dump_checkpoint(args.dump)
        meter = getattr(ctx.dense, "meter", None)
        stats = {"steps": len(losses), "losses": losses,
                 "peak": None if meter is None else meter.peak,
                 "bound": None if meter is None else meter.bound,
                 "plan_forward": None if meter is None else meter.plan_forward,
                 "plan_backward": None if meter is None else meter.plan_backward}
        (Path(args.out) / f"rank{env.rank}.json").write_text(json.dumps(stats))
    print("done", len(losses), flush=True)


if __name__ == "__main__":
    main()
