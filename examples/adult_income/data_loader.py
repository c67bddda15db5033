"""Data loader of the adult-income example: sends one epoch of the training split."""

import argparse
import logging

from adult_data import SLOTS, batches

from persia_py.ctx import DataCtx
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.env import PersiaEnv

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True, help="path of adult.csv")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    env = PersiaEnv.from_environ()
    with DataCtx() as ctx:
        for dense, ids, labels in batches(args.csv, "train", args.batch_size,
                                          part=env.data_loader_replica_index,
                                          num_parts=env.data_loader_replica_size):
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID(slot, slot_ids) for slot, slot_ids in zip(SLOTS, ids)],
                non_id_type_features=[NonIDTypeFeature(dense, name="numeric")],
                labels=[Label(labels, name="income")],
            ))
