"""Data loader of tests/test_online_training.py: follows a folder of CSV files
(``sid,label,x,user,item``) with exact positions; each batch's sample ids travel as its
meta bytes so the NN workers can say which samples they trained.

How its stream ends: never (the job is stopped by SIGTERM); ``--idle-timeout-sec`` after
that long without data; ``--end-after-batches N`` after N batches of this run (the script
ends the stream: ``reader.stop``); ``--finite``: no stream at all, the files there at
start are read once, each a batch at a time (a loader's natural end; started again it
makes the same batches again, and skips those trained). ``--crash-after-batches``: a
crash of its own, once."""

import argparse
import logging
import os

import numpy as np

from persia_py.ctx import DataCtx
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.env import PersiaEnv
from persia_py.input.readers import CsvColumn, CsvReader, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamReader
from persia_py.stream_source import follow

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
           CsvColumn(name="x", kind="float"), CsvColumn(name="user", kind="ids"),
           CsvColumn(name="item", kind="ids"))



def _send(ctx: DataCtx, r) -> None:
    ctx.send_data(PersiaBatch(
        [IDTypeFeatureWithSingleID("user", r.id_lists["user"][0]),
         IDTypeFeatureWithSingleID("item", r.id_lists["item"][0])],
        non_id_type_features=[NonIDTypeFeature(r.values["x"][:, None], name="x")],
        labels=[Label(r.values["label"][:, None], name="click")],
        meta=r.values["sid"].astype(np.int64).tobytes(),
    ))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", required=True)
    parser.add_argument("--positions", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--idle-timeout-sec", type=float, default=None)
    parser.add_argument("--end-after-batches", type=int, default=None)
    parser.add_argument("--finite", action="store_true")
    parser.add_argument("--crash-after-batches", type=int, default=None,
                        help="fail with an error of its own (not a data error) after this "
                             "many batches of a run, once: the first run to get there "
                             "creates --crash-marker")
    parser.add_argument("--crash-marker", default=None)
    args = parser.parse_args()
    index = PersiaEnv.from_environ().data_loader_replica_index
    config = CsvReaderConfig(columns=COLUMNS, header=True)
    with DataCtx() as ctx:
        if args.finite:
            for name in sorted(os.listdir(args.stream)):
                if name.endswith(".csv"):
                    for records in CsvReader(os.path.join(args.stream, name),
                                             config).batches(args.batch_size):
                        _send(ctx, records)
        else:
            reader = StreamReader(args.stream, CsvFormat(config), pattern="*.csv",
                                  poll_interval_sec=0.05, max_wait_sec=0.2,
                                  idle_timeout_sec=args.idle_timeout_sec)
            for num_sent, part in enumerate(follow(
                    ctx, reader, batch_size=args.batch_size,
                    position_log=f"{args.positions}/loader-{index}.positions"), 1):
                _send(ctx, part.records)
                if num_sent == args.crash_after_batches and not os.path.exists(
                        args.crash_marker):
                    open(args.crash_marker, "w").close()
                    raise RuntimeError("the loader's own bug (injected by the test)")
                if num_sent == args.end_after_batches:
                    reader.stop.set()
