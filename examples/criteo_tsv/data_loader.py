"""Data loader of the Criteo-TSV example: sends the records of its share of the file.

There is no sharding code here: with ``--num-data-loaders n`` every loader's CSV reader
reads only its own share of the file (see persia_py.reader_share).
"""

import argparse
import logging

from criteo_layout import read_batches

from persia_py.ctx import DataCtx

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True, help="TSV file in Criteo's layout")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    with DataCtx() as ctx:
        for batch in read_batches(args.train, args.batch_size):
            ctx.send_data(batch)
