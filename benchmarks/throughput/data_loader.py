"""Data loader of the throughput benchmark: sends a workload's batches.

Batches are built before sending starts, as the plain-PyTorch baseline builds its batches
before its clock starts: both sides then train on ready data. ``--count-rows`` prints how
many distinct ids per slot, summed over the slots, the batches hold (``figures:
table_rows=N``: the rows the parameter servers hold at the end).
"""

import argparse

import numpy as np
from workloads import SLOT_NAMES, WORKLOADS, add_size_options, sized

from persia_py.ctx import DataCtx
from persia_py.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--smoke", action="store_true", help="the workload's tiny version")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--count-rows", action="store_true",
                        help="print the distinct ids of the batches, per slot, summed")
    add_size_options(parser)
    args = parser.parse_args()
    w = sized(args)
    lengths = np.full(w.batch_size, w.ids_per_slot, np.int32)
    batches = []
    for i in range(args.steps):
        dense, ids, labels = w.batch(i)
        batches.append(PersiaBatch(
            [IDTypeFeature.from_csr(n, slot_ids, lengths) for n, slot_ids in zip(SLOT_NAMES, ids)],
            non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)],
        ))
    if args.count_rows:
        rows = sum(np.unique(np.concatenate([b.id_type_features[slot].ids for b in batches]))
                   .size for slot in range(len(SLOT_NAMES)))
        print(f"figures: table_rows={rows}", flush=True)
    with DataCtx(buffer_size=8) as ctx:
        for batch in batches:
            ctx.send_data(batch)
