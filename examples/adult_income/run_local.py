"""Run the adult-income example on a local cluster.

    python examples/adult_income/run_local.py --csv ../shared/data/adult.csv \
        --nproc-per-node 2 --embedding-staleness 8
"""

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", required=True, help="path of adult.csv")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="NN-worker ranks")
    parser.add_argument("--embedding-staleness", type=int, default=1)
    parser.add_argument("--num-ps", type=int, default=1)
    parser.add_argument("--reproducible", action="store_true")
    parser.add_argument("--loss-log", default=None, help="write every step's loss here")
    parser.add_argument("--embedding-config", default=str(HERE / "embedding_config.yml"),
                        help="the slots (e.g. a copy with row_dtype: float16)")
    parser.add_argument("--global-config", default=str(HERE / "global_config.yml"))
    args = parser.parse_args()
    csv = os.path.abspath(args.csv)
    train_args = f"--csv {csv} --embedding-staleness {args.embedding_staleness}"
    if args.reproducible:
        train_args += " --reproducible"
    if args.loss_log:
        train_args += f" --loss-log {os.path.abspath(args.loss_log)}"
    command = [
        sys.executable, "-m", "persia_py.launcher.cli", "local",
        "--nn-worker", str(HERE / "train.py"), "--data-loader", str(HERE / "data_loader.py"),
        "--embedding-config", os.path.abspath(args.embedding_config),
        "--global-config", os.path.abspath(args.global_config),
        "--num-ps", str(args.num_ps), "--nproc-per-node", str(args.nproc_per_node),
        "--nn-worker-args", train_args, "--data-loader-args", f"--csv {csv}",
    ]
    os.execv(sys.executable, command)
