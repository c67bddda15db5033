"""Data loader of tests/test_online_training.py: follows a folder of CSV files
(``sid,label,x,user,item``) with exact positions; each batch's sample ids travel as its
meta bytes so the NN workers can say which samples they trained."""

import argparse
import logging

import numpy as np

from persia_py.ctx import DataCtx
from persia_py.data_readers import CsvColumn, CsvReaderConfig
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.env import PersiaEnv
from persia_py.stream_reader import CsvFormat, StreamReader
from persia_py.stream_source import follow

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
           CsvColumn(name="x", kind="float"), CsvColumn(name="user", kind="ids"),
           CsvColumn(name="item", kind="ids"))

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", required=True)
    parser.add_argument("--positions", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    index = PersiaEnv.from_environ().data_loader_replica_index
    reader = StreamReader(args.stream, CsvFormat(CsvReaderConfig(columns=COLUMNS, header=True)),
                          pattern="*.csv", poll_interval_sec=0.05, max_wait_sec=0.2)
    with DataCtx() as ctx:
        for part in follow(ctx, reader, batch_size=args.batch_size,
                           position_log=f"{args.positions}/loader-{index}.positions"):
            r = part.records
            ctx.send_data(PersiaBatch(
                [IDTypeFeatureWithSingleID("user", r.id_lists["user"][0]),
                 IDTypeFeatureWithSingleID("item", r.id_lists["item"][0])],
                non_id_type_features=[NonIDTypeFeature(r.values["x"][:, None], name="x")],
                labels=[Label(r.values["label"][:, None], name="click")],
                meta=r.values["sid"].astype(np.int64).tobytes(),
            ))
