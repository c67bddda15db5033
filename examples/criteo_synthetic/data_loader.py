"""Data loader of the synthetic Criteo example: sends its share of the training split."""

import argparse
import logging

from data_generator import SLOT_NAMES, make_batches

from persia_py.ctx import DataCtx
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.env import PersiaEnv

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    env = PersiaEnv.from_environ()
    with DataCtx() as ctx:
        for dense, ids, labels in make_batches(
            "train", args.train_samples, args.batch_size,
            part=env.data_loader_replica_index, num_parts=env.data_loader_replica_size,
        ):
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID(name, slot_ids) for name, slot_ids in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense, name="dense")],
                labels=[Label(labels, name="click")],
            ))
