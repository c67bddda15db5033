"""Data loader of tests/test_ps_failure.py: sends synthetic Criteo batches numbered in
their meta bytes and prints how many it sent."""

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

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    num_sent = 0
    with DataCtx() as ctx:
        for dense, ids, labels in make_batches("train", args.batches * args.batch_size,
                                               args.batch_size):
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID(n, i) for n, i in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)],
                labels=[Label(labels)],
                meta=str(num_sent).encode(),
            ))
            num_sent += 1
    print(f"sent {num_sent} batches", flush=True)
