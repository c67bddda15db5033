"""Data loader of tests/test_chaos.py: the synthetic Criteo example's loader (its share
of the training split), printing how many batches its script made, skipped ones too."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"))
from data_generator import SLOT_NAMES, make_batches  # noqa: E402

from persia_py.ctx import DataCtx  # noqa: E402
from persia_py.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.env import PersiaEnv  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-samples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    env = PersiaEnv.from_environ()
    made = 0
    with DataCtx() as ctx:
        for dense, ids, labels in make_batches(
                "train", args.train_samples, args.batch_size,
                part=env.data_loader_replica_index, num_parts=env.data_loader_replica_size):
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID(n, i) for n, i in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)]))
            made += 1
    print(f"loader {env.data_loader_replica_index} made {made} batches", flush=True)
